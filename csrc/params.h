// Tensors -> kernel parameter structs (host only, torch). Shared by the CPU kernels (ops.cpp)
// and the CUDA registration (cuda_ops.cpp). The Python layer (kvwrite.ops.*) has already
// validated every argument with named errors; the checks here only guard direct callers.
#pragma once

#include <optional>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "bodies.h"  // every body header: its params type

namespace kvwrite {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

inline DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::F32;
    case at::kHalf: return DType::F16;
    case at::kBFloat16: return DType::BF16;
    case at::kByte: return DType::U8;
    case at::kFloat8_e4m3fn: return DType::E4M3;
    case at::kFloat8_e5m2: return DType::E5M2;
    case at::kFloat8_e4m3fnuz: return DType::E4M3FNUZ;
    default: TORCH_CHECK(false, "kvwrite: unsupported dtype ", t.scalar_type());
  }
}

inline bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2 || t == DType::E4M3FNUZ; }

inline void check_same_device(const Tensor& ref, const Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "kvwrite: ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device());
}

// A side's source rows x [tokens, heads, D] (D contiguous): the fields every *Side shares.
template <class Side>
Side source_rows(const Tensor& x) {
  Side s;
  s.src = static_cast<const char*>(x.data_ptr());
  s.s_tok = x.stride(0);
  s.s_head = x.stride(1);
  s.D = int(x.size(2));
  return s;
}

// A canonical [pages, pool_page_size, heads, feat] cache view (feat contiguous), or
// [pages, pool_page_size, heads, feat / X, X] (a split head dim, X contiguous).
inline PagedCache paged(const Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4 || c.dim() == 5, "kvwrite: ", name, " must be a 4-D [pages, rows, heads, feat] view");
  TORCH_CHECK(c.size(c.dim() - 1) <= 1 || c.stride(c.dim() - 1) == 1, "kvwrite: ", name,
              " must be contiguous in its last dim");
  PagedCache p;
  if (c.dim() == 5) {
    p.split = int(c.size(4));
    p.stride_split = c.stride(3);
  }
  p.base = static_cast<char*>(c.data_ptr());
  p.stride_page = c.stride(0);
  p.stride_entry = c.stride(1);
  p.stride_head = c.stride(2);
  p.pool_page_size = c.size(1);
  p.elem_size = int(c.element_size());
  return p;
}

// A [pages, pool_page_size, row] cache (one head).
inline PagedCache paged_rows(const Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 3, "kvwrite: ", name, " must be a 3-D [pages, rows, row] tensor");
  return paged(c.unsqueeze(2), name);
}

inline LocArgs loc_args(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                        int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
                        int64_t capacity, int64_t pool_page_size, const Tensor& ref) {
  TORCH_CHECK(loc.dim() == 1 && (loc.scalar_type() == at::kInt || loc.scalar_type() == at::kLong),
              "kvwrite: loc must be a 1-D int32/int64 tensor");
  TORCH_CHECK(loc.numel() <= 1 || loc.stride(0) == 1, "kvwrite: loc must be contiguous");
  TORCH_CHECK(dcp_size >= 1 && 0 <= dcp_rank && dcp_rank < dcp_size, "kvwrite: bad dcp_rank/dcp_size");
  TORCH_CHECK(0 <= check && check <= 2, "kvwrite: check must be 0, 1 or 2");
  check_same_device(ref, loc, "loc");
  LocArgs a;
  a.loc = loc.data_ptr();
  a.loc64 = loc.scalar_type() == at::kLong;
  a.n = loc.size(0);
  if (loc_map.has_value()) {
    const Tensor& m = *loc_map;
    TORCH_CHECK(m.dim() == 1 && (m.scalar_type() == at::kInt || m.scalar_type() == at::kLong) &&
                    (m.numel() <= 1 || m.stride(0) == 1),
                "kvwrite: loc_map must be a contiguous 1-D int32/int64 tensor");
    check_same_device(ref, m, "loc_map");
    a.loc_map = m.data_ptr();
    a.map64 = m.scalar_type() == at::kLong;
    a.map_len = m.size(0);
  }
  if (errors.has_value()) {
    const Tensor& e = *errors;
    TORCH_CHECK(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == slot::NUM_SLOTS && e.is_contiguous(),
                "kvwrite: errors must be a contiguous int64[16] ErrorBuffer tensor");
    check_same_device(ref, e, "errors");
    a.errors = e.data_ptr<int64_t>();
  }
  TORCH_CHECK(check != CHECK_GUARD || a.errors != nullptr, "kvwrite: check=guard needs an errors buffer");
  a.dcp_rank = dcp_rank;
  a.dcp_size = dcp_size;
  a.capacity = capacity;
  a.pool_page_size = pool_page_size;
  a.op = int(op);
  return a;
}

