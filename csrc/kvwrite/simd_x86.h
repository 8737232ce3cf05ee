// Host x86 AVX2 loops for the quantised stores' conversions: the same arithmetic as the scalar
// code (fp8_bits, int8_code), eight lanes at a time, selected at run time (`simd_ok`) so the AOT
// build (no -march=native) and CPUs without AVX2 keep the portable loops. Bit-identical to the
// scalar path: every lane does the same correctly rounded fp32 operations, none fused.
#pragma once

#include "fp8.h"
#include "stream.h"

#if !defined(__CUDACC__) && defined(__x86_64__) && defined(__GNUC__)
#define KVW_SIMD_X86 1
#include <immintrin.h>
#include <cstdlib>
#include <cstring>
#define KVW_AVX2_FN __attribute__((target("avx2,f16c,fma")))
#define KVW_AVX2 KVW_AVX2_FN inline
#else
#define KVW_SIMD_X86 0
#endif

namespace kvwrite {

#if KVW_SIMD_X86
// The host lanes in use, read once: 2 AVX-512 (F, BW, VL, DQ, VBMI, GFNI; simd_avx512.h), 1 AVX2 +
// F16C + FMA (this file), 0 the portable loops: the best this CPU has, capped by
// KVWRITE_CPU_SIMD = 0 / avx2 / avx512 (unset or any other value: the best). Like the scalar
// code, the lanes assume the default MXCSR (round to nearest even), as torch runs.
__attribute__((noinline, cold)) inline int simd_level_detect() {
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") && __builtin_cpu_supports("fma");
  const bool avx512 = avx2 && __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512vbmi") && __builtin_cpu_supports("gfni");
  const char* e = std::getenv("KVWRITE_CPU_SIMD");
  const int cap = e == nullptr ? 2 : e[0] == '0' ? 0 : std::strcmp(e, "avx2") == 0 ? 1 : 2;
  const int best = avx512 ? 2 : avx2 ? 1 : 0;
  return best < cap ? best : cap;
}
// The level, detected once; small enough to inline into every dispatcher (one load and a test).
__attribute__((always_inline)) inline int simd_level() {
  static const int level = simd_level_detect();
  return level;
}
__attribute__((always_inline)) inline bool simd_ok() { return simd_level() >= 1; }

// 32 bytes of a pool row: a streaming store where dst is 32-byte aligned and rows stream (stream.h;
// two halves of a line written in turn fill one write-combining buffer).
KVW_AVX2 void store_half_line(char* dst, __m256i v) {
  if (stream_rows() && (reinterpret_cast<uintptr_t>(dst) & 31) == 0) _mm256_stream_si256(reinterpret_cast<__m256i*>(dst), v);
  else _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), v);
}

// Eight elements from src + i as fp32, as stored (no daz).
template <DType IN>
KVW_AVX2 __m256 load8(const void* src, i64 i) {
  if constexpr (IN == DType::F32) return _mm256_loadu_ps(static_cast<const float*>(src) + i);
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(src) + i));
  if constexpr (IN == DType::F16) return _mm256_cvtph_ps(h);
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

// Eight elements from src + i as fp32, fp32 subnormals read as +-0 (daz).
template <DType IN>
KVW_AVX2 __m256 load8_daz(const void* src, i64 i) {
  const __m256i x = _mm256_castps_si256(load8<IN>(src, i));
  const __m256i sub = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7F800000)), _mm256_setzero_si256());
  return _mm256_castsi256_ps(_mm256_andnot_si256(_mm256_and_si256(sub, _mm256_set1_epi32(0x7FFFFFFF)), x));
}

// Unsigned codes of eight non-negative fp32 magnitudes `ax` (<= the format's max) on the grid of a
// float format with MANT mantissa bits and smallest normal exponent EMIN: t = ax + m, m = 2^(e +
// 23 - MANT) (e = ax's binade, at least EMIN), rounds to nearest even at exactly the grid step
// (carries included) and holds k = t - m grid steps in its low bits; code = k + (e + bias - 1) <<
// MANT = k + (eb >> drop) - ((128 - bias) << MANT). One fp32 add and no subnormal result, so the
// codes do not depend on MXCSR (FTZ / DAZ) and a subnormal code costs no microcode assist (a tile
// with one outlier has many). NAN_HIGH: a NaN's code comes out above 255 (eb capped at 2^64,
// above every format's max), which signed packs saturate to 255; else a NaN has no defined code.
template <int MANT, int EMIN, bool NAN_HIGH = false>
KVW_AVX2 __m256i grid_codes8(__m256 ax) {
  constexpr int drop = 23 - MANT, bias = 1 - EMIN;
  __m256i eb = _mm256_and_si256(_mm256_castps_si256(ax), _mm256_set1_epi32(0x7F800000));
  eb = _mm256_max_epi32(eb, _mm256_set1_epi32((EMIN + 127) << 23));
  if constexpr (NAN_HIGH) eb = _mm256_min_epi32(eb, _mm256_set1_epi32((127 + 64) << 23));
  const __m256i m = _mm256_add_epi32(eb, _mm256_set1_epi32(drop << 23));
  const __m256i k = _mm256_sub_epi32(_mm256_castps_si256(_mm256_add_ps(ax, _mm256_castsi256_ps(m))), m);
  return _mm256_add_epi32(k, _mm256_sub_epi32(_mm256_srli_epi32(eb, drop), _mm256_set1_epi32((128 - bias) << MANT)));
}

KVW_AVX2 __m256 abs8(__m256 x) { return _mm256_and_ps(x, _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF))); }

// fp8 codes (format F) of eight fp32 values as int32 lanes, fp8_bits's: saturate, round on the
// grid, sign bit kept (fnuz: no -0), NaN -> the format's NaN code.
template <class F>
KVW_AVX2 __m256i fp8_codes8(__m256 x) {
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  __m256i code = grid_codes8<F::mant, F::emin>(_mm256_min_ps(abs8(x), _mm256_set1_ps(fp8_max<F>())));
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
  store_half_line(dst, _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
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

// fp8_run_avx2 over H heads of D elements (head h from start + h * s_head, scale[h * scale_step],
// codes at dst + h * dst_step). A head whose |scale| >= 2^-100 skips daz: a subnormal input's
// quotient is then below 2^-26, which rounds to the same signed zero code as daz's +-0 (under
// MXCSR.FTZ / DAZ too).
template <DType IN, class F>
KVW_AVX2 void fp8_heads_avx2(const void* __restrict__ src, i64 start, i64 s_head, int H, int D, const float* scale,
                             i64 scale_step, char* __restrict__ dst, i64 dst_step) {
  for (int h = 0; h < H; ++h) {
    const float sc = scale[h * scale_step];
    const i64 at = start + h * s_head;
    if (!((sc < 0 ? -sc : sc) >= 7.888609052210118e-31f)) {  // 2^-100; NaN scales too
      fp8_run_avx2<IN, F>(src, at, D, sc, dst + h * dst_step);
      continue;
    }
    const __m256 s = _mm256_set1_ps(sc);
    simd_run<false>(D, dst + h * dst_step,
                    [&](int i) KVW_AVX2_FN { return fp8_codes8<F>(_mm256_div_ps(load8<IN>(src, at + i), s)); },
                    [&](int j) KVW_AVX2_FN { return fp8_bits<F>(daz(load_float<IN>(src, at + j)) / sc); });
  }
}

// Policy |x| bits of eight elements from src + i: 0 for NaN, +-inf and fp32 subnormals.
template <DType IN>
KVW_AVX2 __m256i policy_abs8(const void* src, i64 i) {
  const __m256i a = _mm256_castps_si256(abs8(load8<IN>(src, i)));
  const __m256i keep = _mm256_and_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(0x7F800000), a),
                                        _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x007FFFFF)));
  return _mm256_and_si256(a, keep);
}

