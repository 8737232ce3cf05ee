// Block quantisation shared by the MLA and indexer-K kernels (and NVFP4): block amax, the scale
// rules, e4m3 block codes, bf16 rounding, little-endian byte stores. Host + device.
#pragma once

#include "fp8.h"

namespace kvwrite {

constexpr float FLT_MIN_NORMAL = 1.17549435082228750797e-38f;  // torch.finfo(float32).tiny

// Element i of a float/half/bf16 array as the quantisers read it: fp32, subnormals as +-0.
template <DType IN>
KVW_HD float load_quant(const void* src, i64 i) {
  return daz(load_float<IN>(src, i));
}

// max |x| over the finite elements of n (NaN and +-inf do not count), from element `start`.
template <DType IN>
KVW_HD float block_amax(const void* src, i64 start, int n) {
  float m = 0.0f;
  for (int j = 0; j < n; ++j) {
    const float aa = finite_abs(load_quant<IN>(src, start + j));
    m = aa > m ? aa : m;
  }
  return m;
}

// DeepSeek fp8_ds_mla tile scale: max(amax / 448, FLT_MIN).
KVW_HD float ds_mla_scale(float amax) {
  const float s = amax / 448.0f;
  return s < FLT_MIN_NORMAL ? FLT_MIN_NORMAL : s;
}

// Round a positive normal fp32 up to a power of two (ue8m0), on the exponent bits.
KVW_HD float ue8m0_ceil(float s) { return bits_to_float((float_to_bits(s) + 0x7FFFFFu) & 0x7F800000u); }

// DSA indexer block scale: max(amax, 1e-4) / 448, optionally rounded up to a power of two.
KVW_HD float indexer_scale(float amax, bool ue8m0) {
  const float s = (amax < 1e-4f ? 1e-4f : amax) / 448.0f;
  return ue8m0 ? ue8m0_ceil(s) : s;
}

// e4m3 codes of x / scale for n elements (saturating, RNE), written as bytes.
template <DType IN>
KVW_HD void quant_block_e4m3(const void* src, i64 start, int n, float scale, char* dst) {
  for (int j = 0; j < n; ++j) dst[j] = char(fp8_bits<E4M3>(load_quant<IN>(src, start + j) / scale));
}

// bf16 bits of element i: bf16 input copied; other floats rounded to nearest even (NaN -> 0x7FC0).
template <DType IN>
KVW_HD uint16_t bf16_bits(const void* src, i64 i) {
  if constexpr (IN == DType::BF16) {
    return static_cast<const uint16_t*>(src)[i];
  } else {
    const float f = load_float<IN>(src, i);
    if (f != f) return 0x7FC0;
    const uint32_t u = float_to_bits(f);
    return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
}

// Store the low `nbytes` bytes of `bits`, little-endian, byte by byte (no alignment needed).
KVW_HD void store_le(char* dst, uint32_t bits, int nbytes) {
  for (int b = 0; b < nbytes; ++b) dst[b] = char((bits >> (8 * b)) & 0xFF);
}

}  // namespace kvwrite
