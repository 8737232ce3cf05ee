// rope_store CUDA kernels (rope_store_kv, rope_store_mla): the __global__ wrappers and their
// launchers. The per-token bodies (kvwrite/rope_store.h) are shared with the CPU kernels in
// ops.cpp. Every thread of a block runs the token body (also past the last token): the body's
// block barrier separates rotating into the scratch rows from storing them.
#include "launch.h"

namespace kvwrite {

template <class Token, class P>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) rope_store_kernel(const P p, i64 n, i64* errors, int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  Token{}(p, i, i < n, int(threadIdx.x % group), group);
  end_block<Token>(errors);  // guard mode: the record's call epoch
}

cudaError_t launch_rope_store_kv(const RopeStoreKVParams& p, int check, cudaStream_t stream) {
  dispatch_rope_store_kv(p, check, [&](auto token, i64 work) {
    const LaunchShape g = launch_shape(p.kv.locs.n, work);
    rope_store_kernel<typename decltype(token)::type, RopeStoreKVParams>
        <<<g.blocks, g.threads, 0, stream>>>(p, p.kv.locs.n, p.kv.locs.errors, g.group);
  });
  return cudaGetLastError();
}

cudaError_t launch_rope_store_kv_quant(const RopeStoreKVQuantParams& p, int check, cudaStream_t stream) {
  dispatch_rope_store_kv_quant(p, check, [&](auto token, i64 work) {
    const LaunchShape g = launch_shape(p.kv.locs.n, work);
    rope_store_kernel<typename decltype(token)::type, RopeStoreKVQuantParams>
        <<<g.blocks, g.threads, 0, stream>>>(p, p.kv.locs.n, p.kv.locs.errors, g.group);
  });
  return cudaGetLastError();
}

cudaError_t launch_rope_store_mla(const RopeStoreMLAParams& p, int check, cudaStream_t stream) {
  dispatch_rope_store_mla(p, check, [&](auto token, i64 work) {
    const LaunchShape g = launch_shape(p.mla.locs.n, work);
    rope_store_kernel<typename decltype(token)::type, RopeStoreMLAParams>
        <<<g.blocks, g.threads, 0, stream>>>(p, p.mla.locs.n, p.mla.locs.errors, g.group);
  });
  return cudaGetLastError();
}

}  // namespace kvwrite
