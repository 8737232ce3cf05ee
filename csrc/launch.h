// The CUDA launchers (csrc/*.cu): plain C++ signatures, no torch headers on either side.
#pragma once

#include <cuda_runtime_api.h>

#include "kvwrite/store_dsv4.h"
#include "kvwrite/store_indexer_k.h"
#include "kvwrite/store_kv.h"
#include "kvwrite/store_kv_nvfp4.h"
#include "kvwrite/store_mla.h"

namespace kvwrite {

// Each enqueues one kernel on `stream` (no host sync) and returns cudaGetLastError().
cudaError_t launch_store_kv(const StoreKVParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_mla(const StoreMLAParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_indexer_k(const StoreIndexerKParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_kv_nvfp4(const StoreKVNVFP4Params& p, int check, cudaStream_t stream);
// DeepSeek V4 (csrc/store_dsv4.cu)
cudaError_t launch_store_dsv4_kv(const StoreDSV4KVParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_mxfp4(const StoreMXFP4Params& p, int check, cudaStream_t stream);
cudaError_t launch_store_rows(const StoreRowsParams& p, int check, cudaStream_t stream);

}  // namespace kvwrite
