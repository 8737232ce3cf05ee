// store_indexer_k CUDA launcher (kernel: tokens.cuh; per-token body: kvwrite/store_indexer_k.h,
// shared with the CPU kernel in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_indexer_k(const StoreIndexerKParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_indexer_k));
}

}  // namespace kvwrite
