// DeepSeek V4 CUDA kernels (KV pages, MXFP4 indexer rows, state rows): the __global__ wrapper
// and the launchers. The per-token bodies (kvwrite/store_dsv4.h) are shared with the CPU kernels.
#include "launch.h"

namespace kvwrite {

// `group` threads per token, blockDim.x / group tokens per block.
template <class Token, class P>
__global__ void store_dsv4_kernel(const P p, int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i < p.locs.n) Token{}(p, i, int(threadIdx.x % group), group);
  end_block<Token>(p.locs.errors);  // guard mode: the record's call epoch
}

template <class P, class Dispatch>
cudaError_t launch_tokens(const P& p, int check, cudaStream_t stream, Dispatch dispatch) {
  dispatch(p, check, [&](auto token, i64 work) {
    const LaunchShape g = launch_shape(p.locs.n, work);
    store_dsv4_kernel<typename decltype(token)::type, P><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
  });
  return cudaGetLastError();
}

cudaError_t launch_store_dsv4_kv(const StoreDSV4KVParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_dsv4_kv(q, c, f); });
}

cudaError_t launch_store_mxfp4(const StoreMXFP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_mxfp4(q, c, f); });
}

cudaError_t launch_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_dsv4_fp4<false>(q, c, f); });
}

cudaError_t launch_rope_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_dsv4_fp4<true>(q, c, f); });
}

cudaError_t launch_store_rows(const StoreRowsParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_rows(q, c, f); });
}

}  // namespace kvwrite
