// store_kv's int4 format (per-token body: kvwrite/kv_int4.h).
#include "tokens.cuh"

KVW_LAUNCH(StoreKVInt4Params)
