// DeepSeek V4 CUDA kernels (KV pages, MXFP4 indexer rows, state rows): the launchers (the
// __global__ wrapper: launch_tokens.cuh). The per-token bodies (kvwrite/store_dsv4.h) are shared with the CPU kernels.
#include "launch_tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_dsv4_kv(const StoreDSV4KVParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_dsv4_kv(q, c, f); });
}

cudaError_t launch_store_mxfp4(const StoreMXFP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_mxfp4(q, c, f); });
}

cudaError_t launch_store_rows(const StoreRowsParams& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_rows(q, c, f); });
}

}  // namespace kvwrite
