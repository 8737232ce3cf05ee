// store_indexer_k's kernels (per-token body: kvwrite/store_indexer_k.h).
#include "tokens.cuh"

KVW_LAUNCH(StoreIndexerKParams)
