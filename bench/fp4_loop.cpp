// The AVX-512 FP4 hot loops alone (csrc/kvwrite/simd_avx512_fp4.h: nvfp4_run_512, mxfp4_run_512)
// of two source trees in one process, on the thread CPU clock, one pass of each in turn (a shared
// machine's disturbances hit both alike): bf16 rows of randn values (as the bench cases), one row a
// call as the stores call them, rows streamed from a 4 MiB source to scattered slots, and one
// L1-resident 1024-value row. Outputs are checked against the AVX2 lanes (nvfp4_block_avx2,
// mxfp4_run_avx2). Each side is this file built against one tree's csrc, its namespace renamed:
//   F="-O3 -march=native -ffp-contract=off -fno-trapping-math -std=c++17"
//   g++ $F -DFP4_SIDE=A -I /work/main/csrc -c bench/fp4_loop.cpp -o /tmp/fp4_a.o
//   g++ $F -DFP4_SIDE=B -I csrc -c bench/fp4_loop.cpp -o /tmp/fp4_b.o
//   g++ $F -I csrc bench/fp4_loop.cpp /tmp/fp4_a.o /tmp/fp4_b.o -o /tmp/fp4_loop && /tmp/fp4_loop [rounds]
// -DFP4_RECORD on one side: the V4 / V4.1 / MXFP4 record cases by nvfp4_record_512 /
// mxfp4_record_512 (this tree's record calls) instead of nvfp4_run_512 / mxfp4_run_512 (both sides may then be the same tree).
// Prints, per case, each side's 10th-percentile and median time a pass and the B / A ratios.
#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <random>
#include <vector>

#ifdef FP4_SIDE
#define FP4_CAT2(a, b) a##b
#define FP4_CAT(a, b) FP4_CAT2(a, b)
#define kvwrite FP4_CAT(kvwrite_side_, FP4_SIDE)
#include "kvwrite/nvfp4.h"

// The side's entry points: the loops, the AVX2 reference, whether the AVX-512 lanes apply.
extern "C" {
bool FP4_CAT(fp4_ok_, FP4_SIDE)() { return kvwrite::simd512_ok() && kvwrite::e2m1_lut().ok; }
void FP4_CAT(fp4_nv_, FP4_SIDE)(const uint16_t* x, int nb, char* o, char* s, float floor) {
#ifdef FP4_RECORD  // the V4 / V4.1 records by nvfp4_record_512 (no RoPE copy), the rest as before
  if (nb == 28) return kvwrite::nvfp4_record_512<28, 0>(x, o, s, floor, nullptr);
  if (nb == 32 && floor > 0) return kvwrite::nvfp4_record_512<32, 0>(x, o, s, floor, nullptr);
#endif
  kvwrite::nvfp4_run_512(x, nb, o, s, floor);
}
uint64_t FP4_CAT(fp4_mx_, FP4_SIDE)(const uint16_t* x, int nb, char* o, char* s) {
#ifdef FP4_RECORD
  if (nb == 14) return kvwrite::mxfp4_record_512<14, 0>(x, o, s, nullptr);
#endif
  return kvwrite::mxfp4_run_512(x, nb, o, s);
}
void FP4_CAT(fp4_nv_ref_, FP4_SIDE)(const uint16_t* x, int nb, char* o, char* s, float floor) {
  for (int b = 0; b < nb; ++b) kvwrite::nvfp4_block_avx2<kvwrite::DType::BF16>(x, 16 * b, nullptr, o + 8 * b, s + b, floor);
}
uint64_t FP4_CAT(fp4_mx_ref_, FP4_SIDE)(const uint16_t* x, int nb, char* o, char* s) { return kvwrite::mxfp4_run_avx2(x, nb, o, s); }
}
#else

extern "C" {
bool fp4_ok_A(), fp4_ok_B();
void fp4_nv_A(const uint16_t*, int, char*, char*, float), fp4_nv_B(const uint16_t*, int, char*, char*, float);
uint64_t fp4_mx_A(const uint16_t*, int, char*, char*), fp4_mx_B(const uint16_t*, int, char*, char*);
void fp4_nv_ref_A(const uint16_t*, int, char*, char*, float);
uint64_t fp4_mx_ref_A(const uint16_t*, int, char*, char*);
}

static double now_ns() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return 1e9 * double(t.tv_sec) + double(t.tv_nsec);
}

