// The cpu backend's quantised token bodies of two source trees in one process, on the thread CPU
// clock, one call of each in turn (a shared machine's disturbances hit both alike, where separate
// runs move by 20-40%): mha-fp8 (store_kv, static e4m3 scale 0.05), mha-int8-token / mha-int8-head
// and mha-fp8-token / mha-fp8-head (store_kv_quant, dynamic int8 / e4m3 scales), mla-fp8ds (store_mla, fp8_ds_mla rows) and dsv4-kv
// (store_dsv4_kv, the V4 fp8 record: power-of-two tile scales, pages of 256) as the bench
// cases build them (kvwrite.bench.cases: bf16 randn rows, pages of 16, a pool 4x the tokens, random
// rows), check off, one thread, the SIMD level simd_level() picks. Both sides' pools are compared
// byte for byte after the first calls. Each side is this file built against one tree's csrc, its
// namespace renamed:
//   F="-O3 -march=native -ffp-contract=off -fno-trapping-math -std=c++17"
//   g++ $F -DAB_SIDE=A -I /work/main/csrc -c bench/quant_ab.cpp -o /tmp/ab_a.o
//   g++ $F -DAB_SIDE=B -I csrc -c bench/quant_ab.cpp -o /tmp/ab_b.o
//   g++ $F bench/quant_ab.cpp /tmp/ab_a.o /tmp/ab_b.o -o /tmp/quant_ab && /tmp/quant_ab [rounds=200] [N=1024] [case,...] [mode]
// mode: store (the default: the bench's streaming source, random rows); compute (every token reads
// token 0's source and writes one row: the arithmetic and per-token work alone, as
// bench/quant_bound.cpp's compute runs); rows (token 0's source, the random rows); seq (the
// streaming source, the same rows in ascending order).
// AB_OUTLIER=x in the environment: every 64th input value times x (harness::inputs).
// Prints, per case, each side's 10th-percentile and median µs a call and the B / A ratios.
#include <algorithm>
#include <cstdlib>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <string>
#include <vector>

constexpr int H = 8, D = 128, L = 512, R = 64;
enum { MHA_FP8, INT8_TOKEN, INT8_HEAD, MLA_FP8DS, DSV4_KV, FP8_TOKEN, FP8_HEAD, NCASES };
static const char* const NAMES[NCASES] = {"mha-fp8", "mha-int8-token", "mha-int8-head", "mla-fp8ds", "dsv4-kv",
                                          "mha-fp8-token", "mha-fp8-head"};
// the pools' row bytes of each case: codes K, codes V, scales K, scales V (0: none)
static const int64_t ROWS[NCASES][4] = {
    {H * D, H * D, 0, 0}, {H * D, H * D, 4, 4}, {H * D, H * D, 4 * H, 4 * H}, {L + 4 * (L / 128) + 2 * R, 0, 0, 0},
    {584, 0, 0, 0},  // dsv4-kv: 576 data + 8 scale bytes a row, pages of 256 (the pool allocated in whole pages)
    {H * D, H * D, 4, 4}, {H * D, H * D, 4 * H, 4 * H}};

#ifdef AB_SIDE
#define AB_CAT2(a, b) a##b
#define AB_CAT(a, b) AB_CAT2(a, b)
#define kvwrite AB_CAT(kvwrite_side_, AB_SIDE)
#include "kvwrite/store_kv.h"
#include "kvwrite/store_kv_quant.h"
#include "kvwrite/store_dsv4.h"
#include "kvwrite/store_mla.h"
#include "quant_harness.h"

using namespace kvwrite;
using namespace harness;

namespace {

const float kStaticScale = 0.05f;  // the bench's mha-fp8 k_scale / v_scale

}  // namespace

