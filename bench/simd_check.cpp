// Exhaustive check of the cpu backend's AVX2 conversions (csrc/kvwrite/simd_x86.h) against the
// scalar code every backend shares: every one of the 2^32 fp32 bit patterns through fp8_codes8
// (both variants) for e4m3 / e5m2 / e4m3fnuz and through e2m1_codes8 (divisor 1), compared with
// fp8_bits / e2m1_code. Not part of `make test` (about a minute per format on one core):
//   g++ -O2 -ffp-contract=off -fno-trapping-math -std=c++17 bench/simd_check.cpp -o /tmp/simd_check && /tmp/simd_check
#include <cstdio>

#include "../csrc/kvwrite/nvfp4.h"

using namespace kvwrite;

template <class Vec, class Ref>
__attribute__((target("avx2,f16c"))) long count_diffs(const char* what, Vec vec, Ref ref) {
  long bad = 0;
  for (uint64_t i = 0; i < (1ull << 32); i += 8) {
    alignas(32) uint32_t in[8];
    alignas(32) int32_t out[8];
    for (int k = 0; k < 8; ++k) in[k] = uint32_t(i + k);
    _mm256_store_si256(reinterpret_cast<__m256i*>(out), vec(_mm256_load_ps(reinterpret_cast<const float*>(in))));
    for (int k = 0; k < 8; ++k) {
      if (uint32_t(out[k]) != ref(bits_to_float(in[k])) && bad++ < 4)
        std::printf("%s: %08x gives %02x, scalar %02x\n", what, in[k], out[k], ref(bits_to_float(in[k])));
    }
  }
  std::printf("%s: %ld of 2^32 differ\n", what, bad);
  return bad;
}

template <class F, bool NOFTZ>
long check_fp8(const char* what) {
  return count_diffs(what, [](__m256 x) __attribute__((target("avx2,f16c"))) { return fp8_codes8<F, NOFTZ>(x); },
                     [](float x) { return uint32_t(fp8_bits<F>(x)); });
}

int main() {
  if (!simd_ok()) { std::printf("no AVX2 + F16C here\n"); return 0; }
  long bad = check_fp8<E4M3, false>("e4m3") + check_fp8<E4M3, true>("e4m3 noftz") + check_fp8<E5M2, false>("e5m2") +
             check_fp8<E5M2, true>("e5m2 noftz") + check_fp8<E4M3FNUZ, false>("e4m3fnuz") +
             check_fp8<E4M3FNUZ, true>("e4m3fnuz noftz");
  bad += count_diffs("e2m1", [](__m256 x) __attribute__((target("avx2,f16c"))) { return e2m1_codes8(x, 1.0f); },
                     [](float x) { return e2m1_code(x / 1.0f); });
  return bad != 0;
}
