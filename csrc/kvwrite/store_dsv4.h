// DeepSeek V4 stores (formats in kvwrite/ops/dsv4.py): FlashMLA MODEL1 KV pages (per page: the
// 576-byte data rows of its tokens, then their 8-byte scale rows, then padding to a multiple of
// 576), MXFP4 indexer rows (page-major: D/2 packed e2m1 bytes per row, then D/32 ue8m0 bytes per
// row) and compress-state row copies. The fp8 indexer rows are store_indexer_k.h's.
#pragma once

#include "dispatch.h"
#include "locs.h"
#include "nvfp4.h"
#include "paged.h"
#include "quant.h"
#include "store_indexer_k.h"

namespace kvwrite {

constexpr int DSV4_NOPE = 448, DSV4_ROPE = 64, DSV4_TILE = 64, DSV4_TILES = 7;
constexpr int DSV4_DATA_ROW = 576, DSV4_SCALE_ROW = 8, DSV4_MXFP4_BLOCK = 32;
constexpr float DSV4_AMAX_FLOOR = 1e-4f;

// max(amax, 1e-4) / fmax rounded up to a power of two (ue8m0), and its stored byte.
KVW_HD float dsv4_scale(float amax, float fmax) {
  return ue8m0_ceil((amax < DSV4_AMAX_FLOOR ? DSV4_AMAX_FLOOR : amax) / fmax);
}
KVW_HD char ue8m0_byte(float pow2) { return char((float_to_bits(pow2) >> 23) & 0xFF); }

// A uint8 [pages, stride_page] cache whose pages hold pool_page_size data rows, then their
// scale rows: the only address arithmetic of these stores (int64).
struct SplitPage {
  char* base = nullptr;
  i64 stride_page = 0, pool_page_size = 1;
  int data_row = 0, scale_row = 0;

  KVW_HD char* data_at(i64 row) const {
    const i64 page = row / pool_page_size;
    return base + page * stride_page + (row - page * pool_page_size) * data_row;
  }
  KVW_HD char* scale_at(i64 row) const {
    const i64 page = row / pool_page_size;
    return base + page * stride_page + pool_page_size * data_row + (row - page * pool_page_size) * scale_row;
  }
};

struct StoreDSV4KVParams {
  const char* kv = nullptr;
  i64 kv_sn = 0;  // token stride in elements
  DType in_dtype = DType::F32;
  SplitPage cache;
  LocArgs locs;
};

// Token i: lanes stride over its 8 work items (7 NoPE tiles, the RoPE part).
template <int CHECK, DType IN>
KVW_HD void store_dsv4_kv_token(const StoreDSV4KVParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  char* data = p.cache.data_at(r.row);
  const int noftz = nlanes == 1 ? host_noftz() : -1;
  bool tiles_done = false;
#if KVW_SIMD_X86
  if constexpr (IN == DType::BF16) {  // host: every tile's scale first (e4m3_tiles_bf16)
    float sc[16];
    if (nlanes == 1 && e4m3_tiles_bf16(p.kv, i * p.kv_sn, DSV4_TILES, DSV4_TILE, [](float a) { return dsv4_scale(a, 448.0f); },
                                       data, sc, noftz)) {
      for (int w = 0; w < DSV4_TILES; ++w) p.cache.scale_at(r.row)[w] = ue8m0_byte(sc[w]);
      tiles_done = true;
    }
  }
#endif
  for (int w = lane; w <= DSV4_TILES; w += nlanes) {
    const i64 start = i * p.kv_sn + i64(w) * DSV4_TILE;
    if (w < DSV4_TILES && tiles_done) continue;
    if (w < DSV4_TILES) {
      const float scale = dsv4_scale(block_amax<IN>(p.kv, start, DSV4_TILE), 448.0f);
      quant_block_e4m3<IN>(p.kv, start, DSV4_TILE, scale, data + w * DSV4_TILE, noftz);
      p.cache.scale_at(r.row)[w] = ue8m0_byte(scale);  // byte 7 (pad) is never written
    } else {
      for (int j = 0; j < DSV4_ROPE; ++j) store_le(data + DSV4_NOPE + 2 * j, bf16_bits<IN>(p.kv, start + j), 2);
    }
  }
}

template <int CHECK, DType IN>
struct StoreDSV4KVToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreDSV4KVParams& p, i64 i, int lane, int nlanes) const {
    store_dsv4_kv_token<CHECK, IN>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_dsv4_kv(const StoreDSV4KVParams& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) { f(TypeTag<StoreDSV4KVToken<c.value, in.value>>{}, DSV4_TILES + 1); });
  });
}

