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
  return p.L / DS_MLA_TILE + p.R;
}

template <int VEC>
KVW_HD void mla_copy(const StoreMLAParams& p, i64 i, char* dst, int lane, int nlanes) {
  const int es = dtype_size(p.in_dtype);
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
  for (int e = lane; e < p.L + p.R; e += nlanes) {
    const float x = e < p.L ? load_float<IN>(p.kv_c, i * p.c_sn + e) : load_float<IN>(p.k_pe, i * p.pe_sn + e - p.L);
    dst[e] = char(fp8_bits<F>(daz(x) / s));
  }
}

template <DType IN>
KVW_HD void mla_ds(const StoreMLAParams& p, i64 i, char* dst, int lane, int nlanes) {
  const int tiles = p.L / DS_MLA_TILE;
  for (int w = lane; w < tiles + p.R; w += nlanes) {
    if (w < tiles) {  // one latent tile: its scale, then its 128 e4m3 codes
      const i64 start = i * p.c_sn + i64(w) * DS_MLA_TILE;
      const float scale = ds_mla_scale(block_amax<IN>(p.kv_c, start, DS_MLA_TILE));
      quant_block_e4m3<IN>(p.kv_c, start, DS_MLA_TILE, scale, dst + w * DS_MLA_TILE);
      store_le(dst + p.L + 4 * w, float_to_bits(scale), 4);
    } else {  // one bf16 rope value
      const int r = w - tiles;
      store_le(dst + p.L + 4 * tiles + 2 * r, bf16_bits<IN>(p.k_pe, i * p.pe_sn + r), 2);
    }
  }
}

template <DType IN>
KVW_HD void mla_nvfp4(const StoreMLAParams& p, i64 i, i64 row, char* dst, int lane, int nlanes) {
  char* scales = p.scale_cache.row_ptr(row);
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

}  // namespace kvwrite
