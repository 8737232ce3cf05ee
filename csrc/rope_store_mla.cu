// rope_store_mla (as rope_store_kv.cu).
#include "tokens.cuh"

KVW_LAUNCH(RopeStoreMLAParams)