// Page-table addressing (kvwrite.PageTable): `a.loc` already holds the positions.
inline void set_table(LocArgs& a, const OptTensor& batch_indices, const OptTensor& kv_indices,
                      const OptTensor& kv_indptr, const Tensor& ref) {
  if (!batch_indices.has_value()) {
    TORCH_CHECK(!kv_indices.has_value() && !kv_indptr.has_value(),
                "kvwrite: kv_indices/kv_indptr need batch_indices");
    return;
  }
  TORCH_CHECK(kv_indices.has_value() && kv_indptr.has_value(),
              "kvwrite: page-table addressing needs batch_indices, kv_indices and kv_indptr");
  TORCH_CHECK(a.loc_map == nullptr && a.dcp_size == 1, "kvwrite: a page table does not combine with loc_map or DCP");
  const Tensor* ts[] = {&*batch_indices, &*kv_indices, &*kv_indptr};
  const char* names[] = {"batch_indices", "kv_indices", "kv_indptr"};
  for (int j = 0; j < 3; ++j) {
    const Tensor& t = *ts[j];
    TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) &&
                    (t.numel() <= 1 || t.stride(0) == 1),
                "kvwrite: ", names[j], " must be a contiguous 1-D int32/int64 tensor");
    check_same_device(ref, t, names[j]);
  }
  TORCH_CHECK(batch_indices->size(0) == a.n, "kvwrite: batch_indices must have one entry per token");
  TORCH_CHECK(kv_indptr->size(0) >= 1, "kvwrite: kv_indptr must have batch_size + 1 >= 1 entries");
  a.batch = batch_indices->data_ptr();
  a.batch64 = batch_indices->scalar_type() == at::kLong;
  a.table = kv_indices->data_ptr();
  a.table64 = kv_indices->scalar_type() == at::kLong;
  a.n_table = kv_indices->size(0);
  a.indptr = kv_indptr->data_ptr();
  a.indptr64 = kv_indptr->scalar_type() == at::kLong;
  a.n_batch = kv_indptr->size(0) - 1;
}

// claim_rows' addressing on either device (the duplicate-row pre-pass, kvwrite/claims.h).
inline LocArgs claim_locs(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                          int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                          const OptTensor& kv_indices, const OptTensor& kv_indptr, int64_t capacity,
                          int64_t pool_page_size, bool dcp_page) {
  TORCH_CHECK(check == CHECK_ASSERT || check == CHECK_GUARD, "kvwrite: claim_rows runs in assert or guard mode");
  TORCH_CHECK(capacity >= 1 && pool_page_size >= 1, "kvwrite: claim_rows needs a pool");
  LocArgs a = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, capacity, pool_page_size, loc);
  set_table(a, batch_indices, kv_indices, kv_indptr, loc);
  a.dcp_page = dcp_page;
  return a;
}

inline KVSide kv_side(const Tensor& x, const Tensor& cache, const OptTensor& scale, const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "kvwrite: ", name,
              " must be [tokens, heads, dim], contiguous in dim");
  const int64_t feat = cache.dim() == 5 ? cache.size(3) * cache.size(4) : cache.size(3);
  TORCH_CHECK(cache.size(2) == x.size(1) && feat == x.size(2), "kvwrite: ", name,
              " cache shape does not match its rows");
  check_same_device(x, cache, "cache");
  KVSide s = source_rows<KVSide>(x);
  s.cache = paged(cache, name);
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() >= 1, "kvwrite: ", name, " scale must be fp32");
    check_same_device(x, *scale, "scale");
    s.scale = scale->data_ptr<float>();
    s.scale_stride = scale->numel() > 1 ? 1 : 0;
  }
  return s;
}

