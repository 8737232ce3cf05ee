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

// A V4 record's RoPE part: n values from src + start as bf16 at dst (host, bf16: the bits as they
// are, one copy; else rounded element by element).
template <DType IN>
KVW_HD void dsv4_rope_part(const void* src, i64 start, int n, char* dst) {
#if !defined(__CUDA_ARCH__)
  if constexpr (IN == DType::BF16) {
    memcpy(dst, static_cast<const uint16_t*>(src) + start, 2 * size_t(n));
    return;
  }
#endif
  for (int j = 0; j < n; ++j) store_le(dst + 2 * j, bf16_bits<IN>(src, start + j), 2);
}

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
  bool tiles_done = false;
#if KVW_SIMD_X86
  if constexpr (IN == DType::BF16) {  // host: every tile's scale first (e4m3_tiles_bf16)
    float sc[16];
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p.kv) + i * p.kv_sn;
    char* scales = p.cache.scale_at(r.row);
    const auto scale_of = [](float a) { return dsv4_scale(a, 448.0f); };
    if (nlanes == 1 && e4m3_pow2_tiles(x, DSV4_TILES, DSV4_TILE, scale_of, data,  // AVX-512: integer lanes
                                       [&](int w, float s) { scales[w] = ue8m0_byte(s); })) {
      tiles_done = true;
    } else if (nlanes == 1 && e4m3_tiles_bf16(p.kv, i * p.kv_sn, DSV4_TILES, DSV4_TILE, scale_of, data, sc)) {
      for (int w = 0; w < DSV4_TILES; ++w) scales[w] = ue8m0_byte(sc[w]);
      tiles_done = true;
    }
  }