KVW_AVX2 uint32_t hmax8(__m256i m) {
  __m128i h = _mm_max_epi32(_mm256_castsi256_si128(m), _mm256_extracti128_si256(m, 1));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0x4E));
  h = _mm_max_epi32(h, _mm_shuffle_epi32(h, 0xB1));
  return uint32_t(_mm_cvtsi128_si32(h));
}

// max finite |x| (block_amax's policy) over n elements from `start`, n a multiple of 8.
template <DType IN>
KVW_AVX2 float amax_avx2(const void* src, i64 start, int n) {
  __m256i m0 = _mm256_setzero_si256(), m1 = m0;
  int j = 0;
  for (; j + 16 <= n; j += 16) {
    m0 = _mm256_max_epi32(m0, policy_abs8<IN>(src, start + j));
    m1 = _mm256_max_epi32(m1, policy_abs8<IN>(src, start + j + 8));
  }
  if (j < n) m0 = _mm256_max_epi32(m0, policy_abs8<IN>(src, start + j));
  return bits_to_float(hmax8(_mm256_max_epi32(m0, m1)));
}

// Lane-wise max of the finite |x| bits of two vectors already read with daz (NaN, +-inf -> 0):
// the bits of a block's amax before the horizontal max.
KVW_AVX2 __m256i finite_abs_max16(__m256 x0, __m256 x1) {
  const __m256i inf = _mm256_set1_epi32(0x7F800000);
  const __m256i a0 = _mm256_castps_si256(abs8(x0)), a1 = _mm256_castps_si256(abs8(x1));
  return _mm256_max_epi32(_mm256_and_si256(a0, _mm256_cmpgt_epi32(inf, a0)), _mm256_and_si256(a1, _mm256_cmpgt_epi32(inf, a1)));
}

// e2m1 codes (nvfp4.h e2m1_code) of y = x / d, or each element's sign alone when d == 0; NaN -> 0.
KVW_AVX2 __m256i e2m1_codes8(__m256 x, float d) {
  const __m256 y = d == 0.0f ? x : _mm256_div_ps(x, _mm256_set1_ps(d));
  const __m256i sign = _mm256_and_si256(_mm256_srli_epi32(_mm256_castps_si256(y), 28), _mm256_set1_epi32(8));
  const __m256i code = d == 0.0f ? sign : _mm256_or_si256(grid_codes8<1, 0>(_mm256_min_ps(abs8(y), _mm256_set1_ps(6.0f))), sign);
  return _mm256_andnot_si256(_mm256_castps_si256(_mm256_cmp_ps(y, y, _CMP_UNORD_Q)), code);
}

// e2m1 codes of 16 elements (x0, x1) divided by d, packed two per byte (element 2j in the low
// nibble) into 8 bytes at `bytes`.
KVW_AVX2 void e2m1_pack16(__m256 x0, __m256 x1, float d, char* bytes) {
  // pairs: the odd element's code (high dword of each 64-bit lane) moved to bits 4..7
  const __m256i c0 = e2m1_codes8(x0, d), c1 = e2m1_codes8(x1, d);
  const __m256i p0 = _mm256_or_si256(c0, _mm256_srli_epi64(c0, 28)), p1 = _mm256_or_si256(c1, _mm256_srli_epi64(c1, 28));
  const __m256i pick0 = _mm256_setr_epi8(0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  const __m256i pick1 = _mm256_setr_epi8(-1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                         -1, -1, 0, 8, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  // lane 0 holds pairs 0, 1 (of c0) and 4, 5 (of c1); lane 1 pairs 2, 3 and 6, 7
  const __m256i t = _mm256_or_si256(_mm256_shuffle_epi8(p0, pick0), _mm256_shuffle_epi8(p1, pick1));
  const __m128i packed = _mm_unpacklo_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256(t, 1));
  _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes), packed);
}

KVW_AVX2 bool any_nan16(__m256 x0, __m256 x1) {
  return _mm256_movemask_ps(_mm256_or_ps(_mm256_cmp_ps(x0, x0, _CMP_UNORD_Q), _mm256_cmp_ps(x1, x1, _CMP_UNORD_Q))) != 0;
}

// nvfp4_block's bytes for 16 elements from src + start: the block scale in scalar code (the
// same functions), the 16 codes in two vectors.
template <DType IN>
KVW_AVX2 void nvfp4_block_avx2(const void* src, i64 start, const float* global, char* bytes, char* scale,
                               float floor = 0.0f) {
  const __m256 x0 = load8_daz<IN>(src, start), x1 = load8_daz<IN>(src, start + 8);
  float s = bits_to_float(hmax8(finite_abs_max16(x0, x1))) / 6.0f;
  s = s < floor ? floor : s;
  if (global != nullptr) s = s / global[0];
  const uint8_t code = fp8_bits<E4M3>(s);
  float d = e4m3_to_float(code);
  if (global != nullptr) d = d * global[0];
  e2m1_pack16(x0, x1, d, bytes);
  *scale = char(any_nan16(x0, x1) ? uint8_t(0x7F) : code);
}

// max of each of 8 vectors' lanes, as one vector: lane b = max over the lanes of m[b] (int32).
KVW_AVX2 __m256i hmax8x8(const __m256i (&m)[8]) {
  __m256i t[4];
  for (int k = 0; k < 4; ++k)  // pairs interleaved: lanes {b, b+1} of each 64-bit half
    t[k] = _mm256_max_epi32(_mm256_unpacklo_epi32(m[2 * k], m[2 * k + 1]), _mm256_unpackhi_epi32(m[2 * k], m[2 * k + 1]));
  const __m256i u0 = _mm256_max_epi32(_mm256_unpacklo_epi64(t[0], t[1]), _mm256_unpackhi_epi64(t[0], t[1]));
  const __m256i u1 = _mm256_max_epi32(_mm256_unpacklo_epi64(t[2], t[3]), _mm256_unpackhi_epi64(t[2], t[3]));
  // u0 lanes: blocks 0 1 2 3 (low half) / 0 1 2 3 (high half); u1 the same for 4..7
  const __m256i lo = _mm256_permute2x128_si256(u0, u1, 0x20), hi = _mm256_permute2x128_si256(u0, u1, 0x31);
  return _mm256_max_epi32(lo, hi);
}

