// rope_store_mla CUDA launcher (as rope_store_kv.cu).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_rope_store_mla(const RopeStoreMLAParams& p, int check, cudaStream_t stream) {
  return launch_tokens<true>(p, check, stream, KVW_DISPATCH(dispatch_rope_store_mla));
}

}  // namespace kvwrite
