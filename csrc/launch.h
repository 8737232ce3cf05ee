// The CUDA launchers' plain C++ signatures (no torch headers on either side).
#pragma once

#include <cuda_runtime_api.h>

#include "bodies.h"

// Every kernel runs 256-thread blocks (launch_shape); at least 4 resident blocks per SM caps a
// thread at 64 registers (65536 / (256 * 4)): the assert variants' __assert_fail arguments
// otherwise push a few kernels to 66-80. tests/test_static_gpu.py checks 0 spill and <= 64.
#define KVW_BLOCK_THREADS 256
#define KVW_MIN_BLOCKS 4

namespace kvwrite {

// Enqueues the call's kernel(s) on `stream` (no host sync), returns cudaGetLastError(). Per-token
// ops: tokens.cuh, a generated unit per params type and mode (rope: p.scratch, [n, row] rows).
template <class P, int C>
cudaError_t launch_check(const P& p, cudaStream_t stream);
template <class P>
cudaError_t launch(const P& p, int check, cudaStream_t stream) {
  cudaError_t err = cudaSuccess;  // no tokens: no launch
  if (locs_of(p).n == 0) return err;
  with_check(check, [&](auto c) { err = launch_check<P, c.value>(p, stream); });
  return err;
}
// Their own kernels: page moves (csrc/pages.cu), the duplicate-row pre-pass (csrc/claims.cu).
cudaError_t launch(const CopyPagesParams& p, int check, cudaStream_t stream);
cudaError_t launch(const SlotMappingParams& p, int check, cudaStream_t stream);
cudaError_t launch(const ClaimParams& p, int check, cudaStream_t stream);

}  // namespace kvwrite
