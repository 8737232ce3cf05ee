// store_kv's int4 format: the CUDA launcher (kernel: tokens.cuh; per-token body:
// kvwrite/kv_int4.h, shared with the CPU kernel in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_kv_int4(const StoreKVInt4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_kv_int4));
}

}  // namespace kvwrite
