// Host-side parameter builder of store_kv's int4 format (kvwrite/kv_int4.h): torch tensors to
// the plain params the CPU and CUDA kernels take. Shapes were checked by the op's spec; these
// checks guard the raw kernel against a direct call.
#pragma once

#include "params.h"

namespace kvwrite {

// One side: rows x [n, H, D], uint8 codes [pages, rows, H, D / 2], fp32 scales [pages, rows, H].
inline Int4Side int4_side(const Tensor& x, const Tensor& cache, const Tensor& scales, const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "kvwrite: ", name,
              " rows must be [tokens, heads, dim], contiguous in dim");
  const int64_t d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= INT4_MAX_DIM, "kvwrite: ", name, " head dim must be even and at most ",
              INT4_MAX_DIM);
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.size(2) == x.size(1) &&
                  cache.size(3) == d / 2,
              "kvwrite: ", name, " must be a uint8 [pages, rows, heads, dim / 2] cache");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == cache.size(0) &&
                  scales.size(1) == cache.size(1) && scales.size(2) == x.size(1),
              "kvwrite: ", name, " scale cache must be fp32 [pages, rows, heads]");
  check_same_device(x, cache, "cache");
  check_same_device(x, scales, "scale cache");
  Int4Side s = source_rows<Int4Side>(x);
  s.cache = paged(cache, name);
  s.scales = paged(scales.unsqueeze(-1), name);
  return s;
}

inline StoreKVInt4Params store_kv_int4_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                              const Tensor& v_cache, const Tensor& k_scale_cache,
                                              const Tensor& v_scale_cache, const Tensor& loc,
                                              const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                              int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "kvwrite: k and v must share a dtype");
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1),
              "kvwrite: k/v and their caches must agree on tokens, heads, pages and rows");
  StoreKVInt4Params p;
  p.in_dtype = dtype_of(k);
  p.k = int4_side(k, k_cache, k_scale_cache, "k_cache");
  p.v = int4_side(v, v_cache, v_scale_cache, "v_cache");
  p.H = int(k.size(1));
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, k_cache.size(0) * k_cache.size(1),
                    k_cache.size(1), k);
  TORCH_CHECK(p.locs.n == k.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

}  // namespace kvwrite
