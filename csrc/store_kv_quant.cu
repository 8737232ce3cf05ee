// store_kv_quant CUDA kernel: the __global__ wrapper and its launcher. The per-token body
// (kvwrite/store_kv_quant.h) is shared with the CPU kernel in ops.cpp; a token's lanes (at most
// one warp, aligned: launch_shape's group) combine the dynamic amax with warp shuffles.
#include "launch.h"

namespace kvwrite {

template <class Token>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) store_kv_quant_kernel(const StoreKVQuantParams p,
                                                                                           int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i < p.locs.n) Token{}(p, i, int(threadIdx.x % group), group);
}

cudaError_t launch_store_kv_quant(const StoreKVQuantParams& p, int check, cudaStream_t stream) {
  dispatch_store_kv_quant(p, check, [&](auto token, i64 work) {
    const LaunchShape g = launch_shape(p.locs.n, work);
    store_kv_quant_kernel<typename decltype(token)::type><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
  });
  return cudaGetLastError();
}

}  // namespace kvwrite