struct StoreMXFP4Params {
  const char* k = nullptr;
  i64 k_sn = 0;
  int D = 0;
  DType in_dtype = DType::F32;
  SplitPage cache;
  LocArgs locs;
};

// Token i: lanes stride over its 32-value blocks.
template <int CHECK, DType IN>
KVW_HD void store_mxfp4_token(const StoreMXFP4Params& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  for (int b = lane; b < p.D / DSV4_MXFP4_BLOCK; b += nlanes) {
    const i64 start = i * p.k_sn + i64(b) * DSV4_MXFP4_BLOCK;
    const float s = dsv4_scale(block_amax<IN>(p.k, start, DSV4_MXFP4_BLOCK), 6.0f);
    char* bytes = p.cache.data_at(r.row) + b * (DSV4_MXFP4_BLOCK / 2);
    // special values (README): NaN -> code 0 and the block's scale byte 0xFF
    const bool nan = e2m1_run<IN>(p.k, start, DSV4_MXFP4_BLOCK, s, bytes);
    p.cache.scale_at(r.row)[b] = nan ? char(0xFF) : ue8m0_byte(s);
  }
}

template <int CHECK, DType IN>
struct StoreMXFP4Token {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreMXFP4Params& p, i64 i, int lane, int nlanes) const {
    store_mxfp4_token<CHECK, IN>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_mxfp4(const StoreMXFP4Params& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) {
      f(TypeTag<StoreMXFP4Token<c.value, in.value>>{}, p.D / DSV4_MXFP4_BLOCK);
    });
  });
}

// store_rows: a row of `row_bytes` bytes copied from src into pool row loc (pages of one row).
struct StoreRowsParams {
  const char* src = nullptr;
  char* pool = nullptr;
  i64 src_sn = 0, pool_sr = 0;  // row strides in bytes
  i64 row_bytes = 0;
  int vec = 1;                  // bytes per copy unit (divides strides, bases and row_bytes)
  LocArgs locs;
};

template <int CHECK, int VEC>
KVW_HD void store_rows_token(const StoreRowsParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  const char* s = p.src + i * p.src_sn;
  char* d = p.pool + r.row * p.pool_sr;
  for (i64 u = lane; u < p.row_bytes / VEC; u += nlanes) copy_unit<VEC>(d + u * VEC, s + u * VEC);
}

template <int CHECK, int VEC>
struct StoreRowsToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreRowsParams& p, i64 i, int lane, int nlanes) const {
    store_rows_token<CHECK, VEC>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_rows(const StoreRowsParams& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_vec(p.vec, [&](auto v) { f(TypeTag<StoreRowsToken<c.value, v.value>>{}, p.row_bytes / v.value); });
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives one CUDA unit per line).
inline i64 token_bytes(const StoreDSV4KVParams& p) {
  return i64(DSV4_NOPE + DSV4_ROPE) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
inline i64 token_bytes(const StoreMXFP4Params& p) { return i64(p.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT; }
inline i64 token_bytes(const StoreRowsParams& p) { return 2 * p.row_bytes; }
KVW_BODY(StoreDSV4KVParams, dispatch_store_dsv4_kv)
KVW_BODY(StoreMXFP4Params, dispatch_store_mxfp4)
KVW_BODY(StoreRowsParams, dispatch_store_rows)

}  // namespace kvwrite
