// Host x86 AVX2 loops for the quantised stores' conversions: the same arithmetic as the scalar
// code (fp8_bits, int8_code), eight lanes at a time, selected at run time (`simd_ok`) so the AOT
// build (no -march=native) and CPUs without AVX2 keep the portable loops. Bit-identical to the
// scalar path: every lane does the same correctly rounded fp32 operations, none fused.
#pragma once

#include "fp8.h"

#if !defined(__CUDACC__) && defined(__x86_64__) && defined(__GNUC__)
#define KVW_SIMD_X86 1
#include <immintrin.h>
#include <cstdlib>
#define KVW_AVX2_FN __attribute__((target("avx2,f16c")))
#define KVW_AVX2 KVW_AVX2_FN inline
#else
#define KVW_SIMD_X86 0
#endif

namespace kvwrite {

#if KVW_SIMD_X86
// AVX2 + F16C present and not switched off by KVWRITE_CPU_SIMD=0 (read once). Like the scalar
// code, the lanes assume the default MXCSR (round to nearest even), as torch runs.
inline bool simd_ok() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                         !(std::getenv("KVWRITE_CPU_SIMD") && std::getenv("KVWRITE_CPU_SIMD")[0] == '0');
  return ok;
}

// Eight elements from src + i as fp32, fp32 subnormals read as +-0 (daz).
template <DType IN>
KVW_AVX2 __m256 load8_daz(const void* src, i64 i) {
  __m256i x;
  if constexpr (IN == DType::F32) {
    x = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const float*>(src) + i));
  } else {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
    x = IN == DType::F16 ? _mm256_castps_si256(_mm256_cvtph_ps(h)) : _mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16);
  }
  const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_and_si256(sub, _mm256_set1_epi32(0x7FFFFFFF)), x));
}

// fp8 codes (format F) of eight fp32 values as int32 lanes: saturate, round to nearest even on
// the format's grid by adding and subtracting 2^(e + 23 - MANT) (e = the value's binade, at least
// EMIN: the fp32 add rounds at exactly the grid step, carries included), then read the code off
// the rounded value's bits (normal) or as a multiple of the subnormal step. NaN -> the NaN code.
template <class F>
KVW_AVX2 __m256i fp8_codes8(__m256 x) {
  constexpr int MANT = F::mant, EMIN = F::emin, drop = 23 - MANT, bias = 1 - EMIN;
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 ax = _mm256_min_ps(_mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))),
                                  _mm256_set1_ps(fp8_max<F>()));
  __m256i eb = _mm256_and_si256(_mm256_castps_si256(ax), _mm256_set1_epi32(0x7F800000));
  eb = _mm256_max_epi32(eb, _mm256_set1_epi32((EMIN + 127) << 23));
  const __m256 m = _mm256_castsi256_ps(_mm256_add_epi32(eb, _mm256_set1_epi32(drop << 23)));
  const __m256 r = _mm256_sub_ps(_mm256_add_ps(ax, m), m);
  const __m256 tiny = _mm256_set1_ps(pow2f(EMIN));
  const __m256i normal = _mm256_sub_epi32(_mm256_srli_epi32(_mm256_castps_si256(r), drop),
                                          _mm256_set1_epi32((127 - bias) << MANT));
  const __m256i sub = _mm256_srli_epi32(
      _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(r, tiny)), _mm256_castps_si256(tiny)), drop);
  __m256i code = _mm256_blendv_epi8(normal, sub, _mm256_castps_si256(_mm256_cmp_ps(r, tiny, _CMP_LT_OQ)));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(x), 24), _mm256_set1_epi32(0x80));
  if constexpr (F::fnuz) {  // no -0: a zero code stays unsigned
    code = _mm256_or_si256(code, _mm256_andnot_si256(_mm256_cmpeq_epi32(code, _mm256_setzero_si256()), sign));
  } else {
    code = _mm256_or_si256(code, sign);
  }
  return _mm256_blendv_epi8(code, _mm256_set1_epi32(F::fnuz ? 0x80 : 0x7F), _mm256_castps_si256(nan));
}

// Four vectors of byte-valued int32 lanes (0..255, or -128..127 when SIGNED) as 32 bytes in order.
template <bool SIGNED>
KVW_AVX2 void store32(char* dst, __m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i w01 = _mm256_packs_epi32(c0, c1), w23 = _mm256_packs_epi32(c2, c3);
  const __m256i b = SIGNED ? _mm256_packs_epi16(w01, w23) : _mm256_packus_epi16(w01, w23);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
}

// dst[j] = code(src[start + j]) for j < n, 32 at a time: `codes8(i)` gives the int32 codes of the
// eight elements from start + i; `tail(j)` the byte of one element (the scalar code).
template <bool SIGNED, class Codes8, class Tail>
KVW_AVX2 void simd_run(int n, char* __restrict__ dst, Codes8&& codes8, Tail&& tail) {
  int j = 0;
  for (; j + 32 <= n; j += 32) store32<SIGNED>(dst + j, codes8(j), codes8(j + 8), codes8(j + 16), codes8(j + 24));
  for (; j < n; ++j) dst[j] = char(tail(j));
}

// fp8 codes of daz(x) / scale (quant_run's arithmetic), n elements from `start`.
template <DType IN, class F>
KVW_AVX2 void fp8_run_avx2(const void* __restrict__ src, i64 start, int n, float scale, char* __restrict__ dst) {
  const __m256 s = _mm256_set1_ps(scale);
  simd_run<false>(n, dst, [&](int i) KVW_AVX2_FN { return fp8_codes8<F>(_mm256_div_ps(load8_daz<IN>(src, start + i), s)); },
                  [&](int j) KVW_AVX2_FN { return fp8_bits<F>(daz(load_float<IN>(src, start + j)) / scale); });
}
#else
inline bool simd_ok() { return false; }
#endif

}  // namespace kvwrite
