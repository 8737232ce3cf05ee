// NVFP4 block quantisation (the twin of kernels/_nvfp4.py; format and error bound in
// kvwrite/reference/nvfp4.py). A block of 16 values with optional fp32 global scale g:
//   s = amax / 6 / g;  code = e4m3(saturate(s));  d = value(code) * g;
//   q = e2m1(x / d) (RNE, ties to the even code, sign kept; d == 0: each element's sign alone);
//   specials (README "Special values"): subnormal inputs read as +-0, amax over the finite
//   values, +-inf -> +-6, NaN -> code 0 and the block's scale byte 0x7F (NaN);
//   byte j = q[2j] | q[2j+1] << 4.
#pragma once

#include "quant.h"

namespace kvwrite {

constexpr int NVFP4_BLOCK = 16;

// 4-bit e2m1 code of y: nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties to even code), saturating
// (+-inf -> +-6), sign kept; NaN -> 0 (the block's scale carries it, see nvfp4_block).
KVW_HD uint32_t e2m1_code(float y) {
  const float a = y < 0 ? -y : y;
  const uint32_t code = uint32_t(a > 0.25f) + uint32_t(a >= 0.75f) + uint32_t(a > 1.25f) + uint32_t(a >= 1.75f) +
                        uint32_t(a > 2.5f) + uint32_t(a >= 3.5f) + uint32_t(a > 5.0f);
  if (y != y) return 0u;
  return code | ((float_to_bits(y) >> 28) & 8u);
}

// Quantise one block: `load(e)` gives element e (0..15) as fp32; `global` may be null (g = 1).
// Writes 8 packed bytes at `bytes` and the e4m3 scale code at `scale`. `floor`: s = max(amax / 6,
// floor) before the global scale (DeepSeek-V4.1's record: 2^-9; 0: none).
template <class Load>
KVW_HD void nvfp4_block(Load load, const float* global, char* bytes, char* scale, float floor = 0.0f) {
  float x[NVFP4_BLOCK];
  float amax = 0.0f;
  bool has_nan = false;
  for (int e = 0; e < NVFP4_BLOCK; ++e) {
    x[e] = daz(load(e));
    const float a = finite_abs(x[e]);
    amax = a > amax ? a : amax;
    has_nan = has_nan || x[e] != x[e];
  }
  float s = amax / 6.0f;
  s = s < floor ? floor : s;
  if (global != nullptr) s = s / global[0];
  const uint8_t code = fp8_bits<E4M3>(s);
  float d = e4m3_to_float(code);
  if (global != nullptr) d = d * global[0];
  // d == 0 (all-zero block, or a global scale that underflows it): every element its sign alone
  const auto elem = [&](float v) -> uint32_t {
    if (v != v) return 0u;
    return d == 0.0f ? (float_to_bits(v) >> 28) & 8u : e2m1_code(v / d);
  };
  for (int j = 0; j < NVFP4_BLOCK / 2; ++j) bytes[j] = char(elem(x[2 * j]) | (elem(x[2 * j + 1]) << 4));
  *scale = char(has_nan ? uint8_t(0x7F) : code);  // a NaN in the block makes its scale NaN
}

// nvfp4_block of the 16 elements of an IN array from `start` (an AVX2 host: nvfp4_block_avx2).
template <DType IN>
KVW_HD void nvfp4_block_at(const void* src, i64 start, const float* global, char* bytes, char* scale,
                           float floor = 0.0f) {
#if KVW_SIMD_X86
  if (simd_ok()) return nvfp4_block_avx2<IN>(src, start, global, bytes, scale, floor);
#endif
  nvfp4_block([&](int e) { return load_float<IN>(src, start + e); }, global, bytes, scale, floor);
}

// e2m1 codes of n elements from `start` divided by s (> 0), packed two per byte (element 2j in
// the low nibble); returns whether any element was NaN (its code is 0).
template <DType IN>
KVW_HD bool e2m1_run(const void* src, i64 start, int n, float s, char* bytes) {
#if KVW_SIMD_X86
  if (n % 16 == 0 && simd_ok()) return e2m1_run_avx2<IN>(src, start, n, s, bytes);
#endif
  bool nan = false;
  for (int j = 0; j < n / 2; ++j) {
    const float lo = load_quant<IN>(src, start + 2 * j), hi = load_quant<IN>(src, start + 2 * j + 1);
    nan = nan || lo != lo || hi != hi;
    bytes[j] = char(e2m1_code(lo / s) | (e2m1_code(hi / s) << 4));
  }
  return nan;
}

// nblocks consecutive blocks from `start` (bytes: 8 a block, scales: 1 a block, both contiguous).
template <DType IN>
KVW_HD void nvfp4_run(const void* src, i64 start, int nblocks, const float* global, char* bytes, char* scales,
                      float floor = 0.0f) {
#if KVW_SIMD_X86
  if (simd_ok()) return nvfp4_run_simd<IN>(src, start, nblocks, global, bytes, scales, floor);
#endif
  for (int b = 0; b < nblocks; ++b)
    nvfp4_block_at<IN>(src, start + i64(b) * NVFP4_BLOCK, global, bytes + b * (NVFP4_BLOCK / 2), scales + b, floor);
}

}  // namespace kvwrite
