// The token-parallel __global__ wrapper of the DeepSeek V4 stores and its launcher (shared by
// store_dsv4.cu and store_dsv4_fp4.cu): a Token functor per token, `group` threads each.
#pragma once

#include "launch.h"

namespace kvwrite {

// `group` threads per token, blockDim.x / group tokens per block.
template <class Token, class P>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) store_dsv4_kernel(const P p, int group) {
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

}  // namespace kvwrite
