// store_kv's kernels (per-token body: kvwrite/store_kv.h, shared with the CPU in ops.cpp).
#include "tokens.cuh"

KVW_LAUNCH(StoreKVParams)
