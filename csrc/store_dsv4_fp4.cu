// DeepSeek V4 FP4 records (kvwrite/store_dsv4_fp4.h): the launchers of the plain and the fused
// RoPE store (its own translation unit: the rotation's instantiations compile beside the others).
#include "tokens.cuh"

namespace kvwrite {

cudaError_t launch_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_dsv4_fp4<false>(q, c, f); });
}

cudaError_t launch_rope_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, cudaStream_t stream) {
  return launch_tokens(p, check, stream, [](const auto& q, int c, auto&& f) { dispatch_store_dsv4_fp4<true>(q, c, f); });
}

}  // namespace kvwrite