// e4m3 code lanes (0..255) -> their values (e4m3_to_float), NaN code -> NaN.
KVW_AVX2 __m256 e4m3_values8(__m256i c) {
  const __m256i mag = _mm256_and_si256(c, _mm256_set1_epi32(0x7F));
  const __m256 normal = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_slli_epi32(mag, 20), _mm256_set1_epi32(120 << 23)));
  const __m256 sub = _mm256_mul_ps(_mm256_cvtepi32_ps(mag), _mm256_set1_ps(1.0f / 512.0f));  // mant * 2^-9, exact
  const __m256i is_sub = _mm256_cmpgt_epi32(_mm256_set1_epi32(8), mag);
  __m256 v = _mm256_blendv_ps(normal, sub, _mm256_castsi256_ps(is_sub));
  v = _mm256_blendv_ps(v, _mm256_set1_ps(__builtin_nanf("")), _mm256_castsi256_ps(_mm256_cmpeq_epi32(mag, _mm256_set1_epi32(0x7F))));
  return _mm256_or_ps(v, _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_and_si256(c, _mm256_set1_epi32(0x80)), 24)));
}

// nvfp4_block_avx2 for 8 consecutive blocks (128 elements from src + start; bytes: 64, scales: 8):
// the eight block scales in one vector (amax, / 6, / global, e4m3 code, decode, * global: the same
// fp32 operations per lane as the scalar code), then each block's codes.
template <DType IN>
KVW_AVX2 void nvfp4_blocks8_avx2(const void* src, i64 start, const float* global, char* bytes, char* scales,
                                 float floor = 0.0f) {
  __m256 x[16];
  __m256i m[8];
  int nan_blocks = 0;
  for (int b = 0; b < 8; ++b) {
    x[2 * b] = load8_daz<IN>(src, start + 16 * b);
    x[2 * b + 1] = load8_daz<IN>(src, start + 16 * b + 8);
    m[b] = finite_abs_max16(x[2 * b], x[2 * b + 1]);
    nan_blocks |= int(any_nan16(x[2 * b], x[2 * b + 1])) << b;
  }
  __m256 s = _mm256_max_ps(_mm256_div_ps(_mm256_castsi256_ps(hmax8x8(m)), _mm256_set1_ps(6.0f)), _mm256_set1_ps(floor));
  if (global != nullptr) s = _mm256_div_ps(s, _mm256_set1_ps(global[0]));
  const __m256i code = fp8_codes8<E4M3>(s);
  __m256 d = e4m3_values8(code);
  if (global != nullptr) d = _mm256_mul_ps(d, _mm256_set1_ps(global[0]));
  alignas(32) float dl[8];
  alignas(32) int32_t cl[8];
  _mm256_store_ps(dl, d);
  _mm256_store_si256(reinterpret_cast<__m256i*>(cl), code);
  for (int b = 0; b < 8; ++b) {
    e2m1_pack16(x[2 * b], x[2 * b + 1], dl[b], bytes + 8 * b);
    scales[b] = char((nan_blocks >> b) & 1 ? 0x7F : cl[b]);
  }
}

// ---- e2m1 codes of bf16 inputs by 16-bit compares ---------------------------------------------
// e2m1_code(RN(x / d)) counts the boundaries B = .25, .75, 1.25, 1.75, 2.5, 3.5, 5 below |y|
// (ties to the even code: > for .25, 1.25, 2.5, 5; >= for the others). Where d has at most 4
// significant bits (an e4m3 value, a power of two) and x is a bf16 (8), B d is exact in fp32 and
// in bf16, and x - B d, when not 0, is at least 2^-9 of B d: far above half an ulp of the
// quotient, so RN(x / d) > B <=> |x| > B d, and = B only where |x| = B d. The code is then the
// number of thresholds T = bits(B d) >> 16 (T - 1 for the >= boundaries) that |x|'s 16 bits
// exceed: seven signed 16-bit compares for 16 elements, no division (fp32 subnormal inputs, read
// as +-0 by the scalar code, lie below every threshold; inf above all: 6, as saturation gives).

// The seven thresholds of eight divisors d (lanes; d > 0 normal with <= 4 significant bits and
// 5 d finite, or 0: every threshold 0x7F80, no finite |x| above it: the sign alone), each as
// a 16-bit pair in th[k][lane].
KVW_AVX2 void e2m1_bf16_thresholds(__m256 d, uint32_t (&th)[7][8]) {
  static constexpr float B[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  const __m256 dd = _mm256_blendv_ps(d, _mm256_set1_ps(__builtin_inff()), _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ));
  for (int k = 0; k < 7; ++k) {
    __m256i t = _mm256_srli_epi32(_mm256_castps_si256(_mm256_mul_ps(_mm256_set1_ps(B[k]), dd)), 16);
    if (k & 1) t = _mm256_sub_epi32(t, _mm256_set1_epi32(1));  // >=: above T - 1
    _mm256_store_si256(reinterpret_cast<__m256i*>(th[k]), _mm256_or_si256(t, _mm256_slli_epi32(t, 16)));
  }
}

// The e2m1 codes of 16 bf16 elements (l: the raw load, a: l & 0x7FFF) against thresholds t
// (broadcast pairs), sign as bit 3, packed two a byte (element 2j low) into 8 bytes at `bytes`.
// NANS: NaN lanes (a > 0x7F80) get code 0 (their mask is returned); else there are none.
template <bool NANS = false>
KVW_AVX2 __m256i e2m1_store16_bf16(__m256i l, __m256i a, const __m256i (&t)[7], __m256i pick, char* bytes) {
  __m256i m = _mm256_cmpgt_epi16(a, t[0]);
  for (int k = 1; k < 7; ++k) m = _mm256_add_epi16(m, _mm256_cmpgt_epi16(a, t[k]));
  __m256i p = _mm256_sub_epi16(_mm256_and_si256(_mm256_srli_epi16(l, 12), _mm256_set1_epi16(8)), m);
  const __m256i nan = NANS ? _mm256_cmpgt_epi16(a, _mm256_set1_epi16(0x7F80)) : _mm256_setzero_si256();
  if constexpr (NANS) p = _mm256_andnot_si256(nan, p);
  p = _mm256_shuffle_epi8(_mm256_or_si256(p, _mm256_srli_epi32(p, 12)), pick);
  _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes), _mm_unpacklo_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  return nan;
}

// The thresholds of a power of two s = 2^(e - 127) (e in [27, 227]): those of s = 1
// (e2m1_bf16_thresholds), moved up by s's binade on the exponent bits.
KVW_AVX2 void e2m1_pow2_thresholds(int e, __m256i (&t)[7]) {
  static constexpr int16_t T1[7] = {0x3E80, 0x3F3F, 0x3FA0, 0x3FDF, 0x4020, 0x405F, 0x40A0};
  const __m256i up = _mm256_set1_epi16(int16_t((e - 127) * 128));
  for (int k = 0; k < 7; ++k) t[k] = _mm256_add_epi16(_mm256_set1_epi16(T1[k]), up);
}