#endif
  for (int w = lane; w <= DSV4_TILES; w += nlanes) {
    const i64 start = i * p.kv_sn + i64(w) * DSV4_TILE;
    if (w < DSV4_TILES && tiles_done) continue;
    if (w < DSV4_TILES) {
      const float scale = dsv4_scale(block_amax<IN>(p.kv, start, DSV4_TILE), 448.0f);
      quant_block_e4m3<IN>(p.kv, start, DSV4_TILE, scale, data + w * DSV4_TILE);
      p.cache.scale_at(r.row)[w] = ue8m0_byte(scale);  // byte 7 (pad) is never written
    } else {
      dsv4_rope_part<IN>(p.kv, start, DSV4_ROPE, data + DSV4_NOPE);
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

// Block b of token i into pool row `row`.
template <DType IN>
KVW_HD void store_mxfp4_block(const StoreMXFP4Params& p, i64 i, i64 row, int b) {
  const i64 start = i * p.k_sn + i64(b) * DSV4_MXFP4_BLOCK;
  const float s = dsv4_scale(block_amax<IN>(p.k, start, DSV4_MXFP4_BLOCK), 6.0f);
  char* bytes = p.cache.data_at(row) + b * (DSV4_MXFP4_BLOCK / 2);
  // special values (README): NaN -> code 0 and the block's scale byte 0xFF
  const bool nan = e2m1_run<IN>(p.k, start, DSV4_MXFP4_BLOCK, s, bytes);
  p.cache.scale_at(row)[b] = nan ? char(0xFF) : ue8m0_byte(s);
}

// Token i: lanes stride over its 32-value blocks (host, bf16: the AVX-512 lanes eight blocks at a
// time, the blocks they leave by store_mxfp4_block).
template <int CHECK, DType IN>
KVW_HD void store_mxfp4_token(const StoreMXFP4Params& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
#if !defined(__CUDA_ARCH__) && KVW_SIMD_X86
  uint64_t left = 0;
  if (IN == DType::BF16 && nlanes == 1 && p.D <= 64 * DSV4_MXFP4_BLOCK &&
      mxfp4_ceil_run_bf16(reinterpret_cast<const uint16_t*>(p.k) + i * p.k_sn, p.D / DSV4_MXFP4_BLOCK,
                          p.cache.data_at(r.row), p.cache.scale_at(r.row), left)) {
    for (; left != 0; left &= left - 1) store_mxfp4_block<IN>(p, i, r.row, __builtin_ctzll(left));
    return;
  }
#endif
  for (int b = lane; b < p.D / DSV4_MXFP4_BLOCK; b += nlanes) store_mxfp4_block<IN>(p, i, r.row, b);
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
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreDSV4KVParams& p) {
  return i64(DSV4_NOPE + DSV4_ROPE) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
inline i64 token_bytes(const StoreMXFP4Params& p) { return i64(p.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT; }
inline i64 token_bytes(const StoreRowsParams& p) { return 2 * p.row_bytes; }
KVW_BODY(StoreDSV4KVParams, dispatch_store_dsv4_kv)
KVW_BODY(StoreMXFP4Params, dispatch_store_mxfp4)
KVW_BODY(StoreRowsParams, dispatch_store_rows)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> the DeepSeek V4
// stores' params (each shards whole pages under DCP: LocArgs::dcp_page) and their op table rows
// (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_DSV4(X) \
  X(store_dsv4_kv, reg::Bind<&store_dsv4_kv_params>::no_table, \
    "(Tensor kv, Tensor(a!) cache, int pool_page_size, " KVW_TAIL ") -> ()") \
  X(store_dsv4_indexer_k, reg::Bind<&store_dsv4_indexer_k_params>::no_table, \
    "(Tensor k, Tensor(a!) cache, int pool_page_size, int fmt_code, bool ue8m0, " KVW_TAIL ") -> ()") \
  X(store_rows, reg::Bind<&store_rows_params>::no_table, "(Tensor src, Tensor(a!) pool, " KVW_TAIL ") -> ()")

namespace kvwrite {

inline SplitPage split_page(const Tensor& cache, int64_t pool_page_size, int data_row, int scale_row,
                            const char* name) {
  TORCH_CHECK(cache.dim() == 2 && cache.scalar_type() == at::kByte && (cache.size(1) <= 1 || cache.stride(1) == 1),
              "kvwrite: ", name, " must be a uint8 [pages, page bytes] tensor");
  TORCH_CHECK(pool_page_size >= 1 && pool_page_size * (data_row + scale_row) <= cache.size(1), "kvwrite: ", name,
              " pages are too small for ", pool_page_size, " rows");
  SplitPage s;
  s.base = static_cast<char*>(cache.data_ptr());
  s.stride_page = cache.stride(0);
  s.pool_page_size = pool_page_size;
  s.data_row = data_row;
  s.scale_row = scale_row;
  return s;
}

// What every paged V4 store shares: `p.cache` split into pages of `data_row` + `scale_row` bytes a
// token, `p.locs` sharding whole pages under DCP, one loc per row of `src`.
template <class P>
inline void paged_locs(P& p, const Tensor& src, const Tensor& cache, int64_t pool_page_size, int data_row,
                       int scale_row, const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                       int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  p.cache = split_page(cache, pool_page_size, data_row, scale_row, "cache");
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, cache.size(0) * pool_page_size,
                    pool_page_size, src);
  p.locs.dcp_page = true;
  TORCH_CHECK(p.locs.n == src.size(0), "kvwrite: loc must have one entry per token");
}

inline StoreDSV4KVParams store_dsv4_kv_params(const Tensor& kv, const Tensor& cache, int64_t pool_page_size,
                                              const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                                              int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == DSV4_NOPE + DSV4_ROPE && kv.stride(1) == 1,
              "kvwrite: kv must be [N, 512], contiguous in its last dim");
  TORCH_CHECK(pool_page_size >= 1 && cache.dim() == 2 &&
                  cache.size(1) == ceil_div(pool_page_size * (DSV4_DATA_ROW + DSV4_SCALE_ROW), DSV4_DATA_ROW) * DSV4_DATA_ROW,
              "kvwrite: the DeepSeek V4 cache page does not hold pool_page_size tokens");
  check_same_device(kv, cache, "cache");
  StoreDSV4KVParams p;
  p.kv = static_cast<const char*>(kv.data_ptr());
  p.kv_sn = kv.stride(0);
  p.in_dtype = dtype_of(kv);
  paged_locs(p, kv, cache, pool_page_size, DSV4_DATA_ROW, DSV4_SCALE_ROW, loc, loc_map, errors, dcp_rank, dcp_size,
             check, op);
  return p;
}

inline StoreMXFP4Params store_mxfp4_params(const Tensor& k, const Tensor& cache, int64_t pool_page_size,
                                           const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                                           int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(k.dim() == 2 && k.size(1) > 0 && k.size(1) % DSV4_MXFP4_BLOCK == 0 && k.stride(1) == 1,
              "kvwrite: index_k must be [N, D], D a multiple of 32, contiguous in D");
  const int d = int(k.size(1));
  TORCH_CHECK(cache.dim() == 2 && cache.size(1) == pool_page_size * (d / 2 + d / DSV4_MXFP4_BLOCK),
              "kvwrite: the mxfp4 indexer page does not hold pool_page_size rows");
  check_same_device(k, cache, "cache");
  StoreMXFP4Params p;
  p.k = static_cast<const char*>(k.data_ptr());
  p.k_sn = k.stride(0);
  p.D = d;
  p.in_dtype = dtype_of(k);
  paged_locs(p, k, cache, pool_page_size, d / 2, d / DSV4_MXFP4_BLOCK, loc, loc_map, errors, dcp_rank, dcp_size,
             check, op);
  return p;
}

inline StoreRowsParams store_rows_params(const Tensor& src, const Tensor& pool, const Tensor& loc,
                                         const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                         int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(src.dim() == 2 && pool.dim() == 2 && src.size(1) == pool.size(1) &&
                  src.scalar_type() == pool.scalar_type() && (src.size(1) <= 1 || (src.stride(1) == 1 && pool.stride(1) == 1)),
              "kvwrite: src [N, W] and pool [rows, W] must share W and dtype, contiguous in W");
  check_same_device(src, pool, "pool");
  StoreRowsParams p;
  const int64_t elem = src.element_size();
  p.src = static_cast<const char*>(src.data_ptr());
  p.pool = static_cast<char*>(pool.data_ptr());
  p.src_sn = src.stride(0) * elem;
  p.pool_sr = pool.stride(0) * elem;
  p.row_bytes = src.size(1) * elem;
  p.vec = vec_bytes(uint64_t(reinterpret_cast<uintptr_t>(p.src)) | uint64_t(reinterpret_cast<uintptr_t>(p.pool)) |
                    uint64_t(p.src_sn) | uint64_t(p.pool_sr) | uint64_t(p.row_bytes));
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, pool.size(0), 1, pool);
  p.locs.dcp_page = true;
  TORCH_CHECK(p.locs.n == src.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

// store_dsv4_indexer_k: fmt 0, fp8 rows (store_indexer_k's body, 128-value blocks, whole pages
// under DCP); 1: mxfp4 rows.
inline std::variant<StoreIndexerKParams, StoreMXFP4Params> store_dsv4_indexer_k_params(
    const Tensor& k, const Tensor& cache, int64_t pool_page_size, int64_t fmt, bool ue8m0, const Tensor& loc,
    const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  if (fmt == 0) {
    StoreIndexerKParams p =
        store_indexer_k_params(k, cache, 128, ue8m0, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
    p.locs.dcp_page = true;
    return p;
  }
  return store_mxfp4_params(k, cache, pool_page_size, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
}

}  // namespace kvwrite
#endif  // KVW_HOST
