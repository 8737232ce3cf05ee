// store_mla CUDA launcher (kernel: tokens.cuh; per-token body: kvwrite/store_mla.h, shared with
// the CPU kernel in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_mla(const StoreMLAParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_mla));
}

}  // namespace kvwrite
