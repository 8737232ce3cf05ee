// How close each quantised MHA store can come to the memcpy scatter on this CPU: the real token
// bodies of the cpu backend (csrc/kvwrite, one thread, check off, the SIMD level simd_level()
// picks), MHA Llama-3.1-8B layer (8 x 128 bf16, pages of 16, a pool 4x the tokens, random rows:
// kvwrite.bench.cases), each timed three ways in one run:
//   store    the bench's call: a streaming source, every token to its own random row;
//   compute  the same body with memory out of the way: every token reads token 0's source and
//            writes row 16 (both stay in L1), so only the arithmetic and per-token work remain;
//   scatter  memcpy of the bytes the store writes (codes, scales) from contiguous rows to the same
//            random rows (the report's memcpy-scatter).
// "best %" = scatter / compute: the share of the scatter the store would reach with its memory
// traffic free. A format whose best % is under the 40% target cannot reach it on this core
// however its memory side is scheduled. Thread CPU time, median of `reps` calls, rounds
// alternating the three; prints a markdown table.
//   g++ -O3 -march=native -ffp-contract=off -fno-trapping-math -std=c++17 -Icsrc bench/quant_bound.cpp -o /tmp/quant_bound
//   /tmp/quant_bound [reps=31] [N ...=1024 4096]
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kvwrite/store_kv.h"
#include "kvwrite/store_kv_nvfp4.h"
#include "kvwrite/store_kv_quant.h"
#include "quant_harness.h"

using namespace kvwrite;
using namespace harness;

namespace {

constexpr int H = 8, D = 128, ROW = 16;  // ROW: the compute runs' one row (page 1)

double median_us(const std::function<void()>& f, int reps) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double a = thread_us();
    f();
    t.push_back(thread_us() - a);
  }
  std::nth_element(t.begin(), t.begin() + t.size() / 2, t.end());
  return t[t.size() / 2];
}

// One pool buffer: rows of `row` bytes back to back (page-major [pages, PPS, ...] rows are).
struct Buf {
  std::vector<char> pool, staged;  // the cache, and N contiguous rows for the scatter
  i64 row;
  PagedCache cache(i64 head_elems, int elem_size) { return cache_of(pool.data(), row, head_elems, elem_size); }
};

struct Case {
  std::string name;
  std::vector<i64> row_bytes;  // the pool buffers' row widths
  // runs the body over tokens [0, n) of source `src` (s_tok elements a token) into `bufs`
  std::function<void(std::vector<Buf>&, const uint16_t* k, const uint16_t* v, i64 s_tok, const int64_t* loc, i64 n,
                     i64 rows)> run;
};

// A side's source fields: bf16 rows [n, H, D], s_tok elements a token (0: every token reads token 0's).
template <class Side>
Side& source(Side& q, const uint16_t* src, i64 s_tok) {
  q.src = reinterpret_cast<const char*>(src);
  q.s_tok = s_tok;
  q.s_head = D;
  q.D = D;
  return q;
}

const float kStaticScale = 0.05f;  // the bench's mha-fp8 k_scale / v_scale

Case store_kv_case(const char* name, DType cache_dtype) {
  const int es = cache_dtype == DType::BF16 ? 2 : 1;
  return {name, {H * D * es, H * D * es}, [=](std::vector<Buf>& b, const uint16_t* k, const uint16_t* v, i64 s_tok,
                                               const int64_t* loc, i64 n, i64 rows) {
    StoreKVParams p;
    p.H = H;
    p.in_dtype = DType::BF16;
    p.cache_dtype = cache_dtype;
    KVSide* sides[2] = {&p.k, &p.v};
    for (int s = 0; s < 2; ++s) {
      *sides[s] = KVSide{reinterpret_cast<const char*>(s ? v : k), s_tok, D, b[s].cache(D, es), &kStaticScale, 0, D};
    }
    p.locs = loc_args(loc, n, rows);
    run_tokens(p, [](auto&&... a) { dispatch_store_kv(a...); });
  }};
}