// Case c over tokens [0, n): k / v bf16 rows [n, H, D] (MLA: k as [n, L + R + 64]) into pools[4];
// stream = false: every token reads token 0's rows (the compute runs).
extern "C" void AB_CAT(ab_run_, AB_SIDE)(int c, const uint16_t* k, const uint16_t* v, bool stream, const int64_t* loc,
                                         int64_t n, int64_t rows, char** pools) {
  const LocArgs a = loc_args(loc, n, rows);
  if (c == MHA_FP8) {
    StoreKVParams p;
    p.H = H;
    p.in_dtype = DType::BF16;
    p.cache_dtype = DType::E4M3;
    KVSide* sides[2] = {&p.k, &p.v};
    for (int s = 0; s < 2; ++s)
      *sides[s] = KVSide{reinterpret_cast<const char*>(s ? v : k), stream ? H * D : 0, D, cache_of(pools[s], H * D, D, 1), &kStaticScale, 0, D};
    p.locs = a;
    return run_tokens(p, [](auto&&... x) { dispatch_store_kv(x...); });
  }
  if (c == INT8_TOKEN || c == INT8_HEAD || c == FP8_TOKEN || c == FP8_HEAD) {
    StoreKVQuantParams p;
    p.H = H;
    p.in_dtype = DType::BF16;
    p.fmt = c == FP8_TOKEN || c == FP8_HEAD ? FMT_E4M3 : FMT_INT8;
    p.quant = c == INT8_HEAD || c == FP8_HEAD ? QUANT_HEAD : QUANT_TOKEN;
    p.rule = RULE_RNE;
    KVQuantSide* sides[2] = {&p.k, &p.v};
    for (int s = 0; s < 2; ++s) {
      KVQuantSide& q = *sides[s];
      q.src = reinterpret_cast<const char*>(s ? v : k);
      q.s_tok = stream ? H * D : 0;
      q.s_head = D;
      q.D = D;
      q.cache = cache_of(pools[s], H * D, D, 1);
      q.scales = cache_of(pools[2 + s], ROWS[c][2 + s], 1, 4);
    }
    p.locs = a;
    return run_tokens(p, [](auto&&... x) { dispatch_store_kv_quant(x...); });
  }
  if (c == DSV4_KV) {  // kv [n, 512]: k's first 512 of each 1024
    StoreDSV4KVParams p;
    p.kv = reinterpret_cast<const char*>(k);
    p.kv_sn = stream ? H * D : 0;
    p.in_dtype = DType::BF16;
    p.cache.base = pools[0];
    p.cache.pool_page_size = 256;
    p.cache.data_row = 576;
    p.cache.scale_row = 8;
    p.cache.stride_page = 256 * 584;
    p.locs = a;
    return run_tokens(p, [](auto&&... x) { dispatch_store_dsv4_kv(x...); });
  }
  StoreMLAParams p;  // kv_c and k_pe: slices of one projection row of L + R + 64 (as the case)
  p.kv_c = reinterpret_cast<const char*>(k);
  p.k_pe = reinterpret_cast<const char*>(k + L);
  p.c_sn = p.pe_sn = stream ? L + R + 64 : 0;
  p.L = L;
  p.R = R;
  p.cache = cache_of(pools[0], ROWS[c][0], ROWS[c][0], 1);
  p.in_dtype = DType::BF16;
  p.cache_dtype = DType::U8;
  p.mode = MLA_DS_MLA;
  p.locs = a;
  run_tokens(p, [](auto&&... x) { dispatch_store_mla(x...); });
}

#else  // the driver
#include "quant_harness.h"

using harness::PPS;
using harness::thread_us;

extern "C" void ab_run_A(int, const uint16_t*, const uint16_t*, bool, const int64_t*, int64_t, int64_t, char**);
extern "C" void ab_run_B(int, const uint16_t*, const uint16_t*, bool, const int64_t*, int64_t, int64_t, char**);

static double pct(std::vector<double> t, double q) {
  std::sort(t.begin(), t.end());
  return t[size_t(q * double(t.size() - 1))];
}

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 200;
  const int64_t n = argc > 2 ? std::atoll(argv[2]) : 1024;
  const std::string only = argc > 3 ? argv[3] : "";
  const std::string mode = argc > 4 ? argv[4] : "store";
  const bool stream = mode == "store" || mode == "seq";
  harness::Inputs in = harness::inputs(n, H * D, std::getenv("AB_OUTLIER") ? std::atof(std::getenv("AB_OUTLIER")) : 0.0f);
  const std::vector<uint16_t>& k = in.k;
  const std::vector<uint16_t>& v = in.v;
  std::vector<int64_t>& loc = in.loc;
  const int64_t rows = in.rows;
  if (mode == "compute") loc.assign(n, PPS);  // token 0's source, one row (both stay in L1)
  if (mode == "seq") std::sort(loc.begin(), loc.end());
  std::printf("thread CPU µs a call, N=%lld, %d rounds (A, B alternating), mode %s\n\n", (long long)n, rounds, mode.c_str());
  std::printf("| case | A p10 | A median | B p10 | B median | B / A p10 | B / A median |\n|---|---:|---:|---:|---:|---:|---:|\n");
  for (int c = 0; c < NCASES; ++c) {
    if (!only.empty() && ("," + only + ",").find("," + std::string(NAMES[c]) + ",") == std::string::npos) continue;
    std::vector<std::vector<char>> pool[2];
    char* ptr[2][4];
    for (int s = 0; s < 2; ++s)
      for (int b = 0; b < 4; ++b) {
        pool[s].emplace_back(size_t((rows + 256) * ROWS[c][b]));
        ptr[s][b] = pool[s][b].data();
      }
    const auto run = [&](int s) { (s ? ab_run_B : ab_run_A)(c, k.data(), v.data(), stream, loc.data(), n, rows, ptr[s]); };
    run(0);
    run(1);
    long differ = 0;
    for (int b = 0; b < 4; ++b)
      for (size_t j = 0; j < pool[0][b].size(); ++j) differ += pool[0][b][j] != pool[1][b][j];
    std::vector<double> t[2];
    for (int r = 0; r < rounds; ++r)
      for (int q = 0; q < 2; ++q) {
        const int s = (r + q) % 2;
        const double a = thread_us();
        run(s);
        t[s].push_back(thread_us() - a);
      }
    std::printf("| %s | %.1f | %.1f | %.1f | %.1f | %.3f | %.3f |%s\n", NAMES[c], pct(t[0], 0.1), pct(t[0], 0.5),
                pct(t[1], 0.1), pct(t[1], 0.5), pct(t[1], 0.1) / pct(t[0], 0.1), pct(t[1], 0.5) / pct(t[0], 0.5),
                differ ? (" " + std::to_string(differ) + " bytes differ").c_str() : "");
    std::fflush(stdout);
  }
  return 0;
}
#endif
