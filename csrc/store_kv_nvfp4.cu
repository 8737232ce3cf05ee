// store_kv_nvfp4 CUDA kernel: the __global__ wrapper and its launcher. The per-token body
// (kvwrite/store_kv_nvfp4.h) is shared with the CPU kernel in ops.cpp.
#include "launch.h"

namespace kvwrite {

// `group` threads per token, blockDim.x / group tokens per block.
template <class Token>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) store_kv_nvfp4_kernel(const StoreKVNVFP4Params p, int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i < p.locs.n) Token{}(p, i, int(threadIdx.x % group), group);
  end_block<Token>(p.locs.errors);  // guard mode: the record's call epoch
}

cudaError_t launch_store_kv_nvfp4(const StoreKVNVFP4Params& p, int check, cudaStream_t stream) {
  dispatch_store_kv_nvfp4(p, check, [&](auto token, i64 work) {
    const LaunchShape g = launch_shape(p.locs.n, work);
    store_kv_nvfp4_kernel<typename decltype(token)::type><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
  });
  return cudaGetLastError();
}

}  // namespace kvwrite
