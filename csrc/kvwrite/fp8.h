// fp8 rounding by fp32 bit arithmetic (the twin of kernels/_common.fp8_bits): saturate, then
// round to nearest even; bit-identical to torch's `.to(float8_*)` of a finite value on CPU, on
// every backend, and valid on sm_80 (no e4m3 type: the code is stored as a byte).
#pragma once

#include "common.h"

namespace kvwrite {

KVW_HD float pow2f(int e) { return bits_to_float(uint32_t(e + 127) << 23); }  // normal range only

// A storage format: MANT mantissa bits, smallest normal exponent EMIN; FNUZ: e4m3fnuz-style
// (bias 8, NaN 0x80, no -0, no inf).
template <int MANT, int EMIN, bool FNUZ = false>
struct Fp8Format {
  static constexpr int mant = MANT, emin = EMIN;
  static constexpr bool fnuz = FNUZ;
};
using E4M3 = Fp8Format<3, -6>;            // float8_e4m3fn, max 448, NaN 0x7F
using E5M2 = Fp8Format<2, -14>;           // float8_e5m2, max 57344, NaN 0x7F
using E4M3FNUZ = Fp8Format<3, -7, true>;  // float8_e4m3fnuz, max 240, NaN 0x80

template <class F>
KVW_HD float fp8_max() {
  return F::fnuz ? 240.0f : (F::mant == 3 ? 448.0f : 57344.0f);
}

// The special-value policy (README "Special values"; twins: kernels/_common.py, reference/quant.py).
// Inputs with an fp32-subnormal magnitude are read as a zero of the same sign (`daz`): a GPU
// that flushes subnormals and a CPU then give the same bytes.
KVW_HD float daz(float x) {
  const uint32_t u = float_to_bits(x);
  return (u & 0x7F800000u) == 0 ? bits_to_float(u & 0x80000000u) : x;
}

// |x| for finite x, else 0: block amax is taken over the finite values only.
KVW_HD float finite_abs(float x) {
  const float a = x < 0 ? -x : x;
  return a <= 3.4028234663852886e38f ? a : 0.0f;
}

// fp8 code of saturate(x), RNE: NaN -> the format's one NaN code (0x7F; fnuz 0x80), whatever
// its sign; +-inf and overflow -> +-max; -0 -> 0x80 (fnuz: 0x00, as every result rounding to 0).
template <class F>
KVW_HD uint8_t fp8_bits(float x) {
  constexpr int MANT = F::mant, EMIN = F::emin;
  const float fmax = fp8_max<F>();
  const bool nan = x != x;  // selected at the end, no early return: the loop stays vectorisable
  x = x < -fmax ? -fmax : (x > fmax ? fmax : x);
  const uint32_t xbits = float_to_bits(x);
  const float ax = x < 0 ? -x : x;
  const uint32_t bits = xbits & 0x7FFFFFFFu;
  constexpr int drop = 23 - MANT;
  constexpr uint32_t half = (1u << (drop - 1)) - 1;
  int32_t normal = int32_t((bits + half + ((bits >> drop) & 1u)) >> drop);  // RNE; carry bumps exp
  constexpr int bias = 1 - EMIN;
  normal -= (127 - bias) << MANT;
  const float smallest_normal = pow2f(EMIN);
  const float magic = pow2f(EMIN - MANT + 23);  // fp32 add rounds to the subnormal step
  const float tiny = ax < smallest_normal ? ax : smallest_normal;
  float rounded = (tiny + magic) - magic;
  const int32_t subnormal = int32_t(rounded * pow2f(MANT - EMIN));
  const int32_t code = ax < smallest_normal ? subnormal : normal;
  // NaN and fnuz zero selected here, no early return: the loop stays vectorisable.
  const uint8_t signed_code = F::fnuz && code == 0 ? uint8_t(0) : uint8_t(code | ((xbits >> 24) & 0x80));
  return nan ? (F::fnuz ? uint8_t(0x80) : uint8_t(0x7F)) : signed_code;
}

// e4m3fn code -> float (exact).
KVW_HD float e4m3_to_float(uint8_t c) {
  const uint32_t sign = uint32_t(c & 0x80) << 24;
  const int exp = (c >> 3) & 0xF, mant = c & 7;
  if (exp == 0xF && mant == 7) return bits_to_float(sign | 0x7FC00000u);
  float mag = exp == 0 ? float(mant) * pow2f(-9) : bits_to_float(uint32_t(exp - 7 + 127) << 23 | uint32_t(mant) << 20);
  return bits_to_float(sign | float_to_bits(mag));
}

}  // namespace kvwrite
