// rope_store_kv into int8 / dynamic-scale caches (as rope_store_kv.cu).
#include "tokens.cuh"

KVW_LAUNCH(RopeStoreKVQuantParams)
