// The AVX-512 FP4 hot loops alone (csrc/kvwrite/simd_avx512_fp4.h: nvfp4_run_512, mxfp4_run_512)
// on the thread CPU clock: bf16 rows of randn values (as the bench cases), one row a call as the
// stores call them, rows streamed from a 4 MiB source to scattered slots, and one L1-resident
// 1024-value row. Outputs are checked against the AVX2 lanes (nvfp4_block_avx2, mxfp4_run_avx2).
// Compare two trees by building this file against each one's csrc, alternately:
//   g++ -O3 -march=native -ffp-contract=off -fno-trapping-math -std=c++17 -I csrc bench/fp4_loop.cpp -o /tmp/fp4_new
//   g++ ... -I /work/main/csrc bench/fp4_loop.cpp -o /tmp/fp4_old;  /tmp/fp4_old; /tmp/fp4_new; ...
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

#include "kvwrite/nvfp4.h"

using namespace kvwrite;

static double now_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e9 * double(t.tv_sec) + double(t.tv_nsec);
}

static uint16_t to_bf16(float f) {  // RNE
  const uint32_t b = float_to_bits(f);
  return uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

template <class F>
static double median_ns(F f, int reps = 21) {
  f();
  std::vector<double> t;
  for (int r = 0; r < reps; ++r) {
    const double a = now_ns();
    f();
    t.push_back(now_ns() - a);
  }
  std::sort(t.begin(), t.end());
  return t[reps / 2];
}

int main(int argc, char** argv) {
  if (!simd512_ok() || !e2m1_lut().ok) return std::puts("no AVX-512 lanes"), 1;
  const int T = 1024;  // tokens a pass
  const size_t nsrc = size_t(2) * 1024 * 1024;  // 4 MiB of bf16
  std::vector<uint16_t> src(nsrc + 64);
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  for (auto& v : src) v = to_bf16(nd(g));
  std::vector<int> slot(T);
  for (int i = 0; i < T; ++i) slot[i] = i;
  std::shuffle(slot.begin(), slot.end(), g);
  std::vector<char> out(size_t(T) * 1200), sc(size_t(T) * 160), ref(64 * 32), rsc(64);
  long bad = 0;

  // One NVFP4 row of nb blocks from row r of `rowlen` values (offset off) to its slot: checked once.
  const auto nv_row = [&](const uint16_t* x, int nb, char* o, char* s, float floor) {
    nvfp4_run_512(x, nb, o, s, floor);
  };
  const auto nv_check = [&](const uint16_t* x, int nb, const char* o, const char* s, float floor) {
    for (int b = 0; b < nb; ++b) nvfp4_block_avx2<DType::BF16>(x, 16 * b, nullptr, ref.data() + 8 * b, rsc.data() + b, floor);
    bad += memcmp(o, ref.data(), 8 * nb) != 0 || memcmp(s, rsc.data(), nb) != 0;
  };
  struct Case { const char* name; int nb0, nb1; float floor; };  // blocks of a row's first / second call
  const Case cases[] = {{"mha (64 + 64 blocks: K, V)", 64, 64, 0.0f}, {"mla (32 + 4 blocks)", 32, 4, 0.0f},
                        {"v4 record (28 blocks)", 28, 0, 0.0f}, {"v4.1 record (32 blocks, floor)", 32, 0, 0.001953125f}};
  const char* only = argc > 1 ? argv[1] : "";
  for (const Case& c : cases) {
    if (only[0] && !strstr(c.name, only)) continue;
    const int len = 16 * (c.nb0 + c.nb1), stride = len;
    const auto pass = [&](bool check) {
      for (int i = 0; i < T; ++i) {
        const uint16_t* x = src.data() + (size_t(i) * stride) % (nsrc - len);
        char* o = out.data() + size_t(slot[i]) * 1200;
        char* s = sc.data() + size_t(slot[i]) * 160;
        nv_row(x, c.nb0, o, s, c.floor);
        if (check) nv_check(x, c.nb0, o, s, c.floor);
        if (c.nb1) {
          nv_row(x + 16 * c.nb0, c.nb1, o + 8 * c.nb0, s + c.nb0, c.floor);
          if (check) nv_check(x + 16 * c.nb0, c.nb1, o + 8 * c.nb0, s + c.nb0, c.floor);
        }
      }
    };
    pass(true);
    std::printf("%-34s %7.1f ns a token\n", c.name, median_ns([&] { pass(false); }) / T);
  }
  if (!only[0] || strstr("mxfp4", only)) {
    const int nb = 14, len = 32 * nb;
    const auto pass = [&](bool check) {
      for (int i = 0; i < T; ++i) {
        const uint16_t* x = src.data() + (size_t(i) * len) % (nsrc - len);
        char* o = out.data() + size_t(slot[i]) * 1200;
        char* s = sc.data() + size_t(slot[i]) * 160;
        const uint64_t left = mxfp4_run_512(x, nb, o, s);
        if (check) {
          const uint64_t l2 = mxfp4_run_avx2(x, nb, ref.data(), rsc.data());
          for (int b = 0; b < nb; ++b)
            if (!((left | l2) >> b & 1)) bad += memcmp(o + 16 * b, ref.data() + 16 * b, 16) != 0 || s[b] != rsc[b];
        }
      }
    };
    pass(true);
    std::printf("%-34s %7.1f ns a token\n", "mxfp4 record (14 blocks of 32)", median_ns([&] { pass(false); }) / T);
  }
  if (!only[0] || strstr("l1", only)) {  // one 1024-value row, L1-resident, 64 blocks a call
    const int R = 256;
    const double ns = median_ns([&] {
      for (int r = 0; r < R; ++r) nvfp4_run_512(src.data() + 4096, 64, out.data(), sc.data(), 0.0f);
    });
    std::printf("%-34s %7.2f values/ns\n", "nvfp4 L1 (1024 values a call)", 1024.0 * R / ns);
  }
  std::printf("check against the AVX2 lanes: %ld rows differ\n", bad);
  return bad != 0;
}
