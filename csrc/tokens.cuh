// The per-token CUDA kernels and their launcher template, instantiated by the generated units
// (`KVW_LAUNCH(Params, mode)`, csrc/README.md); launch.h has the signatures.
#pragma once

#include "launch.h"

namespace kvwrite {

// `group` threads per token, blockDim.x / group tokens per block; tokens past the last skip, but
// run a body with a block barrier (the fused RoPE stores) with `live` false.
template <class Token, class P>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) token_kernel(const P p, int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if constexpr (BARRIER<Token, P>) {
    Token{}(p, i, i < locs_of(p).n, int(threadIdx.x % group), group);
  } else if (i < locs_of(p).n) {
    Token{}(p, i, int(threadIdx.x % group), group);
  }
  end_block<Token>(locs_of(p).errors);  // guard mode: the record's call epoch
}

// One launch on `stream` (no host sync) of the Token that dispatch(p, C, ...) picks (of mode C only).
template <class P, int C>
cudaError_t launch_check(const P& p, cudaStream_t stream) {
  dispatch(p, C, [&](auto token, i64 work) {
    using Token = typename decltype(token)::type;
    if constexpr (Token::check == C) {
      const LaunchShape g = launch_shape(locs_of(p).n, work);
      token_kernel<Token, P><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
    }
  });
  return cudaGetLastError();
}

}  // namespace kvwrite

// The launcher of one params type in one check mode (an explicit instantiation, generated units only).
#define KVW_LAUNCH(P, C) \
  template cudaError_t kvwrite::launch_check<kvwrite::P, kvwrite::C>(const kvwrite::P&, cudaStream_t);
