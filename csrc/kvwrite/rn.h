// fp32 arithmetic rounded to nearest even with no fused multiply-add, on both compilers: the
// CUDA intrinsics on the device; plain operators on the host (built with -ffp-contract=off).
// The kernels' quantisers and RoPE use these so every backend equals the torch reference.
#pragma once

#include "common.h"

namespace kvwrite {

#if defined(__CUDA_ARCH__)
KVW_HD float mul_rn(float a, float b) { return __fmul_rn(a, b); }
KVW_HD float add_rn(float a, float b) { return __fadd_rn(a, b); }
KVW_HD float sub_rn(float a, float b) { return __fsub_rn(a, b); }
KVW_HD float div_rn(float a, float b) { return __fdiv_rn(a, b); }
KVW_HD float sqrt_rn(float a) { return __fsqrt_rn(a); }
#else
KVW_HD float mul_rn(float a, float b) { return a * b; }
KVW_HD float add_rn(float a, float b) { return a + b; }
KVW_HD float sub_rn(float a, float b) { return a - b; }
KVW_HD float div_rn(float a, float b) { return a / b; }
KVW_HD float sqrt_rn(float a) { return __builtin_sqrtf(a); }
#endif

}  // namespace kvwrite
