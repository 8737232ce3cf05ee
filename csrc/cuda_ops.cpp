// CUDA registrations of the kvwrite_ext ops: tensors -> params (params.h), then the launchers of
// csrc/*.cu on the current stream. No host sync; CUDA-graph safe.
#include <c10/cuda/CUDAGuard.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "api.h"
#include "engines.h"
#include "launch.h"
#include "params.h"
#include "params_dsv4.h"
#include "params_int4.h"
#include "params_rope.h"
#include "params_pages.h"

namespace kvwrite {
namespace {

void check_launch(cudaError_t err) {
  TORCH_CHECK(err == cudaSuccess, "kvwrite: CUDA kernel launch failed: ", cudaGetErrorString(err));
}

void store_kv_cuda(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                   const OptTensor& k_scale, const OptTensor& v_scale, const Tensor& loc,
                   const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                   int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  StoreKVParams p = store_kv_params(k, v, k_cache, v_cache, k_scale, v_scale, loc, loc_map, errors,
                                          dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.locs.n == 0) return;
  check_launch(launch_store_kv(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_mla_cuda(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache, const OptTensor& scale,
                   const OptTensor& scale_cache, const OptTensor& global_scale,
                    int64_t mode, const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                    int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(kv_c.device());
  StoreMLAParams p = store_mla_params(kv_c, k_pe, kv_cache, scale, scale_cache, global_scale, mode, loc, loc_map, errors, dcp_rank,
                                            dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, kv_c);
  if (p.locs.n == 0) return;
  check_launch(launch_store_mla(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_indexer_k_cuda(const Tensor& k, const Tensor& cache, int64_t qbs, bool ue8m0, const Tensor& loc,
                          const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                          int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  StoreIndexerKParams p = store_indexer_k_params(k, cache, qbs, ue8m0, loc, loc_map, errors, dcp_rank,
                                                       dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.locs.n == 0) return;
  check_launch(launch_store_indexer_k(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_kv_nvfp4_cuda(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                         const Tensor& k_scale_cache, const Tensor& v_scale_cache, const OptTensor& k_global,
                         const OptTensor& v_global, const Tensor& loc, const OptTensor& loc_map,
                         const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  StoreKVNVFP4Params p = store_kv_nvfp4_params(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, k_global,
                                                     v_global, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.locs.n == 0) return;
  check_launch(launch_store_kv_nvfp4(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_dsv4_kv_cuda(const Tensor& kv, const Tensor& cache, int64_t pool_page_size, const Tensor& loc,
                        const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                        int64_t check, int64_t op, const OptTensor& batch_indices,
    const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(kv.device());
  StoreDSV4KVParams p =
      store_dsv4_kv_params(kv, cache, pool_page_size, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
  if (p.locs.n == 0) return;
  check_launch(launch_store_dsv4_kv(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_dsv4_indexer_k_cuda(const Tensor& k, const Tensor& cache, int64_t pool_page_size, int64_t fmt, bool ue8m0,
                               const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                               int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
    const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  if (fmt == 0) {
    StoreIndexerKParams p =
        store_indexer_k_params(k, cache, 128, ue8m0, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
    kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
    p.locs.dcp_page = true;
    if (p.locs.n == 0) return;
    check_launch(launch_store_indexer_k(p, int(check), c10::cuda::getCurrentCUDAStream()));
    return;
  }
  StoreMXFP4Params p =
      store_mxfp4_params(k, cache, pool_page_size, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
  if (p.locs.n == 0) return;
  check_launch(launch_store_mxfp4(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_dsv4_kv_fp4_cuda(const Tensor& kv, const Tensor& cache, int64_t pool_page_size, int64_t fmt,
                            const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                            int64_t dcp_size, int64_t check, int64_t op) {
  const c10::cuda::CUDAGuard guard(kv.device());
  StoreDSV4FP4Params p =
      store_dsv4_fp4_params(kv, cache, pool_page_size, fmt, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  if (p.locs.n == 0) return;
  check_launch(launch_store_dsv4_fp4(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void rope_store_dsv4_kv_fp4_cuda(const Tensor& positions, const Tensor& kv, const Tensor& cos_sin, const OptTensor& q,
                                 const Tensor& cache, int64_t pool_page_size, int64_t fmt, const Tensor& loc,
                                 const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                 int64_t dcp_size, int64_t check, int64_t op) {
  const c10::cuda::CUDAGuard guard(kv.device());
  StoreDSV4FP4Params p = rope_store_dsv4_fp4_params(positions, kv, cos_sin, q, cache, pool_page_size, fmt, loc,
                                                    loc_map, errors, dcp_rank, dcp_size, check, op);
  if (p.locs.n == 0) return;
  check_launch(launch_rope_store_dsv4_fp4(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_rows_cuda(const Tensor& src, const Tensor& pool, const Tensor& loc, const OptTensor& loc_map,
                     const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
    const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(src.device());
  StoreRowsParams p = store_rows_params(src, pool, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
  if (p.locs.n == 0) return;
  check_launch(launch_store_rows(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

// Fused RoPE + store: the rotated k (k_pe) goes through a [n, row] scratch tensor of the
// input dtype (stream-ordered allocation: no host sync, capturable).
void rope_store_kv_cuda(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                        const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache, const OptTensor& k_scale,
                        const OptTensor& v_scale, const OptTensor& q_w, const OptTensor& k_w, double eps,
                        bool is_neox, const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                        int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                        const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  RopeStoreKVParams p = rope_store_kv_params(positions, q, k, v, cos_sin, k_cache, v_cache, k_scale, v_scale, q_w,
                                             k_w, eps, is_neox, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.kv.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.kv.locs.n == 0) return;
  const Tensor scratch = at::empty({k.size(0), k.size(1) * k.size(2)}, k.options());
  p.scratch = static_cast<char*>(scratch.data_ptr());
  p.scratch_sn = scratch.stride(0);
  check_launch(launch_rope_store_kv(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void rope_store_kv_quant_cuda(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                              const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache,
                              const OptTensor& k_scale, const OptTensor& v_scale, const OptTensor& k_scale_cache,
                              const OptTensor& v_scale_cache, int64_t quant, int64_t rule, const OptTensor& q_w,
                              const OptTensor& k_w, double eps, bool is_neox, const Tensor& loc,
                              const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                              int64_t check, int64_t op, const OptTensor& batch_indices, const OptTensor& kv_indices,
                              const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  RopeStoreKVQuantParams p = rope_store_kv_quant_params(positions, q, k, v, cos_sin, k_cache, v_cache, k_scale, v_scale,
                                                        k_scale_cache, v_scale_cache, quant, rule, q_w, k_w, eps,
                                                        is_neox, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.kv.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.kv.locs.n == 0) return;
  const Tensor scratch = at::empty({k.size(0), k.size(1) * k.size(2)}, k.options());
  p.scratch = static_cast<char*>(scratch.data_ptr());
  p.scratch_sn = scratch.stride(0);
  check_launch(launch_rope_store_kv_quant(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void rope_store_mla_cuda(const Tensor& positions, const Tensor& q_pe, const Tensor& kv_c, const Tensor& k_pe,
                         const Tensor& cos_sin, const Tensor& kv_cache, const OptTensor& scale,
                         const OptTensor& scale_cache, const OptTensor& global_scale, int64_t mode, bool is_neox,
                         const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                         int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                         const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(kv_c.device());
  RopeStoreMLAParams p = rope_store_mla_params(positions, q_pe, kv_c, k_pe, cos_sin, kv_cache, scale, scale_cache,
                                               global_scale, mode, is_neox, loc, loc_map, errors, dcp_rank,
                                               dcp_size, check, op);
  set_table(p.mla.locs, batch_indices, kv_indices, kv_indptr, kv_c);
  if (p.mla.locs.n == 0) return;
  const Tensor scratch = at::empty({k_pe.size(0), k_pe.size(1)}, k_pe.options());
  p.scratch = static_cast<char*>(scratch.data_ptr());
  p.scratch_sn = scratch.stride(0);
  check_launch(launch_rope_store_mla(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

// Page moves (kvwrite/pages.h).
void copy_pages_cuda(const Tensor& src, const Tensor& dst, const Tensor& src_pages, const Tensor& dst_pages,
                     const OptTensor& errors, int64_t check, int64_t op) {
  const c10::cuda::CUDAGuard guard(dst.device());
  const CopyPagesParams p = copy_pages_params(src, dst, src_pages, dst_pages, errors, check, op);
  check_launch(launch_copy_pages(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void gather_cuda(const Tensor& cache, const Tensor& out, const Tensor& loc, const OptTensor& loc_map,
                 const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
                 const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(cache.device());
  GatherParams p = gather_params(cache, out, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, cache);
  if (p.locs.n == 0) return;
  check_launch(launch_gather(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void slot_mapping_cuda(const Tensor& block_table, const Tensor& batch_indices, const Tensor& positions,
                       const Tensor& out, int64_t page_size, int64_t num_pages, const OptTensor& errors,
                       int64_t check, int64_t op) {
  const c10::cuda::CUDAGuard guard(block_table.device());
  const SlotMappingParams p =
      slot_mapping_params(block_table, batch_indices, positions, out, page_size, num_pages, errors, check, op);
  check_launch(launch_slot_mapping(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_kv_quant_cuda(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                         const OptTensor& k_scale, const OptTensor& v_scale, const OptTensor& k_scale_cache,
                         const OptTensor& v_scale_cache, int64_t quant, int64_t rule, const Tensor& loc,
                         const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                         int64_t check, int64_t op, const OptTensor& batch_indices, const OptTensor& kv_indices,
                         const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  StoreKVQuantParams p = store_kv_quant_params(k, v, k_cache, v_cache, k_scale, v_scale, k_scale_cache, v_scale_cache,
                                               quant, rule, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.locs.n == 0) return;
  check_launch(launch_store_kv_quant(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

void store_kv_int4_cuda(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& k_scale_cache, const Tensor& v_scale_cache, const Tensor& loc,
                        const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                        int64_t check, int64_t op, const OptTensor& batch_indices, const OptTensor& kv_indices,
                        const OptTensor& kv_indptr) {
  const c10::cuda::CUDAGuard guard(k.device());
  StoreKVInt4Params p = store_kv_int4_params(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, loc_map,
                                             errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  if (p.locs.n == 0) return;
  check_launch(launch_store_kv_int4(p, int(check), c10::cuda::getCurrentCUDAStream()));
}

// The duplicate-row pre-pass (kvwrite/claims.h, csrc/claims.cu): guard returns the loc the
// store runs on; assert returns an empty tensor (a duplicate is a device assert).
Tensor claim_rows_cuda(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                       int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                       const OptTensor& kv_indices, const OptTensor& kv_indptr, int64_t capacity,
                       int64_t pool_page_size, bool dcp_page) {
  const c10::cuda::CUDAGuard guard(loc.device());
  ClaimParams p;
  p.a = claim_locs(loc, loc_map, errors, dcp_rank, dcp_size, check, op, batch_indices, kv_indices, kv_indptr, capacity,
                   pool_page_size, dcp_page);
  const i64 slots = claim_slots(p.a.n);
  const Tensor keys = at::empty({slots}, loc.options().dtype(at::kLong));
  const Tensor first = at::empty({slots}, loc.options().dtype(at::kInt));
  Tensor out = at::empty({check == CHECK_GUARD ? p.a.n : 0}, loc.options().dtype(at::kLong));
  p.keys = keys.data_ptr<int64_t>();
  p.first = reinterpret_cast<uint32_t*>(first.data_ptr<int32_t>());
  p.mask = slots - 1;
  p.out = check == CHECK_GUARD ? out.data_ptr<int64_t>() : nullptr;
  if (p.a.n > 0) check_launch(launch_claim_rows(p, int(check), c10::cuda::getCurrentCUDAStream()));
  return out;
}

}  // namespace
}  // namespace kvwrite

TORCH_LIBRARY_IMPL(kvwrite_ext, CUDA, m) {
  m.impl("claim_rows", &kvwrite::claim_rows_cuda);
  m.impl("copy_pages", &kvwrite::copy_pages_cuda);
  m.impl("gather", &kvwrite::gather_cuda);
  m.impl("slot_mapping", &kvwrite::slot_mapping_cuda);
  m.impl("store_kv", &kvwrite::store_kv_cuda);
  m.impl("store_kv_quant", &kvwrite::store_kv_quant_cuda);
  m.impl("store_kv_int4", &kvwrite::store_kv_int4_cuda);
  m.impl("store_mla", &kvwrite::store_mla_cuda);
  m.impl("store_indexer_k", &kvwrite::store_indexer_k_cuda);
  m.impl("store_kv_nvfp4", &kvwrite::store_kv_nvfp4_cuda);
  m.impl("store_dsv4_kv", &kvwrite::store_dsv4_kv_cuda);
  m.impl("store_dsv4_indexer_k", &kvwrite::store_dsv4_indexer_k_cuda);
  m.impl("store_rows", &kvwrite::store_rows_cuda);
  m.impl("store_dsv4_kv_fp4", &kvwrite::store_dsv4_kv_fp4_cuda);
  m.impl("rope_store_dsv4_kv_fp4", &kvwrite::rope_store_dsv4_kv_fp4_cuda);
  m.impl("rope_store_kv", &kvwrite::rope_store_kv_cuda);
  m.impl("rope_store_kv_quant", &kvwrite::rope_store_kv_quant_cuda);
  m.impl("rope_store_mla", &kvwrite::rope_store_mla_cuda);
}

// The public ops torch.ops.kvwrite.* for CUDA tensors: validation + dispatch in C++ (api.h),
// the launchers above for backend "cuda" (assert mode: the device assert, as before).
namespace kvwrite {
struct CudaRun {
  static constexpr const char* NAME = "cuda";
  static constexpr auto store_kv = &store_kv_cuda;
  static constexpr auto store_kv_quant = &store_kv_quant_cuda;
  static constexpr auto store_kv_int4 = &store_kv_int4_cuda;
  static constexpr auto store_mla = &store_mla_cuda;
  static constexpr auto store_indexer_k = &store_indexer_k_cuda;
  static constexpr auto store_kv_nvfp4 = &store_kv_nvfp4_cuda;
  static constexpr auto store_dsv4_kv = &store_dsv4_kv_cuda;
  static constexpr auto store_dsv4_indexer_k = &store_dsv4_indexer_k_cuda;
  static constexpr auto store_rows = &store_rows_cuda;
  static constexpr auto rope_store_kv = &rope_store_kv_cuda;
  static constexpr auto rope_store_kv_quant = &rope_store_kv_quant_cuda;
  static constexpr auto rope_store_mla = &rope_store_mla_cuda;
  static constexpr auto copy_pages = &copy_pages_cuda;
  static constexpr auto gather = &gather_cuda;
  static constexpr auto slot_mapping = &slot_mapping_cuda;
  static constexpr auto claim_rows = &claim_rows_cuda;
};
// the engines' operators (engines.h) on the CUDA kernels
const bool ENGINES_CUDA = [] {
  engines::runner(c10::DeviceType::CUDA) = {[](const StoreKVParams& p, int64_t check, c10::Device d) {
                                               const c10::cuda::CUDAGuard guard(d);
                                               check_launch(launch_store_kv(p, int(check), c10::cuda::getCurrentCUDAStream()));
                                             },
                                             &claim_rows_cuda};
  return true;
}();
}  // namespace kvwrite

TORCH_LIBRARY_IMPL(kvwrite, CUDA, m) { kvwrite::api::register_ops<kvwrite::CudaRun>(m); }
