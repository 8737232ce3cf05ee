// store_kv_nvfp4 CUDA launcher (kernel: tokens.cuh; per-token body: kvwrite/store_kv_nvfp4.h,
// shared with the CPU kernel in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_kv_nvfp4(const StoreKVNVFP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_kv_nvfp4));
}

}  // namespace kvwrite
