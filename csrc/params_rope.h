// Tensors -> rope_store kernel parameters (host only, torch); shared by ops.cpp (CPU) and
// cuda_ops.cpp. kvwrite.ops.rope validated every argument already (named errors); these checks
// guard direct callers.
#pragma once

#include "params.h"

namespace kvwrite {

inline RopeArgs rope_args(const Tensor& positions, const Tensor& q, const Tensor& cos_sin, const OptTensor& q_w,
                          const OptTensor& k_w, double eps, bool is_neox, const Tensor& ref, int64_t D) {
  const int64_t n = ref.size(0);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n &&
                  (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong) &&
                  (n <= 1 || positions.stride(0) == 1),
              "kvwrite: positions must be a contiguous int32/int64 [n] tensor");
  TORCH_CHECK(q.dim() == 3 && q.size(0) == n && q.size(2) == D && q.scalar_type() == ref.scalar_type() &&
                  (D <= 1 || q.stride(2) == 1),
              "kvwrite: q must be [n, Hq, D] in the input dtype, contiguous in D");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(0) >= 1 &&
                  (cos_sin.scalar_type() == at::kFloat || cos_sin.scalar_type() == ref.scalar_type()) &&
                  (cos_sin.size(1) <= 1 || cos_sin.stride(1) == 1),
              "kvwrite: cos_sin_cache must be [max_position, rotary_dim] fp32 or the input dtype");
  const int64_t R = cos_sin.size(1);
  TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= D && D <= ROPE_MAX_DIM, "kvwrite: rotary_dim must be even, in [2, D], D <= ",
              ROPE_MAX_DIM);
  for (const Tensor* t : {&positions, &q, &cos_sin}) check_same_device(ref, *t, "rope argument");
  RopeArgs r;
  r.pos = positions.data_ptr();
  r.pos64 = positions.scalar_type() == at::kLong;
  r.max_pos = cos_sin.size(0);
  r.cos_sin = static_cast<const char*>(cos_sin.data_ptr());
  r.cs_stride = cos_sin.stride(0);
  r.cs_f32 = cos_sin.scalar_type() == at::kFloat;
  r.R = int(R);
  r.neox = is_neox;
  r.q = static_cast<char*>(q.data_ptr());
  r.q_sn = q.stride(0);
  r.q_sh = q.stride(1);
  r.Hq = int(q.size(1));
  const OptTensor* ws[] = {&q_w, &k_w};
  const float** dst[] = {&r.q_w, &r.k_w};
  for (int j = 0; j < 2; ++j) {
    if (!ws[j]->has_value()) continue;
    const Tensor& w = **ws[j];
    TORCH_CHECK(w.dim() == 1 && w.size(0) == D && w.scalar_type() == at::kFloat && (D <= 1 || w.stride(0) == 1),
                "kvwrite: norm weights must be contiguous fp32 [D]");
    check_same_device(ref, w, "norm weight");
    *dst[j] = w.data_ptr<float>();
  }
  TORCH_CHECK(eps >= 0, "kvwrite: norm_eps must be >= 0");
  r.eps = float(eps);
  return r;
}

inline RopeStoreKVParams rope_store_kv_params(const Tensor& positions, const Tensor& q, const Tensor& k,
                                              const Tensor& v, const Tensor& cos_sin, const Tensor& k_cache,
                                              const Tensor& v_cache, const OptTensor& k_scale,
                                              const OptTensor& v_scale, const OptTensor& q_w, const OptTensor& k_w,
                                              double eps, bool is_neox, const Tensor& loc, const OptTensor& loc_map,
                                              const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                              int64_t check, int64_t op) {
  RopeStoreKVParams p;
  p.kv = store_kv_params(k, v, k_cache, v_cache, k_scale, v_scale, loc, loc_map, errors, dcp_rank, dcp_size, check,
                         op);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) >= 1 && k_cache.size(1) >= 1,
              "kvwrite: the caches must be [pages >= 1, rows >= 1, heads, D] views");
  // scales: fp32 [] / [1] / [H] (contiguous), for fp8 caches only (kvwrite.validate.scale)
  const bool fp8 = is_fp8(p.kv.cache_dtype);
  for (const OptTensor* s : {&k_scale, &v_scale}) {
    TORCH_CHECK(s->has_value() == fp8, "kvwrite: k_scale/v_scale are required for (only for) fp8 caches");
    if (!fp8) continue;
    const Tensor& t = **s;
    TORCH_CHECK(t.dim() <= 1 && (t.numel() == 1 || (t.numel() == k.size(1) && t.stride(0) == 1)),
                "kvwrite: k_scale/v_scale must be fp32 [], [1] or [H]");
  }
  p.rope = rope_args(positions, q, cos_sin, q_w, k_w, eps, is_neox, k, k.size(2));
  return p;
}

inline RopeStoreKVQuantParams rope_store_kv_quant_params(
    const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos_sin,
    const Tensor& k_cache, const Tensor& v_cache, const OptTensor& k_scale, const OptTensor& v_scale,
    const OptTensor& k_scale_cache, const OptTensor& v_scale_cache, int64_t quant, int64_t rule, const OptTensor& q_w,
    const OptTensor& k_w, double eps, bool is_neox, const Tensor& loc, const OptTensor& loc_map,
    const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  RopeStoreKVQuantParams p;
  p.kv = store_kv_quant_params(k, v, k_cache, v_cache, k_scale, v_scale, k_scale_cache, v_scale_cache, quant, rule,
                               loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  TORCH_CHECK(k_cache.size(0) >= 1 && k_cache.size(1) >= 1, "kvwrite: the caches need pages and rows");
  p.rope = rope_args(positions, q, cos_sin, q_w, k_w, eps, is_neox, k, k.size(2));
  return p;
}

inline RopeStoreMLAParams rope_store_mla_params(const Tensor& positions, const Tensor& q_pe, const Tensor& kv_c,
                                                const Tensor& k_pe, const Tensor& cos_sin, const Tensor& kv_cache,
                                                const OptTensor& scale, const OptTensor& scale_cache,
                                                const OptTensor& global_scale, int64_t mode, bool is_neox,
                                                const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                                                int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  RopeStoreMLAParams p;
  p.mla = store_mla_params(kv_c, k_pe, kv_cache, scale, scale_cache, global_scale, mode, loc, loc_map, errors,
                           dcp_rank, dcp_size, check, op);
  p.rope = rope_args(positions, q_pe, cos_sin, std::nullopt, std::nullopt, 0.0, is_neox, k_pe, k_pe.size(1));
  TORCH_CHECK(p.rope.R == p.mla.R, "kvwrite: rope_store_mla rotates the whole k_pe: cos_sin_cache must be R wide");
  return p;
}

}  // namespace kvwrite
