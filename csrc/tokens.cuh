// The per-token CUDA kernels and their launcher template, instantiated by the generated units
// (`KVW_LAUNCH(Params, mode)`, csrc/README.md); launch.h has the signatures.
#pragma once

#include "launch.h"

namespace kvwrite {

// `group` threads per token, blockDim.x / group tokens per block; tokens past the last skip.
template <class Token, class P>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) token_kernel(const P p, int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  if (i < locs_of(p).n) Token{}(p, i, int(threadIdx.x % group), group);
  end_block<Token>(locs_of(p).errors);  // guard mode: the record's call epoch
}

// The same mapping for bodies with a block barrier (the fused RoPE stores): every thread runs
// the body, `live` false past the last token.
template <class Token, class P>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) block_token_kernel(const P p, int group) {
  const i64 i = i64(blockIdx.x) * (blockDim.x / group) + threadIdx.x / group;
  Token{}(p, i, i < locs_of(p).n, int(threadIdx.x % group), group);
  end_block<Token>(locs_of(p).errors);
}

// One launch on `stream` (no host sync) of the Token that dispatch(p, C, ...) picks: the tokens
// of the other check modes are never instantiated here, so a unit compiles one mode's kernels.
template <class P, int C>
cudaError_t launch_check(const P& p, cudaStream_t stream) {
  dispatch(p, C, [&](auto token, i64 work) {
    using Token = typename decltype(token)::type;
    if constexpr (Token::check == C) {
      const LaunchShape g = launch_shape(locs_of(p).n, work);
      if constexpr (BARRIER<Token, P>) {
        block_token_kernel<Token, P><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
      } else {
        token_kernel<Token, P><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
      }
    }
  });
  return cudaGetLastError();
}

}  // namespace kvwrite

// The launcher of one params type in one check mode (an explicit instantiation, generated units only).
#define KVW_LAUNCH(P, C) \
  template cudaError_t kvwrite::launch_check<kvwrite::P, kvwrite::C>(const kvwrite::P&, cudaStream_t);
