// store_kv_nvfp4's kernels (per-token body: kvwrite/store_kv_nvfp4.h).
#include "tokens.cuh"

KVW_LAUNCH(StoreKVNVFP4Params)