static uint16_t to_bf16(float f) {  // RNE
  uint32_t b;
  memcpy(&b, &f, 4);
  return uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

struct Side {
  void (*nv)(const uint16_t*, int, char*, char*, float);
  uint64_t (*mx)(const uint16_t*, int, char*, char*);
};

int main(int argc, char** argv) {
  if (!fp4_ok_A() || !fp4_ok_B()) return std::puts("no AVX-512 lanes"), 1;
  const int rounds = argc > 1 ? atoi(argv[1]) : 200, T = 1024;  // tokens a pass
  const size_t nsrc = size_t(2) * 1024 * 1024;  // 4 MiB of bf16
  std::vector<uint16_t> src(nsrc + 64);
  std::mt19937 g(1);
  std::normal_distribution<float> nd;
  for (auto& v : src) v = to_bf16(nd(g));
  std::vector<int> slot(T);
  for (int i = 0; i < T; ++i) slot[i] = i;
  std::shuffle(slot.begin(), slot.end(), g);
  std::vector<char> out(size_t(T) * 1200), sc(size_t(T) * 160), ref(64 * 32), rsc(64);
  const Side sides[2] = {{fp4_nv_A, fp4_mx_A}, {fp4_nv_B, fp4_mx_B}};
  long bad = 0;

  struct Case { const char* name; int nb0, nb1; float floor; bool mx; };  // blocks of a row's first / second call
  const Case cases[] = {{"mha (64 + 64 blocks: K, V)", 64, 64, 0.0f, false}, {"mla (32 + 4 blocks)", 32, 4, 0.0f, false},
                        {"v4 record (28 blocks)", 28, 0, 0.0f, false}, {"v4.1 record (32 blocks, floor)", 32, 0, 0.001953125f, false},
                        {"mxfp4 record (14 blocks of 32)", 14, 0, 0.0f, true}, {"nvfp4 L1 (1024 values, x64)", 64, 0, 0.0f, false}};
  std::printf("%-32s %21s %21s %13s\n", "ns a token (L1: a call)", "A p10 / median", "B p10 / median", "B/A p10 / med");
  for (const Case& c : cases) {
    const bool l1 = c.nb0 == 64 && c.nb1 == 0;
    const int len = c.mx ? 32 * c.nb0 : 16 * (c.nb0 + c.nb1), n = l1 ? 64 : T;
    const auto pass = [&](const Side& s, bool check) {
      for (int i = 0; i < n; ++i) {
        const uint16_t* x = l1 ? src.data() + 4096 : src.data() + (size_t(i) * len) % (nsrc - len);
        char* o = l1 ? out.data() : out.data() + size_t(slot[i]) * 1200;
        char* q = l1 ? sc.data() : sc.data() + size_t(slot[i]) * 160;
        if (c.mx) {
          const uint64_t left = s.mx(x, c.nb0, o, q);
          if (check) {
            const uint64_t l2 = fp4_mx_ref_A(x, c.nb0, ref.data(), rsc.data());
            for (int b = 0; b < c.nb0; ++b)
              if (!((left | l2) >> b & 1)) bad += memcmp(o + 16 * b, ref.data() + 16 * b, 16) != 0 || q[b] != rsc[b];
          }
          continue;
        }
        for (int part = 0; part < 2; ++part) {
          const int nb = part ? c.nb1 : c.nb0, b0 = part ? c.nb0 : 0;
          if (nb == 0) continue;
          s.nv(x + 16 * b0, nb, o + 8 * b0, q + b0, c.floor);
          if (check) {
            fp4_nv_ref_A(x + 16 * b0, nb, ref.data(), rsc.data(), c.floor);
            bad += memcmp(o + 8 * b0, ref.data(), 8 * nb) != 0 || memcmp(q + b0, rsc.data(), nb) != 0;
          }
        }
      }
    };
    std::vector<double> t[2];
    for (int k = 0; k < 2; ++k) pass(sides[k], true);
    for (int r = 0; r < rounds; ++r)
      for (int k0 = 0; k0 < 2; ++k0) {
        const int k = (r & 1) ? 1 - k0 : k0;
        const double a = now_ns();
        pass(sides[k], false);
        t[k].push_back((now_ns() - a) / n);
      }
    double p10[2], med[2];
    for (int k = 0; k < 2; ++k) {
      std::sort(t[k].begin(), t[k].end());
      p10[k] = t[k][t[k].size() / 10], med[k] = t[k][t[k].size() / 2];
    }
    std::printf("%-32s %10.1f / %8.1f %10.1f / %8.1f %6.3f / %5.3f\n", c.name, p10[0], med[0], p10[1], med[1], p10[1] / p10[0], med[1] / med[0]);
  }
  std::printf("check against the AVX2 lanes: %ld rows differ\n", bad);
  return bad != 0;
}
#endif
