// store_mla: the MLA row store. Row = concat(kv_c [L], k_pe [R]) copied (MLA_COPY) or
// saturate(x / scale) in fp8 (MLA_FP8), or DeepSeek's fp8_ds_mla row (MLA_DS_MLA: L e4m3 bytes
// quantised per 128-element tile, the L/128 fp32 tile scales, then R bf16 rope values), or NVFP4
// (MLA_NVFP4: (L+R)/2 packed e2m1 bytes + (L+R)/16 e4m3 block scales in `scale_cache`).
// Formats: kvwrite/ops/mla.py. One token's work is `store_mla_token`, split over lanes.
#pragma once

#include <type_traits>

#include "dispatch.h"
#include "locs.h"
#include "nvfp4.h"
#include "paged.h"
#include "quant.h"

namespace kvwrite {

// Kernel modes (kvwrite.ops.mla MODE_*).
enum MLAMode : int { MLA_COPY = 0, MLA_FP8 = 1, MLA_DS_MLA = 2, MLA_NVFP4 = 3 };
constexpr int DS_MLA_TILE = 128;
// fp8_ds_mla option bits carried above the mode (kvwrite.ops.mla DS_MLA_*): power-of-two tile
// scales; rope stored as the input's own 16-bit pattern.
constexpr int MLA_MODE_MASK = 15, DS_MLA_POW2 = 1 << 4, DS_MLA_RAW_ROPE = 1 << 5;

// Lanes of one 128-tile in the warp-cooperative fp8_ds_mla path (CHUNK elements each).
constexpr int DS_MLA_TILE_LANES = DS_MLA_TILE / CHUNK;
// bf16 rope values per rope work item of the cooperative path (one 16-byte store).
constexpr int ROPE_UNIT = 8;

// fp8_ds_mla work items of one token: lane-group path (nlanes >= 8) = latent chunks + rope
// units; otherwise one item per tile (the host) plus the rope.
KVW_HD int ds_mla_items(int L, int R) { return L / CHUNK + (R + ROPE_UNIT - 1) / ROPE_UNIT; }


struct StoreMLAParams {
  const char* kv_c = nullptr;
  const char* k_pe = nullptr;
  i64 c_sn = 0, pe_sn = 0;  // token strides in elements (features contiguous)
  int L = 0, R = 0;
  PagedCache cache;         // [pages, pool_page_size, 1, row]
  const float* scale = nullptr;   // MLA_FP8: per-tensor scale
  PagedCache scale_cache;         // MLA_NVFP4: e4m3 [pages, pool_page_size, 1, (L+R)/16]
  const float* global = nullptr;  // MLA_NVFP4: optional global scale
  DType in_dtype = DType::F32, cache_dtype = DType::F32;
  int mode = MLA_COPY;
  int ds_flags = 0;               // MLA_DS_MLA: DS_MLA_POW2 | DS_MLA_RAW_ROPE
  LocArgs locs;
};

// Copy unit for MLA_COPY: 16 bytes where both segments and every base/stride allow.
inline int store_mla_vec(const StoreMLAParams& p) {
  const i64 es = dtype_size(p.in_dtype);
  return vec_bytes(uint64_t(p.L * es) | uint64_t(p.R * es) | uint64_t(reinterpret_cast<uintptr_t>(p.kv_c)) |
                   uint64_t(reinterpret_cast<uintptr_t>(p.k_pe)) | uint64_t(p.c_sn * es) | uint64_t(p.pe_sn * es) |
                   uint64_t(reinterpret_cast<uintptr_t>(p.cache.base)) | uint64_t(p.cache.stride_page * es) |
                   uint64_t(p.cache.stride_entry * es));
}

// Work items of one token (what lanes stride over).
inline i64 store_mla_work(const StoreMLAParams& p, int vec) {
  if (p.mode == MLA_COPY) return i64(p.L + p.R) * dtype_size(p.in_dtype) / vec;
  if (p.mode == MLA_FP8) return p.L + p.R;
  if (p.mode == MLA_NVFP4) return (p.L + p.R) / NVFP4_BLOCK;
  return ds_mla_items(p.L, p.R);  // the cooperative path's items (a launch gives >= 8 lanes)
}

template <int VEC>
KVW_HD void mla_copy(const StoreMLAParams& p, i64 i, char* dst, int lane, int nlanes) {
  const int es = dtype_size(p.in_dtype);
#if !defined(__CUDA_ARCH__)
  if (nlanes == 1) {  // host: the two segments, one memcpy each
    memcpy(dst, p.kv_c + (i * p.c_sn) * es, size_t(p.L) * es);
    memcpy(dst + i64(p.L) * es, p.k_pe + (i * p.pe_sn) * es, size_t(p.R) * es);
    return;
  }
#endif
  const int uc = p.L * es / VEC, up = p.R * es / VEC;
  for (int u = lane; u < uc + up; u += nlanes) {
    const char* src = u < uc ? p.kv_c + (i * p.c_sn) * es + i64(u) * VEC
                             : p.k_pe + (i * p.pe_sn) * es + i64(u - uc) * VEC;
    copy_unit<VEC>(dst + i64(u) * VEC, src);
  }
}

template <DType IN, class F>
KVW_HD void mla_fp8(const StoreMLAParams& p, i64 i, char* dst, int lane, int nlanes) {
  const float s = p.scale[0];
#if KVW_SIMD_X86
  if (nlanes == 1 && simd_ok()) {  // host: the static scale's lanes, latent then rope
    Fp8Table* cache = static_fp8_tables<IN, F>();
    quant_run_static<IN, F>(p.kv_c, i * p.c_sn, p.L, s, dst, cache);
    quant_run_static<IN, F>(p.k_pe, i * p.pe_sn, p.R, s, dst + p.L, cache);
    return;
  }
#endif
  if (nlanes == 1) {  // host: two vectorisable loops
    quant_run<IN, F>(p.kv_c, i * p.c_sn, p.L, s, dst);
    quant_run<IN, F>(p.k_pe, i * p.pe_sn, p.R, s, dst + p.L);
    return;
  }
  for (int e = lane; e < p.L + p.R; e += nlanes) {
    const float x = e < p.L ? load_quant<IN>(p.kv_c, i * p.c_sn + e) : load_quant<IN>(p.k_pe, i * p.pe_sn + e - p.L);
    dst[e] = char(fp8_bits<F>(daz(x) / s));
  }
}

// The 16 bits stored for rope element e: the input's own bits (DS_MLA_RAW_ROPE, 16-bit inputs)
// or its bf16 rounding.
template <DType IN>
KVW_HD uint16_t ds_rope_bits(const StoreMLAParams& p, i64 e) {
  if constexpr (IN == DType::BF16 || IN == DType::F16) {
    if (p.ds_flags & DS_MLA_RAW_ROPE) return reinterpret_cast<const uint16_t*>(p.k_pe)[e];
  }
  return bf16_bits<IN>(p.k_pe, e);
}

KVW_HD float ds_tile_scale(const StoreMLAParams& p, float amax) {
  return (p.ds_flags & DS_MLA_POW2) ? ds_mla_scale_pow2(amax) : ds_mla_scale(amax);
}

template <DType IN>
KVW_HD void ds_rope_unit(const StoreMLAParams& p, i64 i, char* rope, int u) {
  const int r0 = u * ROPE_UNIT, n = p.R - r0 < ROPE_UNIT ? p.R - r0 : ROPE_UNIT;
  uint16_t b[ROPE_UNIT];
KVW_UNROLL
  for (int r = 0; r < ROPE_UNIT; ++r) b[r] = r < n ? ds_rope_bits<IN>(p, i * p.pe_sn + r0 + r) : 0;
#if defined(__CUDA_ARCH__)
  if (n == ROPE_UNIT && aligned16(rope + 2 * r0)) {
    *reinterpret_cast<uint4*>(rope + 2 * r0) =
        make_uint4(b[0] | uint32_t(b[1]) << 16, b[2] | uint32_t(b[3]) << 16, b[4] | uint32_t(b[5]) << 16,
                   b[6] | uint32_t(b[7]) << 16);
    return;
  }
#endif
  for (int r = 0; r < n; ++r) store_le(rope + 2 * (r0 + r), b[r], 2);
}

template <DType IN>
KVW_HD void mla_ds(const StoreMLAParams& p, i64 i, char* dst, int lane, int nlanes) {
  const int tiles = p.L / DS_MLA_TILE;
  char* scales = dst + p.L;
  char* rope = dst + p.L + 4 * tiles;
  if (nlanes >= DS_MLA_TILE_LANES) {
    // Warp-cooperative: 8 lanes per tile, CHUNK elements each; the tile amax by xor shuffles
    // within the 8-lane group (a whole group is always in the same loop iteration: nlanes and
    // the number of latent chunks are multiples of 8), then 16 e4m3 codes per lane.
    const int chunks = p.L / CHUNK;
    for (int w = lane; w < ds_mla_items(p.L, p.R); w += nlanes) {
      if (w < chunks) {
        float x[CHUNK];
        load_chunk<IN>(p.kv_c, i * p.c_sn + i64(w) * CHUNK, x);
        const float scale = ds_tile_scale(p, group_max(chunk_amax(x), DS_MLA_TILE_LANES));
        quant_chunk(x, scale, dst + i64(w) * CHUNK);
        if (w % DS_MLA_TILE_LANES == 0) store_le(scales + 4 * (w / DS_MLA_TILE_LANES), float_to_bits(scale), 4);
      } else {
        ds_rope_unit<IN>(p, i, rope, w - chunks);
      }
    }
    return;
  }
  // One lane per tile (the host: a tile is two vectorisable loops, amax then codes).
  bool done = false;
#if KVW_SIMD_X86
  if constexpr (IN == DType::BF16) {  // host: every tile's scale first (e4m3_tiles_bf16)
    float sc[16];
    const auto lanes = [&](auto plain) {  // plain: the ds_mla_scale rule (not DS_MLA_POW2)
      return e4m3_tiles_bf16<decltype(plain)::value>(p.kv_c, i * p.c_sn, tiles, DS_MLA_TILE,
                                                     [&](float a) { return ds_tile_scale(p, a); }, dst, sc);
    };
    const auto put = [&](int w, float s) { sc[w] = s; };
    const bool pow2 = p.ds_flags & DS_MLA_POW2;  // power-of-two scales: integer lanes (AVX-512) first
    if (nlanes == 1 && (pow2 ? e4m3_pow2_tiles(reinterpret_cast<const uint16_t*>(p.kv_c) + i * p.c_sn, tiles, DS_MLA_TILE,
                                               ds_mla_scale_pow2, dst, put) || lanes(std::false_type{})
                             : lanes(std::true_type{}))) {
      memcpy(scales, sc, sizeof(float) * size_t(tiles));  // little-endian fp32, as store_le
      done = true;
    }
  }
#endif
  for (int w = lane; w < tiles && !done; w += nlanes) {
    const i64 start = i * p.c_sn + i64(w) * DS_MLA_TILE;
    const float scale = ds_tile_scale(p, block_amax<IN>(p.kv_c, start, DS_MLA_TILE));
    quant_block_e4m3<IN>(p.kv_c, start, DS_MLA_TILE, scale, dst + w * DS_MLA_TILE);
    store_le(scales + 4 * w, float_to_bits(scale), 4);
  }
#if !defined(__CUDA_ARCH__)
  if ((IN == DType::BF16 || (IN == DType::F16 && (p.ds_flags & DS_MLA_RAW_ROPE))) && nlanes == 1) {
    memcpy(rope, p.k_pe + i * p.pe_sn * 2, size_t(p.R) * 2);
    return;
  }
#endif
  for (int r = lane; r < p.R; r += nlanes) store_le(rope + 2 * r, ds_rope_bits<IN>(p, i * p.pe_sn + r), 2);
}

template <DType IN>
KVW_HD void mla_nvfp4(const StoreMLAParams& p, i64 i, i64 row, char* dst, int lane, int nlanes) {
  char* scales = p.scale_cache.row_ptr(row);
#if !defined(__CUDA_ARCH__)
  if (nlanes == 1 && p.L % NVFP4_BLOCK == 0 && !p.scale_cache.split) {  // latent blocks, then rope blocks
#if KVW_SIMD_X86
    if constexpr (IN == DType::BF16) {
      if (p.global == nullptr && p.L == 512 && p.R == 64 && fp4_512_ok())  // DeepSeek's row: one call
        return nvfp4_mla_512(reinterpret_cast<const uint16_t*>(p.kv_c) + i * p.c_sn,
                             reinterpret_cast<const uint16_t*>(p.k_pe) + i * p.pe_sn, dst, scales);
    }
#endif
    nvfp4_run<IN>(p.kv_c, i * p.c_sn, p.L / NVFP4_BLOCK, p.global, dst, scales);
    if (p.R > 0)
      nvfp4_run<IN>(p.k_pe, i * p.pe_sn, p.R / NVFP4_BLOCK, p.global, dst + p.L / 2, scales + p.L / NVFP4_BLOCK);
    return;
  }
#endif
  for (int b = lane; b < (p.L + p.R) / NVFP4_BLOCK; b += nlanes) {
    const auto load = [&](int e) {
      const int c = b * NVFP4_BLOCK + e;
      return c < p.L ? load_float<IN>(p.kv_c, i * p.c_sn + c) : load_float<IN>(p.k_pe, i * p.pe_sn + c - p.L);
    };
    nvfp4_block(load, p.global, dst + b * (NVFP4_BLOCK / 2), scales + p.scale_cache.in_row(0, b));
  }
}

// MODE and the format: MLA_COPY (IN, OUT unused), MLA_FP8 (OUT = E4M3/E5M2), MLA_DS_MLA.
template <int CHECK, int MODE, DType IN, class OUT, int VEC>
KVW_HD void store_mla_token(const StoreMLAParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  char* dst = p.cache.row_ptr(r.row);
  if constexpr (MODE == MLA_COPY) {
    mla_copy<VEC>(p, i, dst, lane, nlanes);
  } else if constexpr (MODE == MLA_FP8) {
    mla_fp8<IN, OUT>(p, i, dst, lane, nlanes);
  } else if constexpr (MODE == MLA_DS_MLA) {
    mla_ds<IN>(p, i, dst, lane, nlanes);
  } else {
    mla_nvfp4<IN>(p, i, r.row, dst, lane, nlanes);
  }
}

template <int CHECK, int MODE, DType IN, class OUT, int VEC>
struct StoreMLAToken {
  static constexpr int check = CHECK;
  // (no write prefetch of a later token's row, unlike store_kv's: on Zen 5 it cost mla-nvfp4 16-20%
  // and fp8_ds_mla 7-9% at N = 1024 and 4096, bench/results/cpu-quant/NOTES.md)
  KVW_HD void operator()(const StoreMLAParams& p, i64 i, int lane, int nlanes) const {
    store_mla_token<CHECK, MODE, IN, OUT, VEC>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_mla(const StoreMLAParams& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    if (p.mode == MLA_COPY) {
      with_vec(store_mla_vec(p), [&](auto vec) {
        f(TypeTag<StoreMLAToken<c.value, MLA_COPY, DType::F32, void, vec.value>>{}, store_mla_work(p, vec.value));
      });
    } else if (p.mode == MLA_FP8) {
      with_float_dtype(p.in_dtype, [&](auto in) {
        with_fp8(p.cache_dtype, [&](auto fmt) {
          f(TypeTag<StoreMLAToken<c.value, MLA_FP8, in.value, typename decltype(fmt)::type, 1>>{}, store_mla_work(p, 1));
        });
      });
    } else if (p.mode == MLA_DS_MLA) {
      with_float_dtype(p.in_dtype, [&](auto in) {
        f(TypeTag<StoreMLAToken<c.value, MLA_DS_MLA, in.value, void, 1>>{}, store_mla_work(p, 1));
      });
    } else if (p.mode == MLA_NVFP4) {
      with_float_dtype(p.in_dtype, [&](auto in) {
        f(TypeTag<StoreMLAToken<c.value, MLA_NVFP4, in.value, void, 1>>{}, store_mla_work(p, 1));
      });
    } else {
      throw std::invalid_argument("kvwrite: unknown store_mla mode");
    }
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreMLAParams& p) {
  const i64 es = dtype_size(p.in_dtype);
  return i64(p.L + p.R) * (p.mode == MLA_COPY ? 2 * es : (es + 1) * QUANT_WEIGHT);
}
KVW_BODY(StoreMLAParams, dispatch_store_mla)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> StoreMLAParams and
// its op table row (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_MLA(X) \
  X(store_mla, reg::Bind<&store_mla_params>::table, \
    "(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor? scale, Tensor(b!)? scale_cache, Tensor? global_scale, " \
    "int kernel_mode, " KVW_TAIL ") -> ()")

namespace kvwrite {

inline StoreMLAParams store_mla_params(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache,
                                       const OptTensor& scale, const OptTensor& scale_cache,
                                       const OptTensor& global_scale, int64_t mode, const Tensor& loc,
                                       const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                       int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(kv_c.dim() == 2 && k_pe.dim() == 2 && k_pe.size(0) == kv_c.size(0) &&
                  k_pe.scalar_type() == kv_c.scalar_type(),
              "kvwrite: kv_c [N, L] and k_pe [N, R] must share tokens and dtype");
  TORCH_CHECK((kv_c.size(1) <= 1 || kv_c.stride(1) == 1) && (k_pe.size(1) <= 1 || k_pe.stride(1) == 1),
              "kvwrite: kv_c and k_pe must be contiguous in their last dim");
  check_same_device(kv_c, k_pe, "k_pe");
  check_same_device(kv_c, kv_cache, "kv_cache");
  StoreMLAParams p;
  p.kv_c = static_cast<const char*>(kv_c.data_ptr());
  p.k_pe = static_cast<const char*>(k_pe.data_ptr());
  p.c_sn = kv_c.stride(0);
  p.pe_sn = k_pe.stride(0);
  p.L = int(kv_c.size(1));
  p.R = int(k_pe.size(1));
  p.cache = paged_rows(kv_cache, "kv_cache");
  p.in_dtype = dtype_of(kv_c);
  p.cache_dtype = dtype_of(kv_cache);
  p.mode = int(mode) & MLA_MODE_MASK;
  p.ds_flags = p.mode == MLA_DS_MLA ? int(mode) & ~MLA_MODE_MASK : 0;
  TORCH_CHECK(!(p.ds_flags & DS_MLA_RAW_ROPE) || p.in_dtype == DType::BF16 || p.in_dtype == DType::F16,
              "kvwrite: fp8_ds_mla with the rope's own bits needs bf16/fp16 inputs");
  const int64_t width = p.mode == MLA_DS_MLA ? p.L + (p.L / DS_MLA_TILE) * 4 + 2 * p.R
                        : p.mode == MLA_NVFP4 ? (p.L + p.R) / 2 : p.L + p.R;
  TORCH_CHECK(kv_cache.size(2) == width, "kvwrite: kv_cache rows must be ", width, " wide for mode ", mode);
  if (p.mode == MLA_COPY) {
    TORCH_CHECK(p.cache_dtype == p.in_dtype, "kvwrite: kv_cache must have the input dtype");
  } else if (p.mode == MLA_FP8) {
    TORCH_CHECK(is_fp8(p.cache_dtype), "kvwrite: kv_cache must be fp8");
    TORCH_CHECK(scale.has_value() && scale->scalar_type() == at::kFloat && scale->numel() == 1,
                "kvwrite: fp8 store_mla needs a per-tensor fp32 scale");
    check_same_device(kv_c, *scale, "scale");
    p.scale = scale->data_ptr<float>();
  } else if (p.mode == MLA_NVFP4) {
    TORCH_CHECK(p.cache_dtype == DType::U8 && (p.L + p.R) % NVFP4_BLOCK == 0 && scale_cache.has_value() &&
                    scale_cache->scalar_type() == at::kFloat8_e4m3fn && scale_cache->dim() == 3 &&
                    scale_cache->size(0) == kv_cache.size(0) && scale_cache->size(1) == kv_cache.size(1) &&
                    scale_cache->size(2) * NVFP4_BLOCK == p.L + p.R,
                "kvwrite: nvfp4 store_mla needs a uint8 kv_cache [pages, rows, (L+R)/2] and an e4m3 "
                "scale_cache [pages, rows, (L+R)/16]");
    check_same_device(kv_c, *scale_cache, "scale_cache");
    p.scale_cache = paged_rows(*scale_cache, "scale_cache");
    if (global_scale.has_value()) {
      TORCH_CHECK(global_scale->scalar_type() == at::kFloat && global_scale->numel() == 1,
                  "kvwrite: global_scale must be fp32 [1]");
      check_same_device(kv_c, *global_scale, "global_scale");
      p.global = global_scale->data_ptr<float>();
    }
  } else {
    TORCH_CHECK(p.mode == MLA_DS_MLA && p.cache_dtype == DType::U8 && p.L % DS_MLA_TILE == 0,
                "kvwrite: fp8_ds_mla needs a uint8 kv_cache and L % 128 == 0");
  }
  p.locs = cache_locs(kv_c, kv_cache, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  return p;
}

}  // namespace kvwrite
#endif  // KVW_HOST