// e2m1 codes of n elements (a multiple of 16) from `start` divided by s (> 0), packed; whether
// any element was NaN. bf16 by a power of two s in [2^-100, 2^100] (an MXFP4 scale): by 16-bit
// compares (e2m1_bf16_thresholds).
template <DType IN>
KVW_AVX2 bool e2m1_run_avx2(const void* src, i64 start, int n, float s, char* bytes) {
  if constexpr (IN == DType::BF16) {
    const uint32_t sb = float_to_bits(s);
    if ((sb & 0x807FFFFFu) == 0 && sb >= (27u << 23) && sb <= (227u << 23)) {
      __m256i t[7];
      e2m1_pow2_thresholds(int(sb >> 23), t);
      const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                            0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
      const uint16_t* x = static_cast<const uint16_t*>(src) + start;
      __m256i nan = _mm256_setzero_si256();
      for (int j = 0; j < n; j += 16) {
        const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + j));
        nan = _mm256_or_si256(nan, e2m1_store16_bf16<true>(l, _mm256_and_si256(l, _mm256_set1_epi16(0x7FFF)), t, pick, bytes + j / 2));
      }
      return !_mm256_testz_si256(nan, nan);
    }
  }
  bool nan = false;
  for (int j = 0; j < n; j += 16) {
    const __m256 x0 = load8_daz<IN>(src, start + j), x1 = load8_daz<IN>(src, start + j + 8);
    e2m1_pack16(x0, x1, s, bytes + j / 2);
    nan = nan || any_nan16(x0, x1);
  }
  return nan;
}

// ---- Streaming bf16 lanes: 32 elements a step, no division instruction -------------------------
// A bf16 row is read 16 elements a load and widened by interleaving zero halves (one op per 8
// lanes; lanes come in "unpack order", [0-3 | 8-11] and [4-7 | 12-15] of each load, which the
// byte pack below puts back in element order). x / s is computed as q = x * r, r = RN(1 / s),
// corrected once with two FMAs (Markstein): the correctly rounded quotient, the same fp32 value
// as the division, for every bf16 (and fp16) x and every fp32 s, checked exhaustively over all
// (8-bit x mantissa, 24-bit s mantissa) pairs (bench/simd_check.cpp). The range below keeps every
// intermediate normal where a code depends on it: |s| in [2^-40, 2^40].
inline bool cr_div_ok(float s) {
  const float a = s < 0 ? -s : s;
  return a >= 9.094947017729282e-13f && a <= 1.099511627776e12f;
}

KVW_AVX2 __m256 div_cr8(__m256 x, __m256 s, __m256 r) {
  const __m256 q = _mm256_mul_ps(x, r);
  return _mm256_fmadd_ps(_mm256_fnmadd_ps(q, s, x), r, q);
}

// 32 bf16 elements from p: the raw loads (l0, l1) and the four fp32 vectors in unpack order.
KVW_AVX2 void load_bf16x32(const uint16_t* p, __m256i& l0, __m256i& l1, __m256 (&x)[4]) {
  l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 16));
  const __m256i z = _mm256_setzero_si256();
  x[0] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, l0));
  x[1] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, l0));
  x[2] = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, l1));
  x[3] = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, l1));
}

// Four int32 code vectors in unpack order as 32 bytes in "pack order" (qwords 0, 2, 1, 3 of the
// element order: the order of packs_epi16(l0, l1)); `in_order` puts them in element order.
// Unsigned: a code above 255 (grid_codes8's NaN_HIGH) saturates to 255.
template <bool SIGNED>
KVW_AVX2 __m256i pack_codes32(__m256i c0, __m256i c1, __m256i c2, __m256i c3) {
  const __m256i w01 = _mm256_packs_epi32(c0, c1), w23 = _mm256_packs_epi32(c2, c3);
  return SIGNED ? _mm256_packs_epi16(w01, w23) : _mm256_packus_epi16(w01, w23);
}
KVW_AVX2 __m256i in_order(__m256i b) { return _mm256_permute4x64_epi64(b, 0xD8); }

// fp8 codes (format F, not fnuz) of x / s for n elements of a bf16 row (s: cr_div_ok), 32 at a
// time; returns how many were done (a multiple of 32). The magnitude is grid_codes8 of |x| / |s|
// with |x| first clamped to C = RN(max * |s|): C / |s| rounds to within an ulp of max, which codes
// as max, so every |x| >= C saturates as the scalar clamp does and no quotient overflows (NaN is
// kept by the min: its code, NAN_HIGH, packs to 0xFF). The sign byte
// is the input's sign (xor the divisor's), packed from the raw bf16 halves; 0xFF (a NaN) becomes
// the NaN code 0x7F. DYN: a dynamic scale's row (s = max(RN(amax / m), floor) or a power of two
// at least amax / m, m <= max, amax the row's max |x|, no NaN or inf in the row): every |x| / s
// rounds to at most max (amax / RN(amax / m) <= m (1 + 2^-23)), so neither the clamp nor the NaN
// code applies; |x| is taken on the 16-bit halves, s > 0.
template <class F, bool DYN = false>
KVW_AVX2 int fp8_bf16_run_avx2(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r = 0.0f) {
  static_assert(!F::fnuz, "fnuz keeps the generic lanes");
  const float as = s < 0 ? -s : s;  // r: RN(1 / |s|) when the caller has it (0: computed here)
  const __m256 vs = _mm256_set1_ps(as), vr = _mm256_set1_ps(r != 0.0f ? r : 1.0f / as);
  const __m256 vmax = _mm256_set1_ps(fp8_max<F>() * as);
  const __m256i smask = _mm256_set1_epi8(char(0x80)), flip = _mm256_set1_epi8(char(s < 0 ? 0x80 : 0));
  const __m256i ones = _mm256_set1_epi8(char(0xFF)), am = _mm256_set1_epi16(0x7FFF), z = _mm256_setzero_si256();
  int j = 0;
  for (; j + 32 <= n; j += 32) {
    __m256i c[4];
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + j + 16));
    if constexpr (DYN) {
      const __m256i a0 = _mm256_and_si256(l0, am), a1 = _mm256_and_si256(l1, am);
      const __m256 x[4] = {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, a0)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, a0)),
                           _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, a1)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, a1))};
      for (int k = 0; k < 4; ++k) c[k] = grid_codes8<F::mant, F::emin>(div_cr8(x[k], vs, vr));
    } else {
      const __m256 x[4] = {_mm256_castsi256_ps(_mm256_unpacklo_epi16(z, l0)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, l0)),
                           _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, l1)), _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, l1))};
      for (int k = 0; k < 4; ++k)
        c[k] = grid_codes8<F::mant, F::emin, true>(div_cr8(_mm256_min_ps(vmax, abs8(x[k])), vs, vr));
    }
    __m256i b = _mm256_or_si256(pack_codes32<false>(c[0], c[1], c[2], c[3]), _mm256_and_si256(_mm256_packs_epi16(l0, l1), smask));
    if constexpr (!DYN) {
      b = _mm256_xor_si256(b, flip);
      b = _mm256_xor_si256(b, _mm256_and_si256(_mm256_cmpeq_epi8(b, ones), smask));
    }
    store_half_line(dst + j, in_order(b));
  }
  return j;
}

// int8 codes RNE(x / s) (the rne rule) of a bf16 row without NaN or +-inf and with |x / s| < 2^31
// (a dynamic scale's row: |x| <= amax, the caller checked its raw max): the signed packs
// saturate to [-128, 127] as the clamp does.
KVW_AVX2 int int8_bf16_run_avx2(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r = 0.0f) {
  const __m256 vs = _mm256_set1_ps(s), vr = _mm256_set1_ps(r != 0.0f ? r : 1.0f / s);  // r: RN(1 / s) or 0
  int j = 0;
  for (; j + 32 <= n; j += 32) {
    __m256i l0, l1;
    __m256 x[4];
    load_bf16x32(src + j, l0, l1, x);
    __m256i c[4];
    for (int k = 0; k < 4; ++k) c[k] = _mm256_cvtps_epi32(div_cr8(x[k], vs, vr));
    store_half_line(dst + j, in_order(pack_codes32<true>(c[0], c[1], c[2], c[3])));
  }
  return j;
}