inline StoreKVParams store_kv_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                     const Tensor& v_cache, const OptTensor& k_scale,
                                     const OptTensor& v_scale, const Tensor& loc,
                                     const OptTensor& loc_map, const OptTensor& errors,
                                     int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  StoreKVParams p;
  p.in_dtype = dtype_of(k);
  p.cache_dtype = dtype_of(k_cache);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "kvwrite: k/v and k_cache/v_cache must share dtypes");
  const bool quant = is_fp8(p.cache_dtype);
  TORCH_CHECK(quant ? (k_scale.has_value() && v_scale.has_value()) : p.cache_dtype == p.in_dtype,
              "kvwrite: the cache dtype must equal the input dtype, or be fp8 with k_scale/v_scale");
  p.k = kv_side(k, k_cache, quant ? k_scale : std::nullopt, "k_cache");
  p.v = kv_side(v, v_cache, quant ? v_scale : std::nullopt, "v_cache");
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1),
              "kvwrite: k/v and their caches must agree on tokens, heads, pages and rows");
  p.H = int(k.size(1));
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op,
                    k_cache.size(0) * k_cache.size(1), k_cache.size(1), k);
  TORCH_CHECK(p.locs.n == k.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

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
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, kv_cache.size(0) * kv_cache.size(1),
                    kv_cache.size(1), kv_c);
  TORCH_CHECK(p.locs.n == kv_c.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

inline StoreIndexerKParams store_indexer_k_params(const Tensor& k, const Tensor& cache, int64_t qbs, bool ue8m0,
                                                  const Tensor& loc, const OptTensor& loc_map,
                                                  const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                                  int64_t check, int64_t op) {
  TORCH_CHECK(k.dim() == 2 && (k.size(1) <= 1 || k.stride(1) == 1), "kvwrite: k must be [N, D], contiguous in D");
  TORCH_CHECK(qbs > 0 && k.size(1) % qbs == 0, "kvwrite: D must be a multiple of quant_block_size");
  TORCH_CHECK(cache.dim() == 2 && cache.scalar_type() == at::kByte && (cache.size(1) <= 1 || cache.stride(1) == 1),
              "kvwrite: the indexer cache must be a uint8 [pages, page bytes] tensor");
  check_same_device(k, cache, "cache");
  const int64_t d = k.size(1), per_token = d + (d / qbs) * 4;
  TORCH_CHECK(cache.size(1) % per_token == 0 && cache.size(1) > 0,
              "kvwrite: the indexer cache page is not a whole number of tokens");
  StoreIndexerKParams p;
  p.k = static_cast<const char*>(k.data_ptr());
  p.k_sn = k.stride(0);
  p.qbs = int(qbs);
  p.ue8m0 = ue8m0;
  p.in_dtype = dtype_of(k);
  p.cache.base = static_cast<char*>(cache.data_ptr());
  p.cache.stride_page = cache.stride(0);
  p.cache.pool_page_size = cache.size(1) / per_token;
  p.cache.D = int(d);
  p.cache.blocks = int(d / qbs);
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, cache.size(0) * p.cache.pool_page_size,
                    p.cache.pool_page_size, k);
  TORCH_CHECK(p.locs.n == k.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

inline NVFP4Side nvfp4_side(const Tensor& x, const Tensor& values, const Tensor& scales, const OptTensor& global,
                            const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1) && x.size(2) % NVFP4_BLOCK == 0,
              "kvwrite: ", name, " rows must be [tokens, heads, D], D a multiple of 16, contiguous in D");
  TORCH_CHECK(values.scalar_type() == at::kByte && scales.scalar_type() == at::kFloat8_e4m3fn,
              "kvwrite: NVFP4 caches are uint8 values and float8_e4m3fn scales");
  TORCH_CHECK(values.size(2) == x.size(1) && values.size(3) * 2 == x.size(2) && scales.size(2) == x.size(1) &&
                  scales.size(3) * NVFP4_BLOCK == x.size(2) && scales.size(0) == values.size(0) &&
                  scales.size(1) == values.size(1),
              "kvwrite: ", name, " NVFP4 cache shapes do not match its rows");
  check_same_device(x, values, "cache");
  check_same_device(x, scales, "scale cache");
  NVFP4Side s = source_rows<NVFP4Side>(x);
  s.values = paged(values, name);
  s.scales = paged(scales, name);
  if (global.has_value()) {
    TORCH_CHECK(global->scalar_type() == at::kFloat && global->numel() == 1, "kvwrite: global scales are fp32 [1]");
    check_same_device(x, *global, "global scale");
    s.global = global->data_ptr<float>();
  }
  return s;
}

inline StoreKVNVFP4Params store_kv_nvfp4_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                               const Tensor& v_cache, const Tensor& k_scale_cache,
                                               const Tensor& v_scale_cache, const OptTensor& k_global,
                                               const OptTensor& v_global, const Tensor& loc,
                                               const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                               int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v.size(0) == k.size(0) && v.size(1) == k.size(1),
              "kvwrite: k and v must share dtype, tokens and heads");
  StoreKVNVFP4Params p;
  p.in_dtype = dtype_of(k);
  p.k = nvfp4_side(k, k_cache, k_scale_cache, k_global, "k_cache");
  p.v = nvfp4_side(v, v_cache, v_scale_cache, v_global, "v_cache");
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
              "kvwrite: the K and V caches must have the same pages and rows");
  p.H = int(k.size(1));
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, k_cache.size(0) * k_cache.size(1),
                    k_cache.size(1), k);
  TORCH_CHECK(p.locs.n == k.size(0), "kvwrite: loc must have one entry per token");
  return p;
}