Case kv_quant_case(const char* name, int quant) {
  const int sh = quant == QUANT_HEAD ? H : 1;
  return {name, {H * D, H * D, 4 * sh, 4 * sh}, [=](std::vector<Buf>& b, const uint16_t* k, const uint16_t* v,
                                                     i64 s_tok, const int64_t* loc, i64 n, i64 rows) {
    StoreKVQuantParams p;
    p.H = H;
    p.in_dtype = DType::BF16;
    p.fmt = FMT_INT8;
    p.quant = quant;
    p.rule = RULE_RNE;
    for (int s = 0; s < 2; ++s) {
      KVQuantSide& q = source(s ? p.v : p.k, s ? v : k, s_tok);
      q.cache = b[s].cache(D, 1);
      q.scales = b[2 + s].cache(1, 4);
    }
    p.locs = loc_args(loc, n, rows);
    run_tokens(p, [](auto&&... a) { dispatch_store_kv_quant(a...); });
  }};
}

Case nvfp4_case() {
  const int nb = D / NVFP4_BLOCK;
  return {"mha-nvfp4", {H * D / 2, H * D / 2, H * nb, H * nb}, [=](std::vector<Buf>& b, const uint16_t* k,
                                                                  const uint16_t* v, i64 s_tok, const int64_t* loc,
                                                                  i64 n, i64 rows) {
    StoreKVNVFP4Params p;
    p.H = H;
    p.in_dtype = DType::BF16;
    for (int s = 0; s < 2; ++s) {
      NVFP4Side& q = source(s ? p.v : p.k, s ? v : k, s_tok);
      q.values = b[s].cache(D / 2, 1);
      q.scales = b[2 + s].cache(nb, 1);
    }
    p.locs = loc_args(loc, n, rows);
    run_tokens(p, [](auto&&... a) { dispatch_store_kv_nvfp4(a...); });
  }};
}

}  // namespace

int main(int argc, char** argv) {
  const int reps = argc > 1 ? std::atoi(argv[1]) : 31;
  std::vector<i64> sizes;
  for (int a = 2; a < argc; ++a) sizes.push_back(std::atoll(argv[a]));
  if (sizes.empty()) sizes = {1024, 4096};
  const Case cases[] = {store_kv_case("mha-bf16", DType::BF16), store_kv_case("mha-fp8", DType::E4M3),
                        kv_quant_case("mha-int8-token", QUANT_TOKEN), kv_quant_case("mha-int8-head", QUANT_HEAD),
                        nvfp4_case()};
  std::printf("simd level %d; thread CPU time, median of %d calls, one thread\n\n", simd_level(), reps);
  std::printf("| case | N | scatter µs | store µs | %% of scatter | compute µs | best %% (scatter / compute) |\n");
  std::printf("|---|---:|---:|---:|---:|---:|---:|\n");
  for (const i64 n : sizes) {
    Inputs in = inputs(n, H * D);
    const std::vector<uint16_t>& k = in.k;
    const std::vector<uint16_t>& v = in.v;
    const std::vector<int64_t>& loc = in.loc;
    const std::vector<int64_t> one(n, ROW);
    const i64 rows = in.rows;
    for (const Case& c : cases) {
      std::vector<Buf> bufs;
      for (const i64 w : c.row_bytes) bufs.push_back(Buf{std::vector<char>(rows * w), std::vector<char>(n * w), w});
      const auto store = [&] { c.run(bufs, k.data(), v.data(), H * D, loc.data(), n, rows); };
      const auto compute = [&] { c.run(bufs, k.data(), v.data(), 0, one.data(), n, rows); };
      store();  // the staged rows: the store's own output bytes
      for (Buf& b : bufs)
        for (i64 i = 0; i < n; ++i) std::memcpy(b.staged.data() + i * b.row, b.pool.data() + loc[i] * b.row, b.row);
      const auto scatter = [&] {
        for (i64 i = 0; i < n; ++i)
          for (Buf& b : bufs) std::memcpy(b.pool.data() + loc[i] * b.row, b.staged.data() + i * b.row, b.row);
      };
      double t[3] = {1e300, 1e300, 1e300};  // the best round's median of each
      for (int round = 0; round < 3; ++round) {
        t[0] = std::min(t[0], median_us(scatter, reps));
        t[1] = std::min(t[1], median_us(store, reps));
        t[2] = std::min(t[2], median_us(compute, reps));
      }
      std::printf("| %s | %lld | %.1f | %.1f | %.0f%% | %.1f | %.0f%% |\n", c.name.c_str(), (long long)n, t[0], t[1],
                  100 * t[0] / t[1], t[2], 100 * t[0] / t[2]);
      std::fflush(stdout);
    }
  }
  return 0;
}
