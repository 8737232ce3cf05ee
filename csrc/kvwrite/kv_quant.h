// Per-token / per-token-head dynamic and static int8 / fp8 K/V quantisation, host + device: the
// twin of kernels/_quant.py and kvwrite/reference/kv_quant.py (formulas on kvwrite.ops.kv_quant).
// Shared by store_kv_quant.h and the fused RoPE stores.
//   scale (dynamic) = max(amax / QMAX, 1e-6), amax over the finite |x| (block_amax)
//   RULE_RNE : y = x / s;        int8 = RNE(clamp(y, -128, 127)); fp8 = fp8_bits<F>(y)
//   RULE_VLLM: y = x * RN(1/s);  int8 = trunc(clamp(RN(y +- 0.5), -128, 127)); fp8 as above
// Every fp32 operation is correctly rounded and never fused (explicit _rn intrinsics on the
// device; -ffp-contract=off on the host), so the codes are identical on every backend.
#pragma once

#include <type_traits>

#include "fp8.h"
#include "quant.h"
#include "rn.h"

#include "simd_x86.h"

namespace kvwrite {

// The int8 format tag (fp8 formats are fp8.h's E4M3 / E5M2).
struct Int8Fmt {};

// Python's FMT codes (kvwrite.ops.kv_quant) and the quant modes of store_kv_quant.
enum KVQuantFmt : int { FMT_E4M3 = 1, FMT_E5M2 = 2, FMT_INT8 = 3 };
enum KVQuantMode : int { QUANT_STATIC = 1, QUANT_TOKEN = 2, QUANT_HEAD = 3 };
enum QuantRule : int { RULE_RNE = 0, RULE_VLLM = 1 };

constexpr float DYN_SCALE_FLOOR = 1e-6f;

template <class F>
KVW_HD float quant_max() {
  if constexpr (std::is_same<F, Int8Fmt>::value) {
    return 127.0f;
  } else {
    return fp8_max<F>();
  }
}


// max(amax / QMAX, 1e-6) in fp32.
template <class F>
KVW_HD float dynamic_scale(float amax) {
  const float s = div_rn(amax, quant_max<F>());
  return s < DYN_SCALE_FLOOR ? DYN_SCALE_FLOOR : s;
}

// clamp to [-128, 127] (a NaN becomes -128 here; int8_code maps NaN to 0 afterwards).
KVW_HD float clamp_int8(float t) {
  t = t > -128.0f ? t : -128.0f;
  return t < 127.0f ? t : 127.0f;
}

// int8 code of a scaled value y; NaN -> 0. Branch-free (every operation runs, then selects).
template <int RULE>
KVW_HD int int8_code(float y) {
  const bool nan = y != y;
  int code;
  if constexpr (RULE == RULE_VLLM) {
    const float up = add_rn(y, 0.5f), down = add_rn(y, -0.5f);
    code = int(clamp_int8(y >= 0.0f ? up : down));  // truncation toward zero
  } else {
    constexpr float M = 12582912.0f;  // 1.5 * 2^23: (c + M) - M rounds c to nearest even
    code = int(add_rn(add_rn(clamp_int8(y), M), -M));
  }
  return nan ? 0 : code;
}

// The stored byte of x (already read with DAZ) under format F and the call's rule: `scale` is s,
// `recip` RN(1 / s) (used by RULE_VLLM only). The rule is a runtime value (one kernel serves both
// rules: a uniform branch on the GPU; the host runs pick the rule once per run).
template <class F>
struct Quantizer {
  float scale, recip;
  int rule;
  KVW_HD Quantizer(float s, int r) : scale(s), recip(r == RULE_VLLM ? div_rn(1.0f, s) : 1.0f), rule(r) {}
  template <int RULE>
  KVW_HD uint8_t code(float x) const {
    const float y = RULE == RULE_VLLM ? mul_rn(x, recip) : div_rn(x, scale);
    if constexpr (std::is_same<F, Int8Fmt>::value) {
      return uint8_t(int8_code<RULE>(y) & 0xFF);
    } else {
      return fp8_bits<F>(y);
    }
  }
  KVW_HD uint8_t operator()(float x) const { return rule == RULE_VLLM ? code<RULE_VLLM>(x) : code<RULE_RNE>(x); }
};

#if KVW_SIMD_X86
// Codes of 8 elements on an AVX2 host, Quantizer's arithmetic in eight lanes: daz, fp32 division
// (or multiply by the reciprocal); int8: NaN -> 0, clamp, RNE (cvtps under the default MXCSR,
// as the scalar magic-number add) or +-0.5 and truncation; fp8: fp8_codes8.
template <DType IN, class F, int RULE, bool FAST>
KVW_AVX2 __m256i quant_codes8(const void* src, i64 i, __m256 vs, __m256 vr) {
  const __m256 x = FAST ? load8<IN>(src, i) : load8_daz<IN>(src, i);
  __m256 y = RULE == RULE_VLLM ? _mm256_mul_ps(x, vr) : _mm256_div_ps(x, vs);
  if constexpr (std::is_same<F, Int8Fmt>::value) {
    const __m256 nan = _mm256_cmp_ps(y, y, _CMP_UNORD_Q);
    if constexpr (RULE == RULE_VLLM) {
      const __m256 half = _mm256_set1_ps(0.5f);
      const __m256 ge = _mm256_cmp_ps(y, _mm256_setzero_ps(), _CMP_GE_OQ);
      y = _mm256_blendv_ps(_mm256_sub_ps(y, half), _mm256_add_ps(y, half), ge);
    }
    y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-128.0f)), _mm256_set1_ps(127.0f));
    const __m256i c = RULE == RULE_VLLM ? _mm256_cvttps_epi32(y) : _mm256_cvtps_epi32(y);
    return _mm256_andnot_si256(_mm256_castps_si256(nan), c);
  } else {
    return fp8_codes8<F>(y);
  }
}

