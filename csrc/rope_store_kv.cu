// rope_store_kv: fused RoPE + store (body: kvwrite/rope_store.h; tokens.cuh's block_token_kernel, its
// block barrier separates rotating into the scratch rows from storing them).
#include "tokens.cuh"

KVW_LAUNCH(RopeStoreKVParams)
