// store_mla's kernels (per-token body: kvwrite/store_mla.h).
#include "tokens.cuh"

KVW_LAUNCH(StoreMLAParams)
