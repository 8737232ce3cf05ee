// The CUDA launchers (csrc/*.cu): plain C++ signatures, no torch headers on either side.
#pragma once

#include <cuda_runtime_api.h>

#include "kvwrite/store_dsv4.h"
#include "kvwrite/store_dsv4_fp4.h"
#include "kvwrite/store_indexer_k.h"
#include "kvwrite/store_kv.h"
#include "kvwrite/store_kv_quant.h"
#include "kvwrite/kv_int4.h"
#include "kvwrite/store_kv_nvfp4.h"
#include "kvwrite/store_mla.h"
#include "kvwrite/rope_store.h"
#include "kvwrite/pages.h"
#include "kvwrite/claims.h"

// Every kernel runs 256-thread blocks (launch_shape); at least 4 resident blocks per SM caps a
// thread at 64 registers (65536 / (256 * 4)): the assert variants' __assert_fail arguments
// otherwise push a few kernels to 66-80. tests/test_static_gpu.py checks 0 spill and <= 64.
#define KVW_BLOCK_THREADS 256
#define KVW_MIN_BLOCKS 4

namespace kvwrite {

// Each enqueues one kernel on `stream` (no host sync) and returns cudaGetLastError().
cudaError_t launch_store_kv(const StoreKVParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_kv_quant(const StoreKVQuantParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_kv_int4(const StoreKVInt4Params& p, int check, cudaStream_t stream);
cudaError_t launch_store_mla(const StoreMLAParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_indexer_k(const StoreIndexerKParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_kv_nvfp4(const StoreKVNVFP4Params& p, int check, cudaStream_t stream);
// DeepSeek V4 (csrc/store_dsv4.cu)
cudaError_t launch_store_dsv4_kv(const StoreDSV4KVParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_mxfp4(const StoreMXFP4Params& p, int check, cudaStream_t stream);
cudaError_t launch_store_rows(const StoreRowsParams& p, int check, cudaStream_t stream);
cudaError_t launch_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, cudaStream_t stream);
cudaError_t launch_rope_store_dsv4_fp4(const StoreDSV4FP4Params& p, int check, cudaStream_t stream);
// fused RoPE + store (csrc/rope_store.cu); p.scratch: [n, row] device rows of the rotated k / k_pe
cudaError_t launch_rope_store_kv(const RopeStoreKVParams& p, int check, cudaStream_t stream);
cudaError_t launch_rope_store_kv_quant(const RopeStoreKVQuantParams& p, int check, cudaStream_t stream);
cudaError_t launch_rope_store_mla(const RopeStoreMLAParams& p, int check, cudaStream_t stream);
// Page moves (csrc/pages.cu)
cudaError_t launch_copy_pages(const CopyPagesParams& p, int check, cudaStream_t stream);
cudaError_t launch_gather(const GatherParams& p, int check, cudaStream_t stream);
cudaError_t launch_slot_mapping(const SlotMappingParams& p, int check, cudaStream_t stream);
// The duplicate-row pre-pass (csrc/claims.cu): fills the table, then its two kernels
cudaError_t launch_claim_rows(const ClaimParams& p, int check, cudaStream_t stream);

}  // namespace kvwrite