// Max of the |x| bits (bf16 x & 0x7FFF, NaN and inf included) over n elements, n a multiple of 16.
KVW_AVX2 uint32_t bf16_absmax_raw_avx2(const uint16_t* p, int n) {
  const __m256i m = _mm256_set1_epi16(0x7FFF);
  __m256i a = _mm256_setzero_si256(), b = a;
  int j = 0;
  for (; j + 32 <= n; j += 32) {
    a = _mm256_max_epu16(a, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j)), m));
    b = _mm256_max_epu16(b, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j + 16)), m));
  }
  if (j < n) a = _mm256_max_epu16(a, _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + j)), m));
  a = _mm256_max_epu16(a, b);
  const __m128i h = _mm_xor_si128(_mm_max_epu16(_mm256_castsi256_si128(a), _mm256_extracti128_si256(a, 1)),
                                  _mm_set1_epi16(-1));
  return 0x7FFFu & ~uint32_t(_mm_cvtsi128_si32(_mm_minpos_epu16(h)));
}

// The max of each of 8 vectors' 16-bit lanes (unsigned), as the 32-bit lanes of one vector
// (lane b: vector b): a transposing max tree.
KVW_AVX2 __m256i hmax16x8(const __m256i (&a)[8]) {
  __m256i t[4];
  for (int k = 0; k < 4; ++k)  // vectors 2k, 2k+1 alternate
    t[k] = _mm256_max_epu16(_mm256_unpacklo_epi16(a[2 * k], a[2 * k + 1]), _mm256_unpackhi_epi16(a[2 * k], a[2 * k + 1]));
  const __m256i u0 = _mm256_max_epu16(_mm256_unpacklo_epi32(t[0], t[1]), _mm256_unpackhi_epi32(t[0], t[1]));
  const __m256i u1 = _mm256_max_epu16(_mm256_unpacklo_epi32(t[2], t[3]), _mm256_unpackhi_epi32(t[2], t[3]));
  const __m256i w = _mm256_max_epu16(_mm256_unpacklo_epi64(u0, u1), _mm256_unpackhi_epi64(u0, u1));  // 0..7 a half
  return _mm256_cvtepu16_epi32(_mm_max_epu16(_mm256_castsi256_si128(w), _mm256_extracti128_si256(w, 1)));
}

// bf16_absmax_raw of 8 runs of n elements (n % 16 == 0; run k from p + k * stride) into raw[8]:
// the runs' loads interleaved, one max tree for the eight.
KVW_AVX2 void bf16_absmax_raw8_avx2(const uint16_t* p, i64 stride, int n, uint32_t* raw) {
  const __m256i m = _mm256_set1_epi16(0x7FFF);
  __m256i a[8];
  for (int k = 0; k < 8; ++k) a[k] = _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * stride)), m);
  for (int j = 16; j < n; j += 16)
    for (int k = 0; k < 8; ++k)
      a[k] = _mm256_max_epu16(a[k], _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + k * stride + j)), m));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(raw), hmax16x8(a));
}

// Dynamic scales max(amax / qmax, floor) and their reciprocals RN(1 / s) for 8 runs at once from
// their bf16_absmax_raw bits (the same correctly rounded fp32 operations as the scalar
// dynamic_scale, two divisions for 8 runs): false where a run holds a NaN / inf or a scale
// leaves cr_div_ok's range.
KVW_AVX2 bool dynamic_scales8(const uint32_t* raw, float qmax, float floor, float* s, float* r) {
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(raw));
  if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(b, _mm256_set1_epi32(0x7F7F))) != 0) return false;
  const __m256 amax = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(b, 16), _mm256_cmpgt_epi32(b, _mm256_set1_epi32(0x7F))));
  const __m256 sc = _mm256_max_ps(_mm256_div_ps(amax, _mm256_set1_ps(qmax)), _mm256_set1_ps(floor));
  if (_mm256_movemask_ps(_mm256_cmp_ps(sc, _mm256_set1_ps(1.099511627776e12f), _CMP_GT_OQ)) != 0) return false;
  _mm256_storeu_ps(s, sc);
  _mm256_storeu_ps(r, _mm256_div_ps(_mm256_set1_ps(1.0f), sc));
  return true;
}

// The policy amax (finite values, subnormals as 0) from bf16_absmax_raw's bits: NaN or inf
// present (raw >= 0x7F80) -> -1 (the caller takes the generic lanes); else the max itself.
inline float bf16_policy_amax(uint32_t raw) {
  if (raw >= 0x7F80u) return -1.0f;
  return raw < 0x80u ? 0.0f : bits_to_float(raw << 16);
}

// ---- A static fp8 scale on bf16 rows: codes by table lookup ------------------------------------
// For a fixed divisor s the fp8 code of a bf16 x is a function of its 15 magnitude bits (E: 8
// exponent bits, m: 7 mantissa bits) and its sign. From the first binade W whose quotients are
// all normal in the format, code(E, m) = T[m] + STEP * (E - W), saturated at the format's max
// (2x doubles a correctly rounded fp32 quotient exactly and moves a normal fp8 code up by one
// binade, STEP = 2^MANT codes). A group of 8 consecutive mantissas spans under 1/16 of a binade,
// less than one fp8 step, so T[m] = T[8g] + (m > thr[g]) (thr[g] = 8g + theta[g] - 1, theta[g]
// the first low 3 bits with a step, 8: none): two 16-byte tables, looked up 32 lanes at a time
// by pshufb. With E8 = STEP * (E - Z) (packus saturates to [0, 255]),
// code = min((E8 + base[g] + (m > thr[g])) -sat K, max), K = STEP * (W - Z): binades E <= Z
// (all below the format's smallest code) give 0; a block with a binade Z < E < W (quotients in
// fp8's subnormal range) or E = 255 (NaN, inf) is redone by the arithmetic lanes. The table is
// built from the scalar fp8_bits and checked against it where it is built (fp8_table_build); a
// table that fails a check is not used. Integer lanes only: no MXCSR dependence.
struct Fp8Table {
  uint32_t bits = 0;  // the divisor's bits
  bool built = false, ok = false;
  alignas(16) uint8_t base[16], thr[16];  // base[g] = T[8g]; thr[g]: the last mantissa of group g coded T[8g]
  alignas(64) uint8_t code[128];  // T itself (the AVX-512 lanes look it up in one vpermi2b)
  int16_t zstep = 0;  // STEP * Z
  uint8_t k = 0, kf = 0;  // K; KF = STEP * (W - Z - 1), 1..127: 1 <= E8 <= KF flags a subnormal-range binade
  float r = 0.0f;         // RN(1 / |s|): the arithmetic lanes' reciprocal for the blocks the table declines
  // The subnormal-range binades' own codes, sub[i][m] = code(Z + 1 + i, m) for the W - Z - 1 of them
  // (nsub; 0 when more than FP8_SUB): the AVX-512 lanes code a flagged block by these lookups
  // instead of redoing it by the arithmetic lanes.
  static constexpr int FP8_SUB = 6;
  uint8_t nsub = 0;
  alignas(64) uint8_t sub[FP8_SUB][128];
};

