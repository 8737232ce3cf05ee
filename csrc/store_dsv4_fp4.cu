// DeepSeek V4 FP4 records (kvwrite/store_dsv4_fp4.h): the plain and the fused RoPE store (its own
// translation unit: the rotation's instantiations compile beside the others).
#include "tokens.cuh"

KVW_LAUNCH(StoreDSV4FP4Params)
KVW_LAUNCH(RopeStoreDSV4FP4Params)