// store_kv_quant: canonical [pages, pool_page_size, H, D] int8 / fp8 caches (read as bytes),
// static fp32 scales ([], [1] or [H]) or dynamic fp32 scale caches [pages, pool_page_size, 1 or H].
inline KVQuantSide kv_quant_side(const Tensor& x, const Tensor& cache, const OptTensor& scale,
                                 const OptTensor& scale_cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "kvwrite: ", name,
              " must be [tokens, heads, dim], contiguous in dim");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == x.size(1) && cache.size(3) == x.size(2) && cache.element_size() == 1,
              "kvwrite: ", name, " must be a 1-byte [pages, rows, heads, dim] cache matching its rows");
  check_same_device(x, cache, "cache");
  KVQuantSide s = source_rows<KVQuantSide>(x);
  s.cache = paged(cache, name);
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && (scale->numel() == 1 || scale->numel() == x.size(1)) &&
                    (scale->numel() <= 1 || scale->stride(-1) == 1),
                "kvwrite: ", name, " static scale must be fp32 [], [1] or [H]");
    check_same_device(x, *scale, "scale");
    s.scale = scale->data_ptr<float>();
    s.scale_stride = scale->numel() > 1 ? 1 : 0;
  } else {
    TORCH_CHECK(scale_cache.has_value(), "kvwrite: ", name, " needs a static scale or a scale cache");
    const Tensor& c = *scale_cache;
    TORCH_CHECK(c.scalar_type() == at::kFloat && c.dim() == 3 && c.size(0) == cache.size(0) &&
                    c.size(1) == cache.size(1) && (c.size(2) == 1 || c.size(2) == x.size(1)),
                "kvwrite: ", name, " scale cache must be fp32 [pages, rows, 1 or H]");
    check_same_device(x, c, "scale cache");
    s.scales = paged(c.unsqueeze(-1), name);
  }
  return s;
}

inline StoreKVQuantParams store_kv_quant_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                               const Tensor& v_cache, const OptTensor& k_scale,
                                               const OptTensor& v_scale, const OptTensor& k_scale_cache,
                                               const OptTensor& v_scale_cache, int64_t quant, int64_t rule,
                                               const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                                               int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "kvwrite: k/v and k_cache/v_cache must share dtypes");
  TORCH_CHECK(quant >= QUANT_STATIC && quant <= QUANT_HEAD && (rule == RULE_RNE || rule == RULE_VLLM),
              "kvwrite: bad quant mode or rule");
  const bool dyn = quant != QUANT_STATIC;
  TORCH_CHECK(dyn ? (k_scale_cache.has_value() && v_scale_cache.has_value())
                  : (k_scale.has_value() && v_scale.has_value()),
              "kvwrite: store_kv_quant needs k/v scales (static) or k/v scale caches (dynamic)");
  StoreKVQuantParams p;
  p.in_dtype = dtype_of(k);
  switch (k_cache.scalar_type()) {
    case at::kChar: p.fmt = FMT_INT8; break;
    case at::kFloat8_e4m3fn: p.fmt = FMT_E4M3; break;
    case at::kFloat8_e5m2: p.fmt = FMT_E5M2; break;
    default: TORCH_CHECK(false, "kvwrite: store_kv_quant caches must be int8, float8_e4m3fn or float8_e5m2");
  }
  p.quant = int(quant);
  p.rule = int(rule);
  p.k = kv_quant_side(k, k_cache, dyn ? std::nullopt : k_scale, dyn ? k_scale_cache : std::nullopt, "k_cache");
  p.v = kv_quant_side(v, v_cache, dyn ? std::nullopt : v_scale, dyn ? v_scale_cache : std::nullopt, "v_cache");
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1),
              "kvwrite: k/v and their caches must agree on tokens, heads, pages and rows");
  if (dyn) TORCH_CHECK(k_scale_cache->size(2) == v_scale_cache->size(2), "kvwrite: k/v scale caches must match");
  TORCH_CHECK(!dyn || k_scale_cache->size(2) == (quant == QUANT_HEAD ? k.size(1) : 1),
              "kvwrite: the scale caches' last dim must be 1 (per token) or H (per token-head)");
  p.H = int(k.size(1));
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, k_cache.size(0) * k_cache.size(1),
                    k_cache.size(1), k);
  TORCH_CHECK(p.locs.n == k.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

}  // namespace kvwrite
