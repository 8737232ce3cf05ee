// Block quantisation shared by the MLA and indexer-K kernels (and NVFP4): block amax, the scale
// rules, e4m3 block codes, bf16 rounding, little-endian byte stores. Host + device.
#pragma once

#include "fp8.h"
#include "simd_x86.h"

namespace kvwrite {

constexpr float FLT_MIN_NORMAL = 1.17549435082228750797e-38f;  // torch.finfo(float32).tiny

// Element i of a float/half/bf16 array as the quantisers read it: fp32, subnormals as +-0.
template <DType IN>
KVW_HD float load_quant(const void* src, i64 i) {
  return daz(load_float<IN>(src, i));
}

// |x| of a float/half/bf16 element as ordered integer bits, 0 for NaN, +-inf and subnormals (the
// special-value policy: amax over the finite values, inputs read with DAZ): the max of these
// bits is the bits of the float max, an integer max the compiler vectorises.
KVW_HD uint32_t policy_abs_bits(uint32_t a) { return a >= 0x7F800000u || a < 0x00800000u ? 0u : a; }

template <DType IN>
KVW_HD uint32_t abs_bits(const void* src, i64 i) {
  uint32_t a;
  if constexpr (IN == DType::BF16) {
    a = uint32_t(static_cast<const uint16_t*>(src)[i] & 0x7FFFu) << 16;
  } else {
    a = float_to_bits(load_float<IN>(src, i)) & 0x7FFFFFFFu;
  }
  return policy_abs_bits(a);
}

// max |x| over the finite elements of n (NaN and +-inf do not count), from element `start`.
template <DType IN>
KVW_HD float block_amax(const void* src, i64 start, int n) {
#if KVW_SIMD_X86
  if constexpr (IN == DType::BF16) {  // the raw max of 16-bit magnitudes; NaN / inf: the policy lanes
    if (n % 16 == 0 && simd_ok()) {
      const float a = bf16_policy_amax(bf16_absmax_raw(static_cast<const uint16_t*>(src) + start, n));
      if (a >= 0.0f) return a;
    }
  }
  if (n % 8 == 0 && simd_ok()) return amax_avx2<IN>(src, start, n);
#endif
  uint32_t m = 0;
  for (int j = 0; j < n; ++j) {
    const uint32_t a = abs_bits<IN>(src, start + j);
    m = a > m ? a : m;
  }
  return bits_to_float(m);
}

// Max of `v` over an aligned group of `width` lanes (a power of two <= 32) of one warp, by
// xor shuffles; every lane of the group must call it. On the host (one lane) it is `v`.
KVW_HD float group_max(float v, int width) {
#if defined(__CUDA_ARCH__)
  const unsigned lane = threadIdx.x & 31u;
  const unsigned mask = width >= 32 ? 0xFFFFFFFFu : ((1u << width) - 1u) << (lane & ~unsigned(width - 1));
  for (int o = width / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(mask, v, o, width));
#else
  (void)width;
#endif
  return v;
}

// A lane's chunk: CHUNK consecutive elements (16-byte loads where aligned on the device), read as
// the quantisers read them (load_quant: subnormals as +-0).
constexpr int CHUNK = 16;

KVW_HD bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <DType IN>
KVW_HD void load_chunk(const void* src, i64 start, float (&x)[CHUNK]) {
#if defined(__CUDA_ARCH__)
  const char* p = static_cast<const char*>(src) + start * dtype_size(IN);
  if (aligned16(p)) {
    if constexpr (IN == DType::F32) {
KVW_UNROLL
      for (int q = 0; q < CHUNK / 4; ++q) {
        const float4 f = reinterpret_cast<const float4*>(p)[q];
        x[4 * q] = f.x, x[4 * q + 1] = f.y, x[4 * q + 2] = f.z, x[4 * q + 3] = f.w;
      }
    } else {
KVW_UNROLL
      for (int q = 0; q < CHUNK / 8; ++q) {
        const uint4 u = reinterpret_cast<const uint4*>(p)[q];
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
KVW_UNROLL
        for (int j = 0; j < 8; ++j) {
          const uint16_t h = uint16_t(w[j / 2] >> (16 * (j & 1)));
          x[8 * q + j] = IN == DType::BF16 ? bf16_to_float(h) : half_to_float(h);
        }
      }
    }
KVW_UNROLL
    for (int j = 0; j < CHUNK; ++j) x[j] = daz(x[j]);
    return;
  }
#endif
KVW_UNROLL
  for (int j = 0; j < CHUNK; ++j) x[j] = load_quant<IN>(src, start + j);
}

// Store CHUNK bytes (one 16-byte store where aligned on the device).
KVW_HD void store_chunk(char* dst, const uint8_t (&c)[CHUNK]) {
#if defined(__CUDA_ARCH__)
  if (aligned16(dst)) {
    uint32_t w[4];
KVW_UNROLL
    for (int q = 0; q < 4; ++q)
      w[q] = uint32_t(c[4 * q]) | uint32_t(c[4 * q + 1]) << 8 | uint32_t(c[4 * q + 2]) << 16 | uint32_t(c[4 * q + 3]) << 24;
    *reinterpret_cast<uint4*>(dst) = make_uint4(w[0], w[1], w[2], w[3]);
    return;
  }
#endif
  memcpy(dst, c, CHUNK);
}

// max |x| of a loaded chunk (finite values only), as block_amax.
KVW_HD float chunk_amax(const float (&x)[CHUNK]) {
  uint32_t m = 0;
KVW_UNROLL
  for (int j = 0; j < CHUNK; ++j) {
    const uint32_t a = policy_abs_bits(float_to_bits(x[j]) & 0x7FFFFFFFu);
    m = a > m ? a : m;
  }
  return bits_to_float(m);
}

// e4m3 codes of a chunk / scale, stored as CHUNK bytes.
template <class F = E4M3>
KVW_HD void quant_chunk(const float (&x)[CHUNK], float scale, char* dst) {
  uint8_t c[CHUNK];
KVW_UNROLL
  for (int j = 0; j < CHUNK; ++j) c[j] = fp8_bits<F>(x[j] / scale);
  store_chunk(dst, c);
}

// DeepSeek fp8_ds_mla tile scale: max(amax / 448, FLT_MIN).
KVW_HD float ds_mla_scale(float amax) {
  const float s = amax / 448.0f;
  return s < FLT_MIN_NORMAL ? FLT_MIN_NORMAL : s;
}

// Round a positive normal fp32 up to a power of two (ue8m0), on the exponent bits.
KVW_HD float ue8m0_ceil(float s) { return bits_to_float((float_to_bits(s) + 0x7FFFFFu) & 0x7F800000u); }

// fp8_ds_mla power-of-two tile scale: 2^ceil(log2(max(amax / 448, 1e-4))).
KVW_HD float ds_mla_scale_pow2(float amax) {
  const float s = amax / 448.0f;
  return ue8m0_ceil(s < 1e-4f ? 1e-4f : s);
}

// DSA indexer block scale: max(amax, 1e-4) / 448, optionally rounded up to a power of two.
KVW_HD float indexer_scale(float amax, bool ue8m0) {
  const float s = (amax < 1e-4f ? 1e-4f : amax) / 448.0f;
  return ue8m0 ? ue8m0_ceil(s) : s;
}

// fp8 (format F) codes of x / scale for n elements (saturating, RNE), written as bytes: on an
// AVX2 host fp8_run_avx2; else plain restrict-qualified locals, so the host compiler vectorises
// the loop (a char store may otherwise alias any struct field the loop reads).
template <DType IN, class F>
KVW_HD void quant_run(const void* __restrict__ src, i64 start, int n, float scale, char* __restrict__ dst) {
  int j = 0;
#if KVW_SIMD_X86
  if constexpr (IN == DType::BF16 && !F::fnuz) {  // the streaming bf16 lanes, then the tail
    if (n >= 32 && simd_ok() && cr_div_ok(scale))
      j = fp8_bf16_run<F>(static_cast<const uint16_t*>(src) + start, n, scale, dst);
  }
  if (j == 0 && n >= 32 && simd_ok()) return fp8_run_avx2<IN, F>(src, start, n, scale, dst);
#endif
  for (; j < n; ++j) dst[j] = char(fp8_bits<F>(load_quant<IN>(src, start + j) / scale));
}

#if KVW_SIMD_X86
// quant_run for a static scale (the same divisor for every token of a call) on an AVX2 host:
// bf16 rows of whole 32-element blocks by the divisor's code table (fp8_bf16_table_run, `cache`
// from fp8_table_cache), else quant_run.
template <DType IN, class F>
inline void quant_run_static(const void* src, i64 start, int n, float scale, char* dst, Fp8Table* cache) {
  if constexpr (IN == DType::BF16 && !F::fnuz) {
    if (cache != nullptr && n % 32 == 0 && n >= 32) {
      const Fp8Table* t = fp8_table_for<F>(cache, scale);
      if (t != nullptr) return fp8_bf16_table_run<F>(*t, scale, static_cast<const uint16_t*>(src) + start, n, dst);
    }
  }
  quant_run<IN, F>(src, start, n, scale, dst);
}

// The code-table cache of this thread for a bf16 -> fp8 (not fnuz) host run, else null.
template <DType IN, class F>
inline Fp8Table* static_fp8_tables() {
  if constexpr (IN == DType::BF16 && !F::fnuz) return simd_ok() ? fp8_table_cache<F>() : nullptr;
  return nullptr;
}
#endif

// quant_run over H heads of D elements (head h from start + h * s_head with scale[h * scale_step],
// codes at dst + h * dst_step): on an AVX2 host one call for all heads (bf16: quant_run_static;
// one scale for every head: one table look-up, and one run where the heads are contiguous).
template <DType IN, class F>
KVW_HD void quant_heads(const void* src, i64 start, i64 s_head, int H, int D, const float* scale, i64 scale_step,
                        char* dst, i64 dst_step) {
#if KVW_SIMD_X86
  if (IN != DType::BF16 && D >= 32 && simd_ok())
    return fp8_heads_avx2<IN, F>(src, start, s_head, H, D, scale, scale_step, dst, dst_step);
  if (IN == DType::BF16 && D >= 32 && simd_ok()) {
    Fp8Table* cache = static_fp8_tables<IN, F>();
    if constexpr (IN == DType::BF16 && !F::fnuz) {
      const Fp8Table* t = scale_step == 0 && D % 32 == 0 ? fp8_table_for<F>(cache, scale[0]) : nullptr;
      if (t != nullptr) {
        const uint16_t* x = static_cast<const uint16_t*>(src) + start;
        if (s_head == D && dst_step == D) return fp8_bf16_table_run<F>(*t, scale[0], x, H * D, dst);
        for (int h = 0; h < H; ++h) fp8_bf16_table_run<F>(*t, scale[0], x + h * s_head, D, dst + h * dst_step);
        return;
      }
    }
    for (int h = 0; h < H; ++h)
      quant_run_static<IN, F>(src, start + h * s_head, D, scale[h * scale_step], dst + h * dst_step, cache);
    return;
  }
#endif
  for (int h = 0; h < H; ++h) quant_run<IN, F>(src, start + h * s_head, D, scale[h * scale_step], dst + h * dst_step);
}

// e4m3 codes of x / scale for n elements (saturating, RNE), written as bytes.
template <DType IN>
KVW_HD void quant_block_e4m3(const void* src, i64 start, int n, float scale, char* dst) {
  quant_run<IN, E4M3>(src, start, n, scale, dst);
}

#if KVW_SIMD_X86
// Host, bf16: the e4m3 codes of `tiles` consecutive tiles of `tile` elements from src + start
// (tile % 32 == 0, tiles <= 16), each by its own scale: every tile's amax first, then every
// scale (`scale_of(amax)`, at least RN(amax / 448): a dynamic scale) and its reciprocal, then the
// codes (fp8_bf16_run; its DYN lanes for a tile without NaN or inf), so no tile's codes wait on
// its own division chain. Scales go to `scales` (fp32). False (nothing decided) where the lanes
// do not apply: the caller's generic loop then writes the tiles.
// PLAIN: scale_of is ds_mla_scale (RN(amax / 448)) wherever every tile's raw bf16 amax is at least
// min_raw (a rule with a floor: the indexer's 1e-4): fp8_ds_tiles_512 first at the AVX-512 level.
template <bool PLAIN = false, class ScaleOf>
inline bool e4m3_tiles_bf16(const void* src, i64 start, int tiles, int tile, ScaleOf&& scale_of, char* dst,
                            float* scales, uint32_t min_raw = 0) {
  if (tiles > 16 || tile % 32 != 0 || !simd_ok()) return false;
  return with_lanes([&](auto l) {  // the level once a call of the tile loop
    const uint16_t* x = static_cast<const uint16_t*>(src) + start;
    if constexpr (PLAIN) {
      if (tile % 64 == 0 && l.fp8_ds_tiles(x, tiles, tile, dst, scales, min_raw)) return true;
    }
    float rc[16];
    uint32_t special = 0;  // tiles holding a NaN or an inf
    for (int w = 0; w < tiles; ++w) {
      const float a = bf16_policy_amax(l.bf16_absmax_raw(x + w * tile, tile));
      special |= uint32_t(a < 0.0f) << w;
      scales[w] = scale_of(a < 0.0f ? block_amax<DType::BF16>(src, start + i64(w) * tile, tile) : a);
    }
    for (int w = 0; w < tiles; ++w) {
      if (!cr_div_ok(scales[w])) return false;
      rc[w] = 1.0f / scales[w];
    }
    for (int w = 0; w < tiles; ++w) {
      if ((special >> w) & 1) {
        l.template fp8_bf16_run<E4M3>(x + w * tile, tile, scales[w], dst + i64(w) * tile, rc[w]);
      } else {
        l.template fp8_bf16_run<E4M3, true>(x + w * tile, tile, scales[w], dst + i64(w) * tile, rc[w]);
      }
    }
    return true;
  });
}
#endif

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
