// The per-token CUDA kernels and their one launcher, shared by every csrc/*.cu store: a .cu
// file is its family's launchers, each `launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_x))`.
// Included by .cu files only (nvcc); launch.h has the plain C++ signatures.
#pragma once

#include "launch.h"

namespace kvwrite {

// A call's locs (overloaded where the params nest them: the fused RoPE stores).
template <class P>
KVW_HD const LocArgs& locs_of(const P& p) {
  return p.locs;
}

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

// One launch on `stream` (no host sync): `dispatch(p, check, f)` calls f(TypeTag<Token>, work
// items per token) for the call's runtime check mode and formats. BARRIER: block_token_kernel.
template <bool BARRIER = false, class P, class Dispatch>
cudaError_t launch_tokens(const P& p, int check, cudaStream_t stream, Dispatch&& dispatch) {
  dispatch(p, check, [&](auto token, i64 work) {
    using Token = typename decltype(token)::type;
    const LaunchShape g = launch_shape(locs_of(p).n, work);
    if constexpr (BARRIER) {
      block_token_kernel<Token, P><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
    } else {
      token_kernel<Token, P><<<g.blocks, g.threads, 0, stream>>>(p, g.group);
    }
  });
  return cudaGetLastError();
}

// A family's dispatch function template as the callable launch_tokens takes.
#define KVW_DISPATCH(fn) [](const auto& q, int c, auto&& f) { fn(q, c, f); }

}  // namespace kvwrite
