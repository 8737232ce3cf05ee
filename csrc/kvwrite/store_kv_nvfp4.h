// store_kv_nvfp4: the fused paged K+V store of MHA/GQA in NVFP4 (kvwrite/ops/nvfp4.py).
// Values uint8 [pages, pool_page_size, H, D/2], block scales e4m3 [pages, pool_page_size, H, D/16]
// (canonical views: NHD and HND are strides). Lanes stride over the 16-element blocks of K then V.
#pragma once

#include "dispatch.h"
#include "locs.h"
#include "nvfp4.h"
#include "paged.h"

namespace kvwrite {

struct NVFP4Side {
  const char* src = nullptr;
  i64 s_tok = 0, s_head = 0;  // elements
  PagedCache values, scales;
  const float* global = nullptr;
  int D = 0;
};

struct StoreKVNVFP4Params {
  NVFP4Side k, v;
  int H = 0;
  DType in_dtype = DType::F32;
  LocArgs locs;
};

// Block b (of the flattened [H, D/16] blocks) of token i; `values`/`scales`: its row pointers.
template <DType IN>
KVW_HD void nvfp4_side_block(const NVFP4Side& s, i64 i, char* values, char* scales, int b) {
  const int nb = s.D / NVFP4_BLOCK, h = b / nb, j = b - h * nb;
  const i64 start = i * s.s_tok + h * s.s_head + i64(j) * NVFP4_BLOCK;
  nvfp4_block([&](int e) { return load_float<IN>(s.src, start + e); }, s.global,
              values + s.values.in_row(h, j * (NVFP4_BLOCK / 2)), scales + s.scales.in_row(h, j));
}

template <int CHECK, DType IN>
KVW_HD void store_kv_nvfp4_token(const StoreKVNVFP4Params& p, i64 i, int lane, int nlanes) {
#if !defined(__CUDA_ARCH__)
  const i64 ahead = nlanes == 1 ? prefetch_row(p.locs, i + PREFETCH_AHEAD) : -1;
  if (ahead >= 0) {  // a later token's rows, asked for now
    p.k.values.prefetch_heads(ahead, p.H, p.k.D / 2);
    p.v.values.prefetch_heads(ahead, p.H, p.v.D / 2);
    p.k.scales.prefetch_heads(ahead, p.H, p.k.D / NVFP4_BLOCK);
    p.v.scales.prefetch_heads(ahead, p.H, p.v.D / NVFP4_BLOCK);
  }
#endif
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  const int nk = p.H * (p.k.D / NVFP4_BLOCK), nv = p.H * (p.v.D / NVFP4_BLOCK);
  char *kv = p.k.values.row_ptr(r.row), *ks = p.k.scales.row_ptr(r.row);
  char *vv = p.v.values.row_ptr(r.row), *vs = p.v.scales.row_ptr(r.row);
#if !defined(__CUDA_ARCH__)
  if (nlanes == 1 && !p.k.values.split && !p.k.scales.split && !p.v.values.split && !p.v.scales.split) {
    const auto side = [&](const NVFP4Side& s, char* values, char* scales) {  // a head's blocks are contiguous
      const int nb = s.D / NVFP4_BLOCK;
      if (s.s_head == s.D && s.values.in_row(1, 0) == s.D / 2 && s.scales.in_row(1, 0) == nb)  // so are the heads
        return nvfp4_run<IN>(s.src, i * s.s_tok, p.H * nb, s.global, values, scales);
      for (int h = 0; h < p.H; ++h)
        nvfp4_run<IN>(s.src, i * s.s_tok + h * s.s_head, s.D / NVFP4_BLOCK, s.global, values + s.values.in_row(h, 0),
                      scales + s.scales.in_row(h, 0));
    };
    side(p.k, kv, ks);
    side(p.v, vv, vs);
    return;
  }
#endif
  for (int w = lane; w < nk + nv; w += nlanes) {
    if (w < nk) {
      nvfp4_side_block<IN>(p.k, i, kv, ks, w);
    } else {
      nvfp4_side_block<IN>(p.v, i, vv, vs, w - nk);
    }
  }
}

template <int CHECK, DType IN>
struct StoreKVNVFP4Token {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreKVNVFP4Params& p, i64 i, int lane, int nlanes) const {
    store_kv_nvfp4_token<CHECK, IN>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_kv_nvfp4(const StoreKVNVFP4Params& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) {
      f(TypeTag<StoreKVNVFP4Token<c.value, in.value>>{}, p.H * (p.k.D + p.v.D) / NVFP4_BLOCK);
    });
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreKVNVFP4Params& p) {
  return i64(p.H) * (p.k.D + p.v.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
KVW_BODY(StoreKVNVFP4Params, dispatch_store_kv_nvfp4)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> StoreKVNVFP4Params
// and its op table row (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_KV_NVFP4(X) \
  X(store_kv_nvfp4, reg::Bind<&store_kv_nvfp4_params>::table, \
    "(" KVW_KV "Tensor(c!) k_scale_cache, Tensor(d!) v_scale_cache, Tensor? k_global_scale, " \
    "Tensor? v_global_scale, " KVW_TAIL ") -> ()")

namespace kvwrite {

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
  p.H = int(k.size(1));
  TORCH_CHECK(v_cache.size(0) == k_cache.size(0) && v_cache.size(1) == k_cache.size(1),
              "kvwrite: the K and V caches must have the same pages and rows");
  p.locs = cache_locs(k, k_cache, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  return p;
}

}  // namespace kvwrite
#endif  // KVW_HOST
