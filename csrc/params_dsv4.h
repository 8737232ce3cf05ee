// Tensors -> DeepSeek V4 kernel parameters (host only, torch); shared by ops.cpp (CPU) and
// cuda_ops.cpp. kvwrite.ops.dsv4 validated every argument already; these checks guard direct
// callers. Every V4 store shards whole pages under DCP (LocArgs::dcp_page).
#pragma once

#include <variant>

#include "params.h"
#include "params_rope.h"

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

inline StoreDSV4FP4Params store_dsv4_fp4_params(const Tensor& kv, const Tensor& cache, int64_t pool_page_size,
                                                int64_t fmt, const Tensor& loc, const OptTensor& loc_map,
                                                const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                                int64_t check, int64_t op) {
  TORCH_CHECK(kv.dim() == 2 && kv.size(1) == DSV4_NOPE + DSV4_ROPE && kv.stride(1) == 1,
              "kvwrite: kv must be [N, 512], contiguous in its last dim");
  TORCH_CHECK(fmt >= 0 && fmt <= 2, "kvwrite: fmt must be 0 (nvfp4), 1 (nvfp4_v41) or 2 (mxfp4)");
  TORCH_CHECK(pool_page_size >= 1 && cache.dim() == 2 && cache.size(1) == pool_page_size * fp4_token_bytes(int(fmt)),
              "kvwrite: the FP4 record page does not hold pool_page_size tokens");
  check_same_device(kv, cache, "cache");
  const int token = fp4_token_bytes(int(fmt)), scale_row = fmt == 2 ? 0 : 32;
  StoreDSV4FP4Params p;
  p.kv = static_cast<const char*>(kv.data_ptr());
  p.kv_sn = kv.stride(0);
  p.in_dtype = dtype_of(kv);
  p.fmt = int(fmt);
  paged_locs(p, kv, cache, pool_page_size, token - scale_row, scale_row, loc, loc_map, errors, dcp_rank, dcp_size,
             check, op);
  return p;
}

// rope_store_dsv4_kv_fp4: the store's parameters plus the GPT-J rotation of the 64 RoPE values
// (cos_sin [max_position, 64]) and of q [n, Hq, 64] in place (none: zero heads).
inline RopeStoreDSV4FP4Params rope_store_dsv4_fp4_params(const Tensor& positions, const Tensor& kv, const Tensor& cos_sin,
                                                     const OptTensor& q, const Tensor& cache, int64_t pool_page_size,
                                                     int64_t fmt, const Tensor& loc, const OptTensor& loc_map,
                                                     const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                                     int64_t check, int64_t op) {
  TORCH_CHECK(fmt == 0 || fmt == 2, "kvwrite: the fused RoPE store takes fmt 0 (nvfp4) or 2 (mxfp4)");
  RopeStoreDSV4FP4Params p{
      store_dsv4_fp4_params(kv, cache, pool_page_size, fmt, loc, loc_map, errors, dcp_rank, dcp_size, check, op)};
  const Tensor qt = q.has_value() ? *q : kv.new_empty({kv.size(0), 0, DSV4_ROPE});
  p.rope = rope_args(positions, qt, cos_sin, c10::nullopt, c10::nullopt, 0.0, false, kv, DSV4_ROPE);
  TORCH_CHECK(p.rope.R == DSV4_ROPE, "kvwrite: cos_sin must be [max_position, 64]");
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

// The V4 stores take locs only: no page-table addressing.
inline void kvw_dsv4_table(LocArgs&, const OptTensor& batch_indices, const OptTensor& kv_indices,
                           const OptTensor& kv_indptr) {
  TORCH_CHECK(!batch_indices.has_value() && !kv_indices.has_value() && !kv_indptr.has_value(),
              "kvwrite: the DeepSeek V4 stores take no page table");
}

}  // namespace kvwrite
