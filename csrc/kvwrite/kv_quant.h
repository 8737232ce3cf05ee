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

KVW_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}
KVW_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
KVW_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

// max(amax / QMAX, 1e-6) in fp32.
template <class F>
KVW_HD float dynamic_scale(float amax) {
  const float s = div_rn(amax, quant_max<F>());
  return s < DYN_SCALE_FLOOR ? DYN_SCALE_FLOOR : s;
}

// int8 code of a scaled value y; NaN -> 0.
template <int RULE>
KVW_HD int int8_code(float y) {
  y = y != y ? 0.0f : y;
  if constexpr (RULE == RULE_VLLM) {
    float t = y >= 0.0f ? add_rn(y, 0.5f) : add_rn(y, -0.5f);
    t = t < -128.0f ? -128.0f : (t > 127.0f ? 127.0f : t);
    return int(t);  // truncation toward zero
  } else {
    const float c = y < -128.0f ? -128.0f : (y > 127.0f ? 127.0f : y);
    constexpr float M = 12582912.0f;  // 1.5 * 2^23: (c + M) - M rounds c to nearest even
    return int(add_rn(add_rn(c, M), -M));
  }
}

// The stored byte of x (already read with DAZ) under format F and RULE: `scale` is s, `recip`
// RN(1 / s) (used by RULE_VLLM only; see `Quantizer`).
template <class F, int RULE>
struct Quantizer {
  float scale, recip;
  KVW_HD explicit Quantizer(float s) : scale(s), recip(RULE == RULE_VLLM ? div_rn(1.0f, s) : 1.0f) {}
  KVW_HD uint8_t operator()(float x) const {
    const float y = RULE == RULE_VLLM ? mul_rn(x, recip) : div_rn(x, scale);
    if constexpr (std::is_same<F, Int8Fmt>::value) {
      return uint8_t(int8_code<RULE>(y) & 0xFF);
    } else {
      return fp8_bits<F>(y);
    }
  }
};

// Codes of n consecutive input elements from `start`, written as bytes (a loop the host compiler
// vectorises: restrict-qualified, no early exit).
template <DType IN, class F, int RULE>
KVW_HD void quantize_run(const void* __restrict__ src, i64 start, int n, Quantizer<F, RULE> q,
                         char* __restrict__ dst) {
  for (int j = 0; j < n; ++j) dst[j] = char(q(load_quant<IN>(src, start + j)));
}

// max finite |x| over H runs of D elements (run h at start + h * s_head); lanes `lane` of `nlanes`
// each take every nlanes-th element and the group's max is combined by group_max (nlanes <= 32).
template <DType IN>
KVW_HD float heads_amax(const void* src, i64 start, i64 s_head, int H, int D, int lane, int nlanes) {
  uint32_t m = 0;
  if (nlanes == 1) {
    for (int h = 0; h < H; ++h) {
      const float a = block_amax<IN>(src, start + h * s_head, D);
      const uint32_t b = float_to_bits(a);
      m = b > m ? b : m;
    }
    return bits_to_float(m);
  }
  for (int e = lane; e < H * D; e += nlanes) {
    const int h = e / D, d = e - h * D;
    const uint32_t a = abs_bits<IN>(src, start + h * s_head + d);
    m = a > m ? a : m;
  }
  return group_max(bits_to_float(m), nlanes);
}

}  // namespace kvwrite
