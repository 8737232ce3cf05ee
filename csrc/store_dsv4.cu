// DeepSeek V4: KV pages, MXFP4 indexer rows, state rows (per-token bodies: kvwrite/store_dsv4.h).
#include "tokens.cuh"

KVW_LAUNCH(StoreDSV4KVParams)
KVW_LAUNCH(StoreMXFP4Params)
KVW_LAUNCH(StoreRowsParams)
