// kvwrite C++/CUDA kernels: shared basics (host + device).
//
// Every header under csrc/kvwrite/ is plain C++ that nvcc and the host compiler both accept:
// the functions are KVW_HD (__host__ __device__ under nvcc), so the CUDA kernels (.cu units) and
// the CPU kernels (csrc/ops.cpp) run the same addressing, loc resolution, checks and quantisation.
// No torch header is included here.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define KVW_HD __host__ __device__ __forceinline__
#define KVW_HOT KVW_HD
#define KVW_COLD KVW_HD
#define KVW_UNROLL _Pragma("unroll")
#else
#define KVW_HD inline
// Host: a per-token step always inlined (KVW_HOT), its rare branch kept out of the loop (KVW_COLD);
// on the device both are KVW_HD, as before.
#define KVW_HOT inline __attribute__((always_inline))
#define KVW_COLD __attribute__((noinline, cold))
#define KVW_UNROLL
#endif

namespace kvwrite {

using i64 = int64_t;

// The check modes (same codes as kvwrite.validate.CHECK_MODES); kernels take them as template
// parameters, so `off` carries no check code at all.
enum Check : int { CHECK_OFF = 0, CHECK_ASSERT = 1, CHECK_GUARD = 2 };

// Input element types (raw bits are read, so no half/bfloat16 type is needed on the host).
enum class DType : int { F32 = 0, F16 = 1, BF16 = 2, U8 = 3, E4M3 = 4, E5M2 = 5, E4M3FNUZ = 6 };

KVW_HD int dtype_size(DType t) {
  return t == DType::F32 ? 4 : (t == DType::F16 || t == DType::BF16) ? 2 : 1;
}

KVW_HD float bits_to_float(uint32_t u) {
  float f;
  memcpy(&f, &u, 4);
  return f;
}

KVW_HD uint32_t float_to_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  return u;
}

// IEEE half -> float, exact (subnormals, inf, nan).
KVW_HD float half_to_float(uint16_t h) {
  uint32_t sign = uint32_t(h & 0x8000) << 16;
  uint32_t exp = (h >> 10) & 0x1F;
  uint32_t mant = h & 0x3FF;
  if (exp == 0x1F) return bits_to_float(sign | 0x7F800000u | (mant << 13));
  if (exp != 0) return bits_to_float(sign | ((exp + 112) << 23) | (mant << 13));
  // zero or subnormal: mant * 2^-24, exact in fp32
  float mag = float(mant) * 5.9604644775390625e-08f;
  return bits_to_float(sign | float_to_bits(mag));
}

KVW_HD float bf16_to_float(uint16_t b) { return bits_to_float(uint32_t(b) << 16); }

// Element `i` of a float/half/bfloat16 array as fp32.
template <DType T>
KVW_HD float load_float(const void* p, i64 i) {
  if constexpr (T == DType::F32) {
    return static_cast<const float*>(p)[i];
  } else if constexpr (T == DType::F16) {
    return half_to_float(static_cast<const uint16_t*>(p)[i]);
  } else {
    return bf16_to_float(static_cast<const uint16_t*>(p)[i]);
  }
}

KVW_HD i64 ceil_div(i64 a, i64 b) { return (a + b - 1) / b; }

}  // namespace kvwrite
