// The CUDA launchers (csrc/*.cu): plain C++ signatures, no torch headers on either side.
#pragma once

#include <cuda_runtime_api.h>

#include "kvwrite/store_kv.h"

namespace kvwrite {

// Each enqueues one kernel on `stream` (no host sync) and returns cudaGetLastError().
cudaError_t launch_store_kv(const StoreKVParams& p, int check, cudaStream_t stream);

}  // namespace kvwrite