template <class F>
inline uint8_t fp8_mag_code(uint32_t e, uint32_t m, float as) {  // the scalar code of |x| / |s|
  return uint8_t(fp8_bits<F>(daz(bf16_to_float(uint16_t(e << 7 | m))) / as) & 0x7F);
}

template <class F>
inline void fp8_table_build(Fp8Table& t, float s) {
  constexpr int STEP = 1 << F::mant;
  constexpr uint8_t CMAX = F::mant == 3 ? 0x7E : 0x7B;
  t.bits = float_to_bits(s);
  t.built = true;
  t.ok = false;
  const float as = s < 0 ? -s : s;
  if (F::fnuz || !cr_div_ok(s)) return;
  int w = -1, elow = -1;
  for (int e = 1; e < 255 && w < 0; ++e) {
    if (elow < 0 && fp8_mag_code<F>(e, 127, as) != 0) elow = e;
    if (bf16_to_float(uint16_t(e << 7)) / as >= pow2f(F::emin)) w = e;
  }
  if (w < 3 || elow < 1 || w > 200) return;
  const int z = (elow - 1 < w - 3) ? elow - 1 : w - 3;
  if (STEP * (255 - z) < 255) return;  // E = 255 (NaN, inf) must saturate E8 (the run's flag)
  const int k = STEP * (w - z);
  uint8_t* T = t.code;
  for (int m = 0; m < 128; ++m) {
    T[m] = fp8_mag_code<F>(w, m, as);
    if (T[m] > k || T[m] >= CMAX) return;
  }
  for (int g = 0; g < 16; ++g) {
    const uint8_t b = T[8 * g];
    if (T[8 * g + 7] - b > 1) return;
    int th = 8;
    for (int lo = 7; lo >= 1; --lo) th = T[8 * g + lo] != b ? lo : th;
    t.base[g] = b;
    t.thr[g] = uint8_t(8 * g + th - 1);
  }
  // the binade rule where it applies (a check of the construction, not of the arithmetic)
  for (int e = w; e < w + 24 && e < 255; e += 5)
    for (int m = 0; m < 128; ++m) {
      const int f = T[m] + STEP * (e - w);
      if (fp8_mag_code<F>(e, m, as) != (f < CMAX ? f : CMAX)) return;
    }
  t.zstep = int16_t(STEP * z);
  t.k = uint8_t(k);
  t.kf = uint8_t(STEP * (w - z - 1));
  if (t.kf < 1 || t.kf > 127) return;
  t.nsub = uint8_t(w - z - 1 <= Fp8Table::FP8_SUB ? w - z - 1 : 0);
  for (int i = 0; i < t.nsub; ++i)
    for (int m = 0; m < 128; ++m) t.sub[i][m] = fp8_mag_code<F>(z + 1 + i, m, as);
  t.r = 1.0f / as;
  t.ok = true;
}

// This thread's table of divisor s (a few kept, keyed by the divisor's bits): null where the
// table does not apply.
template <class F>
inline const Fp8Table* fp8_table_for(Fp8Table* cache, float s) {
  const uint32_t b = float_to_bits(s);
  Fp8Table& e = cache[(b ^ (b >> 9) ^ (b >> 19)) & 7];
  if (!e.built || e.bits != b) fp8_table_build<F>(e, s);
  return e.ok ? &e : nullptr;
}

template <class F>
inline Fp8Table* fp8_table_cache() {
  static thread_local Fp8Table cache[8];
  return cache;
}

// E8 = STEP * (E - Z) of 32 bf16 elements (two loads), saturated to [0, 255] (pack order).
template <class F>
KVW_AVX2 __m256i fp8_table_e8(const Fp8Table& t, __m256i l0, __m256i l1) {
  const __m256i emask = _mm256_set1_epi16(0x7F80), zstep = _mm256_set1_epi16(t.zstep);
  return _mm256_packus_epi16(_mm256_sub_epi16(_mm256_srli_epi16(_mm256_and_si256(l0, emask), 7 - F::mant), zstep),
                             _mm256_sub_epi16(_mm256_srli_epi16(_mm256_and_si256(l1, emask), 7 - F::mant), zstep));
}

// A 32-element block the table declined, again by the arithmetic lanes: fp8_bf16_run's
// arithmetic (|x| clamped to RN(max |s|), x / |s| by div_cr8 with the table's reciprocal) with
// the codes read by grid_codes8 and NaN lanes set from the raw bits. Out of line:
// the table loop stays small.
template <class F>
__attribute__((noinline, cold)) KVW_AVX2_FN void fp8_table_redo(const Fp8Table& t, float s, const uint16_t* src,
                                                                 char* dst) {
  const float as = s < 0 ? -s : s;
  const __m256 vs = _mm256_set1_ps(as), vr = _mm256_set1_ps(t.r), vmax = _mm256_set1_ps(fp8_max<F>() * as);
  __m256i l0, l1;
  __m256 x[4];
  load_bf16x32(src, l0, l1, x);
  __m256i c[4];
  for (int k = 0; k < 4; ++k) c[k] = grid_codes8<F::mant, F::emin>(div_cr8(_mm256_min_ps(vmax, abs8(x[k])), vs, vr));
  const __m256i smask = _mm256_set1_epi8(char(0x80)), am = _mm256_set1_epi16(0x7FFF), inf = _mm256_set1_epi16(0x7F80);
  const __m256i sign = _mm256_xor_si256(_mm256_and_si256(_mm256_packs_epi16(l0, l1), smask),
                                        _mm256_set1_epi8(char(s < 0 ? 0x80 : 0)));
  const __m256i nan = _mm256_packs_epi16(_mm256_cmpgt_epi16(_mm256_and_si256(l0, am), inf),
                                         _mm256_cmpgt_epi16(_mm256_and_si256(l1, am), inf));
  const __m256i b = _mm256_or_si256(pack_codes32<false>(c[0], c[1], c[2], c[3]), sign);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), in_order(_mm256_blendv_epi8(b, _mm256_set1_epi8(0x7F), nan)));
}

