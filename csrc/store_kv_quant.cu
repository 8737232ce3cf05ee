// store_kv into int8 / dynamic-scale caches: the CUDA launcher (kernel: tokens.cuh; per-token
// body: kvwrite/store_kv_quant.h, shared with the CPU kernel in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_kv_quant(const StoreKVQuantParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_kv_quant));
}

}  // namespace kvwrite
