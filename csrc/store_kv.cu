// store_kv CUDA kernel: the __global__ wrapper and its launcher. The body is store_kv_token
// (kvwrite/store_kv.h), shared with the CPU kernel.
#include "kvwrite/dispatch.h"
#include "launch.h"

namespace kvwrite {

template <int CHECK, DType IN, class OUT, int VEC>
__global__ void store_kv_kernel(const StoreKVParams p, int group) {
  const int per_block = blockDim.x / group;
  const i64 i = i64(blockIdx.x) * per_block + threadIdx.x / group;
  if (i < p.locs.n) store_kv_token<CHECK, IN, OUT, VEC>(p, i, int(threadIdx.x % group), group);
}

cudaError_t launch_store_kv(const StoreKVParams& p, int check, cudaStream_t stream) {
  const i64 d = p.k.D > p.v.D ? p.k.D : p.v.D;
  with_check(check, [&](auto c) {
    if (p.cache_dtype == p.in_dtype) {
      with_vec(store_kv_vec(p), [&](auto vec) {
        const LaunchShape g = launch_shape(p.locs.n, p.H * d * dtype_size(p.in_dtype) / vec.value);
        store_kv_kernel<c.value, DType::F32, void, vec.value><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
      });
    } else {
      with_float_dtype(p.in_dtype, [&](auto in) {
        with_fp8(p.cache_dtype, [&](auto fmt) {
          const LaunchShape g = launch_shape(p.locs.n, p.H * d);
          store_kv_kernel<c.value, in.value, typename decltype(fmt)::type, 1>
              <<<g.blocks, g.threads, 0, stream>>>(p, g.group);
        });
      });
    }
  });
  return cudaGetLastError();
}

}  // namespace kvwrite