// fp8 codes of a bf16 row of n elements (n % 32 == 0) by table t (divisor s), 64 blocks of 32 a
// step. A block the table does not code is rewritten by fp8_table_redo after its step: one
// holding a binade in fp8's subnormal range (1 <= E8 <= KF: one signed compare on E8 + 127, its
// byte mask kept per block), and, where the step's E8 max says so, one with E8 = 255 (E = 255: a
// NaN or an inf; also a quotient past 2^23, which the table codes as well). Integer lanes only:
// no MXCSR dependence. Plain stores, never streamed: the redo rewrites half lines (2-3% of blocks on
// N(0, 1) data), which after a streaming store would be partial lines written to memory (mha-fp8
// at N = 4096 under KVWRITE_CPU_SIMD=avx2 ran 1.3x slower streamed).
template <class F>
KVW_AVX2 void fp8_bf16_table_run_avx2(const Fp8Table& t, float s, const uint16_t* __restrict__ src, int n,
                                 char* __restrict__ dst) {
  constexpr uint8_t CMAX = F::mant == 3 ? 0x7E : 0x7B;
  const __m256i base = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t.base)));
  const __m256i thr = _mm256_broadcastsi128_si256(_mm_load_si128(reinterpret_cast<const __m128i*>(t.thr)));
  const __m256i mmask = _mm256_set1_epi16(0x7F), ones = _mm256_set1_epi8(char(0xFF));
  const __m256i k = _mm256_set1_epi8(char(t.k)), cmax = _mm256_set1_epi8(char(CMAX));
  const __m256i low4 = _mm256_set1_epi8(0x0F), smask = _mm256_set1_epi8(char(0x80));
  const __m256i flip = _mm256_set1_epi8(char(s < 0 ? 0x80 : 0));
  const __m256i bias = _mm256_set1_epi8(127), sublim = _mm256_set1_epi8(char(t.kf - 128));  // E8 + 127 < KF - 128
  for (int j0 = 0; j0 < n; j0 += 2048) {
    const int nb = (n - j0 < 2048 ? n - j0 : 2048) / 32;
    uint32_t flags[64], any = 0;
    __m256i e8max = _mm256_setzero_si256();
    for (int b = 0; b < nb; ++b) {
      const uint16_t* x = src + j0 + 32 * b;
      const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x));
      const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16));
      const __m256i e8 = fp8_table_e8<F>(t, l0, l1);
      const __m256i m = _mm256_packus_epi16(_mm256_and_si256(l0, mmask), _mm256_and_si256(l1, mmask));
      const __m256i g = _mm256_and_si256(_mm256_srli_epi16(m, 3), low4);
      const __m256i c = _mm256_sub_epi8(_mm256_shuffle_epi8(base, g), _mm256_cmpgt_epi8(m, _mm256_shuffle_epi8(thr, g)));
      const __m256i code = _mm256_min_epu8(_mm256_subs_epu8(_mm256_adds_epu8(e8, c), k), cmax);
      const __m256i sign = _mm256_xor_si256(_mm256_and_si256(_mm256_packs_epi16(l0, l1), smask), flip);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + j0 + 32 * b), in_order(_mm256_or_si256(code, sign)));
      e8max = _mm256_max_epu8(e8max, e8);
      flags[b] = uint32_t(_mm256_movemask_epi8(_mm256_cmpgt_epi8(sublim, _mm256_add_epi8(e8, bias))));
      any |= flags[b];
    }
    if (__builtin_expect(_mm256_movemask_epi8(_mm256_cmpeq_epi8(e8max, ones)) != 0, 0)) {
      for (int b = 0; b < nb; ++b) {
        const uint16_t* x = src + j0 + 32 * b;
        const __m256i e8 = fp8_table_e8<F>(t, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)),
                                           _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x + 16)));
        flags[b] |= uint32_t(_mm256_movemask_epi8(_mm256_cmpeq_epi8(e8, ones)));
        any |= flags[b];
      }
    }
    if (__builtin_expect(any == 0, 1)) continue;
    for (int b = 0; b < nb; ++b)
      if (flags[b] != 0) fp8_table_redo<F>(t, s, src + j0 + 32 * b, dst + j0 + 32 * b);
  }
}

// nvfp4_blocks8_avx2 for bf16 rows, streaming: each block's raw |x| max as 16-bit lanes (a max
// tree over the 8 blocks' loads), the eight scales as there, then |x| / d by div_cr8 with d's
// reciprocal, |x| first clamped to RN(6 d) (whose quotient codes as 6, as every larger one: no
// overflow); a block with d == 0 takes 0 (every code the element's sign alone, the scalar rule).
// Codes by grid_codes8, the sign from the input, two codes a byte. False (nothing written) for
// blocks holding a NaN or an inf, or a d outside cr_div_ok's range: the caller takes
// nvfp4_blocks8_avx2.
KVW_AVX2 bool nvfp4_blocks8_bf16(const uint16_t* src, const float* global, char* bytes, char* scales, float floor) {
  __m256i l[8], a[8];
  const __m256i am = _mm256_set1_epi16(0x7FFF);
  for (int b = 0; b < 8; ++b) {
    l[b] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * b));
    a[b] = _mm256_and_si256(l[b], am);
  }
  const __m256i raw = hmax16x8(a);
  if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F7F))) != 0) return false;
  const __m256 amax = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(raw, 16), _mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F))));
  __m256 s = _mm256_max_ps(_mm256_div_ps(amax, _mm256_set1_ps(6.0f)), _mm256_set1_ps(floor));
  if (global != nullptr) s = _mm256_div_ps(s, _mm256_set1_ps(global[0]));
  const __m256i code = fp8_codes8<E4M3>(s);
  __m256 d = e4m3_values8(code);
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  if (global != nullptr) d = _mm256_mul_ps(d, _mm256_set1_ps(global[0]));
  const __m256 zero = _mm256_cmp_ps(d, _mm256_setzero_ps(), _CMP_EQ_OQ);
  const __m256 inrange = _mm256_and_ps(_mm256_cmp_ps(d, _mm256_set1_ps(9.094947017729282e-13f), _CMP_GE_OQ),
                                       _mm256_cmp_ps(d, _mm256_set1_ps(1.099511627776e12f), _CMP_LE_OQ));
  if (_mm256_movemask_ps(_mm256_or_ps(zero, inrange)) != 0xFF) return false;
  const __m256 r = _mm256_andnot_ps(zero, _mm256_div_ps(_mm256_set1_ps(1.0f), d));
  const __m256 cap = _mm256_mul_ps(d, _mm256_set1_ps(6.0f));
  const __m256i z = _mm256_setzero_si256(), smask = _mm256_set1_epi16(int16_t(0x8000));
  for (int b = 0; b < 8; ++b) {
    const __m256i bi = _mm256_set1_epi32(b);
    const __m256 db = _mm256_permutevar8x32_ps(d, bi), rb = _mm256_permutevar8x32_ps(r, bi);
    const __m256 cb = _mm256_permutevar8x32_ps(cap, bi);
    const __m256 x0 = _mm256_castsi256_ps(_mm256_unpacklo_epi16(z, l[b])), x1 = _mm256_castsi256_ps(_mm256_unpackhi_epi16(z, l[b]));
    const __m256i c0 = grid_codes8<1, 0>(div_cr8(_mm256_min_ps(cb, abs8(x0)), db, rb));
    const __m256i c1 = grid_codes8<1, 0>(div_cr8(_mm256_min_ps(cb, abs8(x1)), db, rb));
    // 16 codes in element order (16-bit lanes), the sign as bit 3, then two codes a byte
    __m256i p = _mm256_or_si256(_mm256_packus_epi32(c0, c1), _mm256_srli_epi16(_mm256_and_si256(l[b], smask), 12));
    p = _mm256_shuffle_epi8(_mm256_or_si256(p, _mm256_srli_epi32(p, 12)), pick);
    _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes + 8 * b),
                     _mm_unpacklo_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1)));
  }
  alignas(32) int32_t cl[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(cl), code);
  for (int b = 0; b < 8; ++b) scales[b] = char(cl[b]);
  return true;
}

