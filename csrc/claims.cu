// The duplicate-row pre-pass on a GPU (kvwrite/claims.h): a fill of the table, an insert kernel
// and a check kernel, one thread a token, on `stream` (no host sync, CUDA-graph safe).
#include "launch.h"

namespace kvwrite {

template <int CHECK, bool INSERT>
__global__ void claim_kernel(const ClaimParams p) {
  const i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i >= p.a.n) return;
  if constexpr (INSERT) claim_insert<CHECK>(p, i);
  else claim_check<CHECK>(p, i);
}

cudaError_t launch(const ClaimParams& p, int check, cudaStream_t stream) {
  const i64 slots = p.mask + 1;
  cudaError_t err = cudaMemsetAsync(p.keys, 0xFF, size_t(slots) * sizeof(i64), stream);  // FREE_ROW
  if (err == cudaSuccess) err = cudaMemsetAsync(p.first, 0xFF, size_t(slots) * sizeof(uint32_t), stream);
  if (err != cudaSuccess) return err;
  const unsigned blocks = unsigned((p.a.n + KVW_BLOCK_THREADS - 1) / KVW_BLOCK_THREADS);
  with_check(check, [&](auto c) {
    if constexpr (c.value != CHECK_OFF) {
      claim_kernel<c.value, true><<<blocks, KVW_BLOCK_THREADS, 0, stream>>>(p);
      claim_kernel<c.value, false><<<blocks, KVW_BLOCK_THREADS, 0, stream>>>(p);
    }
  });
  return cudaGetLastError();
}

}  // namespace kvwrite
