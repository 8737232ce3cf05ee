// rope_store_kv CUDA launcher (fused RoPE + store; kernel: tokens.cuh's block_token_kernel, whose
// every thread runs the body: its block barrier separates rotating into the scratch rows from
// storing them; body: kvwrite/rope_store.h, shared with the CPU kernel in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_rope_store_kv(const RopeStoreKVParams& p, int check, cudaStream_t stream) {
  return launch_tokens<true>(p, check, stream, KVW_DISPATCH(dispatch_rope_store_kv));
}

}  // namespace kvwrite