// NVFP4 bf16 blocks without a global scale in two phases (d is then an e4m3 value: the codes by
// 16-bit compares, e2m1_bf16_thresholds), so a run overlaps one group's scale chain (max tree,
// division, e4m3 code and value, thresholds) with the previous group's codes.
// Phase 1: the scales of nb <= 8 blocks from src: false (nothing written) where a block holds a
// NaN or an inf; else the e4m3 scale codes to `scales` and the thresholds to th.
KVW_AVX2 bool nvfp4_scales8_bf16(const uint16_t* src, int nb, float floor, uint32_t (&th)[7][8], char* scales) {
  __m256i a[8];
  const __m256i am = _mm256_set1_epi16(0x7FFF);
  for (int b = 0; b < 8; ++b)
    a[b] = b < nb ? _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * b)), am) : _mm256_setzero_si256();
  const __m256i raw = hmax16x8(a);
  if (_mm256_movemask_epi8(_mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F7F))) != 0) return false;
  const __m256 amax = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(raw, 16), _mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F))));
  const __m256 s = _mm256_max_ps(_mm256_div_ps(amax, _mm256_set1_ps(6.0f)), _mm256_set1_ps(floor));
  const __m256i code = fp8_codes8<E4M3>(s);
  e2m1_bf16_thresholds(e4m3_values8(code), th);
  alignas(32) int32_t cl[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(cl), code);
  for (int b = 0; b < nb; ++b) scales[b] = char(cl[b]);
  return true;
}

// Phase 2: the packed e2m1 codes of nb <= 8 blocks from src by their thresholds.
KVW_AVX2 void nvfp4_codes8_bf16(const uint16_t* src, int nb, const uint32_t (&th)[7][8], char* bytes) {
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int b = 0; b < nb; ++b) {
    const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 16 * b));
    __m256i t[7];
    for (int k = 0; k < 7; ++k) t[k] = _mm256_set1_epi32(int(th[k][b]));
    e2m1_store16_bf16(l, _mm256_and_si256(l, _mm256_set1_epi16(0x7FFF)), t, pick, bytes + 8 * b);
  }
}

// The MXFP4 scale bytes of eight blocks (the DeepSeek V4 record's rule: ue8m0 e = exponent(amax)
// - 3 + (mantissa(amax) >= 0x7C3B7), clamped to [0, 255], amax the policy max) from their raw |x|
// maxima (lanes) into e; returns the mask of the first nb blocks left to the scalar rule (a NaN
// or an inf, or e outside [27, 227]).
KVW_AVX2 uint32_t mxfp4_scales8(__m256i raw, int nb, __m256i& e) {
  const __m256i bits = _mm256_and_si256(_mm256_slli_epi32(raw, 16), _mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F)));
  e = _mm256_sub_epi32(_mm256_sub_epi32(_mm256_srli_epi32(bits, 23), _mm256_set1_epi32(3)),
                       _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7FFFFF)), _mm256_set1_epi32(0x7C3B6)));
  e = _mm256_min_epi32(_mm256_max_epi32(e, _mm256_setzero_si256()), _mm256_set1_epi32(255));
  const __m256i off = _mm256_or_si256(_mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F7F)),
                                      _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(27), e), _mm256_cmpgt_epi32(e, _mm256_set1_epi32(227))));
  return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(off))) & ((1u << nb) - 1);
}

// MXFP4 of nb <= 8 bf16 blocks of 32 from src (codes e2m1(x / 2^(e - 127))): the eight scale
// bytes in one vector (mxfp4_scales8), then each block's codes by 16-bit compares
// (e2m1_pow2_thresholds). Returns the mask of blocks left unwritten: the caller writes those by
// the scalar rule.
KVW_AVX2 uint32_t mxfp4_blocks8_avx2(const uint16_t* src, int nb, char* bytes, char* scales) {
  __m256i a[8];
  const __m256i am = _mm256_set1_epi16(0x7FFF);
  for (int b = 0; b < 8; ++b)
    a[b] = b >= nb ? _mm256_setzero_si256()
                   : _mm256_max_epu16(_mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * b)), am),
                                      _mm256_and_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * b + 16)), am));
  __m256i e;
  const uint32_t left = mxfp4_scales8(hmax16x8(a), nb, e);
  alignas(32) int32_t el[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(el), e);
  const __m256i pick = _mm256_setr_epi8(0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                        0, 4, 8, 12, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
  for (int b = 0; b < nb; ++b) {
    if ((left >> b) & 1) continue;
    __m256i th[7];
    e2m1_pow2_thresholds(el[b], th);
    for (int h = 0; h < 2; ++h) {
      const __m256i l = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + 32 * b + 16 * h));
      e2m1_store16_bf16(l, _mm256_and_si256(l, am), th, pick, bytes + 16 * b + 8 * h);
    }
    scales[b] = char(el[b]);
  }
  return left;
}

KVW_AVX2 uint64_t mxfp4_run_avx2(const uint16_t* x, int nblocks, char* bytes, char* scales) {
  uint64_t left = 0;
  for (int b0 = 0; b0 < nblocks; b0 += 8)
    left |= uint64_t(mxfp4_blocks8_avx2(x + 32 * b0, nblocks - b0 < 8 ? nblocks - b0 : 8, bytes + 16 * b0, scales + b0)) << b0;
  return left;
}

// nblocks consecutive NVFP4 blocks from src + start (bytes: 8 a block, scales: 1 a block), eight
// at a time (bf16: nvfp4_blocks8_bf16 first).
template <DType IN>
KVW_AVX2 void nvfp4_run_avx2(const void* src, i64 start, int nblocks, const float* global, char* bytes, char* scales,
                             float floor = 0.0f) {
  if (IN == DType::BF16 && global == nullptr) {  // the two phases, one group ahead
    const uint16_t* x = static_cast<const uint16_t*>(src) + start;
    alignas(32) uint32_t th[2][7][8];
    bool ok = nblocks > 0 && nvfp4_scales8_bf16(x, nblocks < 8 ? nblocks : 8, floor, th[0], scales);
    for (int b0 = 0, g = 0; b0 < nblocks; b0 += 8, ++g) {
      const int nb = nblocks - b0 < 8 ? nblocks - b0 : 8, n1 = nblocks - b0 - 8;
      const bool next = n1 > 0 && nvfp4_scales8_bf16(x + 16 * (b0 + 8), n1 < 8 ? n1 : 8, floor, th[(g + 1) & 1], scales + b0 + 8);
      if (ok) {
        nvfp4_codes8_bf16(x + 16 * b0, nb, th[g & 1], bytes + 8 * b0);
      } else {
        for (int b = b0; b < b0 + nb; ++b) nvfp4_block_avx2<IN>(src, start + 16 * b, global, bytes + 8 * b, scales + b, floor);
      }
      ok = next;
    }
    return;
  }
  int b = 0;
  const bool bf16 = IN == DType::BF16;
  for (; b + 8 <= nblocks; b += 8) {
    if (bf16 && nvfp4_blocks8_bf16(static_cast<const uint16_t*>(src) + start + 16 * b, global, bytes + 8 * b, scales + b, floor))
      continue;
    nvfp4_blocks8_avx2<IN>(src, start + 16 * b, global, bytes + 8 * b, scales + b, floor);
  }
  for (; b < nblocks; ++b) nvfp4_block_avx2<IN>(src, start + 16 * b, global, bytes + 8 * b, scales + b, floor);
}

#else
inline int simd_level() { return 0; }
inline bool simd_ok() { return false; }
#endif

}  // namespace kvwrite

#include "simd_avx512.h"