// The fast lanes (as fp8_heads_avx2): with 2^-100 <= |s| <= 2^100 (and so 2^-100 <= |1/s|) a
// subnormal input's y is below 2^-26 in magnitude, coded as daz's signed zero would be (under
// MXCSR.FTZ / DAZ too).
template <DType IN, class F, int RULE>
KVW_AVX2 void quantize_run_avx2(const void* __restrict__ src, i64 start, int n, Quantizer<F> q,
                                char* __restrict__ dst) {
  const __m256 vs = _mm256_set1_ps(q.scale), vr = _mm256_set1_ps(q.recip);
  const float a = q.scale < 0 ? -q.scale : q.scale;
  const auto tail = [&](int j) KVW_AVX2_FN { return q.template code<RULE>(load_quant<IN>(src, start + j)); };
  constexpr bool I8 = std::is_same<F, Int8Fmt>::value;
  if (a >= 7.888609052210118e-31f && a <= 1.2676506002282294e30f) {
    return simd_run<I8>(n, dst, [&](int i) KVW_AVX2_FN { return quant_codes8<IN, F, RULE, true>(src, start + i, vs, vr); }, tail);
  }
  simd_run<I8>(n, dst, [&](int i) KVW_AVX2_FN { return quant_codes8<IN, F, RULE, false>(src, start + i, vs, vr); }, tail);
}
#endif

// Codes of n consecutive input elements from `start`, written as bytes (on an AVX2 host:
// quantize_run_avx2; else a loop the host compiler vectorises: restrict-qualified, no exit).
template <DType IN, class F, int RULE>
KVW_HD void quantize_run_rule(const void* __restrict__ src, i64 start, int n, Quantizer<F> q,
                              char* __restrict__ dst) {
#if KVW_SIMD_X86
  if (n >= 32 && simd_ok()) return quantize_run_avx2<IN, F, RULE>(src, start, n, q, dst);
#endif
  for (int j = 0; j < n; ++j) dst[j] = char(q.template code<RULE>(load_quant<IN>(src, start + j)));
}

template <DType IN, class F>
KVW_HD void quantize_run(const void* __restrict__ src, i64 start, int n, Quantizer<F> q, char* __restrict__ dst) {
  if (q.rule == RULE_VLLM) return quantize_run_rule<IN, F, RULE_VLLM>(src, start, n, q, dst);
  quantize_run_rule<IN, F, RULE_RNE>(src, start, n, q, dst);
}

// |x| bits of element i as the dynamic scale reads it: 0 for NaN, +-inf and fp32 subnormals
// (policy_abs_bits of quant.h, branch-free so the host loop vectorises).
template <DType IN>
KVW_HD uint32_t scale_abs_bits(const void* src, i64 i) {
  uint32_t a;
  if constexpr (IN == DType::BF16) {
    a = uint32_t(static_cast<const uint16_t*>(src)[i] & 0x7FFFu) << 16;
  } else {
    a = float_to_bits(load_float<IN>(src, i)) & 0x7FFFFFFFu;
  }
  return a & -uint32_t((a < 0x7F800000u) & (a >= 0x00800000u));  // a mask, not a select: vectorises
}

// max finite |x| over n elements from `start` (as block_amax; vectorisable).
template <DType IN>
KVW_HD float run_amax(const void* __restrict__ src, i64 start, int n) {
#if KVW_SIMD_X86
  if (n % 8 == 0 && simd_ok()) return block_amax<IN>(src, start, n);
#endif
  uint32_t m = 0;
  for (int j = 0; j < n; ++j) {
    const uint32_t a = scale_abs_bits<IN>(src, start + j);
    m = a > m ? a : m;
  }
  return bits_to_float(m);
}

// max finite |x| over H runs of D elements (run h at start + h * s_head); lanes `lane` of `nlanes`
// each take every nlanes-th element and the group's max is combined by group_max (nlanes <= 32).
template <DType IN>
KVW_HD float heads_amax(const void* src, i64 start, i64 s_head, int H, int D, int lane, int nlanes) {
  uint32_t m = 0;
  if (nlanes == 1) {
    for (int h = 0; h < H; ++h) {
      const float a = run_amax<IN>(src, start + h * s_head, D);
      const uint32_t b = float_to_bits(a);
      m = b > m ? b : m;
    }
    return bits_to_float(m);
  }
  for (int e = lane; e < H * D; e += nlanes) {
    const int h = e / D, d = e - h * D;
    const uint32_t a = scale_abs_bits<IN>(src, start + h * s_head + d);
    m = a > m ? a : m;
  }
  return group_max(bits_to_float(m), nlanes);
}

}  // namespace kvwrite
