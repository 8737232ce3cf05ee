// DeepSeek V4 CUDA launchers: KV pages, MXFP4 indexer rows, state rows (kernel: tokens.cuh;
// per-token bodies: kvwrite/store_dsv4.h, shared with the CPU kernels in ops.cpp).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_dsv4_kv(const StoreDSV4KVParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_dsv4_kv));
}

cudaError_t launch_store_mxfp4(const StoreMXFP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_mxfp4));
}

cudaError_t launch_store_rows(const StoreRowsParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, KVW_DISPATCH(dispatch_store_rows));
}

}  // namespace kvwrite
