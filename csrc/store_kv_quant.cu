// store_kv into int8 / dynamic-scale caches (per-token body: kvwrite/store_kv_quant.h).
#include "tokens.cuh"

KVW_LAUNCH(StoreKVQuantParams)
