// Host x86 AVX-512 lanes (F, BW, VL, DQ, VBMI, GFNI) for the quantised stores' hottest bf16 loops: the
// AVX2 lanes' arithmetic (simd_x86.h) 64 elements a step, selected at run time (simd_level() == 2)
// by the dispatchers at the end of this file, which keep the AVX2 names the stores call. Same
// correctly rounded fp32 operations lane for lane, so the same bytes (bench/simd_check.cpp runs
// both levels); the one exception, int8 codes of a dynamic scale by one FMA a value
// (int8_bf16_run_rf_512), gives the same bytes by the rule proved before it. Zen 4 runs a 512-bit
// op as two 256-bit halves: the gain is fewer instructions (byte tables by vpermi2b, compares into
// masks), not wider ALUs.
#pragma once

#include "simd_x86.h"

#include <initializer_list>
#include <vector>

#if KVW_SIMD_X86
#define KVW_AVX512_FN __attribute__((target("avx2,f16c,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,gfni")))
#define KVW_AVX512 KVW_AVX512_FN inline

namespace kvwrite {

__attribute__((always_inline)) inline bool simd512_ok() { return simd_level() >= 2; }

// 64 bytes of a pool row: a streaming store where dst is a whole line and rows stream (stream.h).
__attribute__((always_inline)) KVW_AVX512 void store_line(char* dst, __m512i v) {
  if (stream_rows() && (reinterpret_cast<uintptr_t>(dst) & 63) == 0) _mm512_stream_si512(reinterpret_cast<__m512i*>(dst), v);
  else _mm512_storeu_si512(dst, v);
}

// packs/packus of two 32-lane word vectors leave the bytes in "pack order": qword 2k holds the
// first vector's elements 8k..8k+7, qword 2k + 1 the second's; this puts them in element order.
KVW_AVX512 __m512i in_order64(__m512i b) {
  return _mm512_permutexvar_epi64(_mm512_setr_epi64(0, 2, 4, 6, 1, 3, 5, 7), b);
}

// 64 bf16 elements from p as four fp32 vectors in unpack order (load_bf16x32's, per 128-bit lane)
// from the two raw loads l0, l1.
KVW_AVX512 void widen_bf16x64(__m512i l0, __m512i l1, __m512 (&x)[4]) {
  const __m512i z = _mm512_setzero_si512();
  x[0] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, l0));
  x[1] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, l0));
  x[2] = _mm512_castsi512_ps(_mm512_unpacklo_epi16(z, l1));
  x[3] = _mm512_castsi512_ps(_mm512_unpackhi_epi16(z, l1));
}

// The byte index vectors: lo / hi byte 2j / 2j + 1 (the words' low / high bytes); dup: every byte
// of a dword its low byte (in-lane).
struct ByteIdx {
  alignas(64) uint8_t lo[64], hi[64], dup[64];
  constexpr ByteIdx() : lo(), hi(), dup() {
    for (int j = 0; j < 64; ++j) lo[j] = uint8_t(2 * j), hi[j] = uint8_t(2 * j + 1), dup[j] = uint8_t(j % 16 & ~3);
  }
};
inline constexpr ByteIdx BYTE_IDX{};

// The max of 32 unsigned 16-bit lanes.
KVW_AVX512 uint32_t hmax_epu16_512(__m512i a) {
  const __m256i f = _mm256_max_epu16(_mm512_castsi512_si256(a), _mm512_extracti64x4_epi64(a, 1));
  const __m128i h = _mm_xor_si128(_mm_max_epu16(_mm256_castsi256_si128(f), _mm256_extracti128_si256(f, 1)), _mm_set1_epi16(-1));
  return 0xFFFFu & ~uint32_t(_mm_cvtsi128_si32(_mm_minpos_epu16(h)));
}

// The max of |x| of a short run (n % 32 == 0: a tile, a head) as raw bf16 bits, and the lane-wise
// minima of |x| (32 words) in `low`; one accumulator each, inlined so that a compile-time n unrolls it.
__attribute__((always_inline)) KVW_AVX512 uint32_t bf16_absrange_raw_512(const uint16_t* p, int n, __m512i& low) {
  const __m512i am = _mm512_set1_epi16(0x7FFF);
  __m512i a = _mm512_and_si512(_mm512_loadu_si512(p), am), b = a;
  for (int j = 32; j < n; j += 32) {
    const __m512i v = _mm512_and_si512(_mm512_loadu_si512(p + j), am);
    a = _mm512_max_epu16(a, v), b = _mm512_min_epu16(b, v);
  }
  low = b;
  return hmax_epu16_512(a);
}
// bf16_absmax_raw of such a run (the minima, unused, are not computed once inlined).
__attribute__((always_inline)) KVW_AVX512 uint32_t bf16_absmax_raw32_512(const uint16_t* p, int n) {
  __m512i low;
  return bf16_absrange_raw_512(p, n, low);
}

KVW_AVX512 __m512 div_cr16(__m512 x, __m512 s, __m512 r) {  // div_cr8's correctly rounded x / s
  const __m512 q = _mm512_mul_ps(x, r);
  return _mm512_fmadd_ps(_mm512_fnmadd_ps(q, s, x), r, q);
}

// grid_codes8 of sixteen magnitudes; `value`, where given, gets the rounded magnitudes (the
// codes' values: t - m is exact).
template <int MANT, int EMIN, bool NAN_HIGH = false>  // grid_codes8's NAN_HIGH
KVW_AVX512 __m512i grid_codes16(__m512 ax, __m512* value = nullptr) {
  constexpr int drop = 23 - MANT, bias = 1 - EMIN;
  __m512i eb = _mm512_max_epi32(_mm512_and_si512(_mm512_castps_si512(ax), _mm512_set1_epi32(0x7F800000)),
                                _mm512_set1_epi32((EMIN + 127) << 23));
  if constexpr (NAN_HIGH) eb = _mm512_min_epi32(eb, _mm512_set1_epi32((127 + 64) << 23));
  const __m512i m = _mm512_add_epi32(eb, _mm512_set1_epi32(drop << 23));
  const __m512 t = _mm512_add_ps(ax, _mm512_castsi512_ps(m));
  if (value != nullptr) *value = _mm512_sub_ps(t, _mm512_castsi512_ps(m));
  const __m512i k = _mm512_sub_epi32(_mm512_castps_si512(t), m);
  return _mm512_add_epi32(k, _mm512_sub_epi32(_mm512_srli_epi32(eb, drop), _mm512_set1_epi32((128 - bias) << MANT)));
}

// fp8_bf16_run_512's codes of the 64 bf16 words l0, l1 (in element order): |x| / s (RF: |x| * r),
// the sign kept; !DYN (a static scale): |x| clamped to vmax, the divisor's sign (flip), NaN -> 0x7F.
template <class F, bool DYN, bool RF>
__attribute__((always_inline)) KVW_AVX512 __m512i fp8_codes64(__m512i l0, __m512i l1, __m512 vs, __m512 vr, __m512 vmax, __m512i flip) {
  const __m512i am = _mm512_set1_epi16(0x7FFF);
  __m512 x[4];
  widen_bf16x64(_mm512_and_si512(l0, am), _mm512_and_si512(l1, am), x);  // |x|
  __m512i c[4];
  for (int k = 0; k < 4; ++k)
    c[k] = grid_codes16<F::mant, F::emin, !DYN>(RF ? _mm512_mul_ps(x[k], vr) : div_cr16(DYN ? x[k] : _mm512_min_ps(vmax, x[k]), vs, vr));
  const __m512i code = _mm512_packus_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]));  // NaN: 255
  __m512i b = _mm512_ternarylogic_epi32(code, _mm512_packs_epi16(l0, l1), _mm512_set1_epi8(char(0x80)), 0xF8);  // | sign
  if constexpr (!DYN) {  // the divisor's sign; a NaN (0xFF) -> 0x7F
    b = _mm512_xor_si512(b, flip);
    b = _mm512_mask_blend_epi8(_mm512_cmpeq_epi8_mask(b, _mm512_set1_epi8(char(0xFF))), b, _mm512_set1_epi8(0x7F));
  }
  return in_order64(b);
}

// fp8_bf16_run_avx2, 64 elements a step (the rest by the AVX2 lanes); returns how many were done.
// RF (a DYN row, n % 64 == 0): the quotient by one multiply, x * r with r = fp8_ds_tab's rf, under
// which the codes are those of the correctly rounded x / s (s unused).
template <class F, bool DYN, bool RF = false>
KVW_AVX512 int fp8_bf16_run_512(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r) {
  static_assert(DYN || !RF, "one multiply a value: dynamic scales' rows only");
  const float as = s < 0 ? -s : s;
  const __m512 vs = _mm512_set1_ps(as), vr = _mm512_set1_ps(r != 0.0f ? r : 1.0f / as);
  const __m512 vmax = _mm512_set1_ps(fp8_max<F>() * as);
  const __m512i flip = _mm512_set1_epi8(char(s < 0 ? 0x80 : 0));
  int j = 0;
  for (; j + 64 <= n; j += 64)
    store_line(dst + j, fp8_codes64<F, DYN, RF>(_mm512_loadu_si512(src + j), _mm512_loadu_si512(src + j + 32), vs, vr, vmax, flip));
  if constexpr (RF) return j;
  return j + fp8_bf16_run_avx2<F, DYN>(src + j, n - j, s, dst + j, r);
}

// fp8_ds_mla's dynamic e4m3 tile scale s = RN(amax / 448) (ds_mla_scale) by one multiply a value:
// for 121 of the 128 bf16 amax mantissas M some rf within 4 ulps of RN(1 / s) gives
// e4m3(RN(x * rf)) = e4m3(RN(x / s)) for every bf16 |x| <= amax (the other 7: RN(x / s) lands
// exactly on an e4m3 tie that x * rf passes by an ulp; they keep the division). Found at E = 127
// (amax in [1, 2)) when first needed (about a millisecond), running the division's and the one
// multiply's lanes (fp8_bf16_run_512 DYN, RF) over every |x| <= amax; for amax =
// (1 + M / 128) 2^(E - 127), E in [FP8DS_TAB_E0, FP8DS_TAB_E0 + FP8DS_TAB_NE) (s normal, in
// cr_div_ok's range), s and rf scale by 2^(E - 127) and 2^(127 - E) exactly and the quotients
// with x / amax, so table[M] serves every E. bench/simd_check.cpp runs every bf16 amax with every
// bf16 |x| <= amax through the lane.
constexpr int FP8DS_TAB_E0 = 96, FP8DS_TAB_NE = 79;
struct Fp8DsTab {
  alignas(64) uint32_t s[128], rf[128];  // rf 0: the division
  // whether the table holds amax bits raw (its exponent byte in [FP8DS_TAB_E0, FP8DS_TAB_E0 + FP8DS_TAB_NE))
  static bool covers(uint32_t raw) { return (raw >> 7) - FP8DS_TAB_E0 < uint32_t(FP8DS_TAB_NE); }
  // RN(amax / 448) for amax bits raw (covers(raw))
  float scale(uint32_t raw) const { return bits_to_float(s[raw & 0x7F] + (((raw >> 7) - 127) << 23)); }
  // its rf (0: the division)
  float recip(uint32_t raw) const { return rf[raw & 0x7F] ? bits_to_float(rf[raw & 0x7F] - (((raw >> 7) - 127) << 23)) : 0.0f; }
};
KVW_AVX512 const Fp8DsTab& fp8_ds_tab() {
  static const Fp8DsTab t = [] {
    Fp8DsTab b;
    std::vector<uint16_t> x(0x4000);  // |x| <= amax < 2
    for (int i = 0; i < 0x4000; ++i) x[i] = uint16_t(i);
    std::vector<char> want(x.size()), got(x.size());
    for (uint32_t m = 0; m < 128; ++m) {
      const uint32_t araw = 0x3F80u | m;
      const int n = int(araw + 64) & ~63;  // every |x| <= amax (then a few above: the same in both)
      const float s = bits_to_float(araw << 16) / 448.0f;
      b.s[m] = float_to_bits(s);
      b.rf[m] = 0;
      fp8_bf16_run_512<E4M3, true>(x.data(), n, s, want.data(), 1.0f / s);
      for (const int d : {0, -1, 1, -2, 2, -3, 3, -4, 4}) {
        const uint32_t rf = float_to_bits(1.0f / s) + uint32_t(d);
        fp8_bf16_run_512<E4M3, true, true>(x.data(), n, s, got.data(), bits_to_float(rf));
        if (std::memcmp(want.data(), got.data(), size_t(araw + 1)) == 0) {
          b.rf[m] = rf;
          break;
        }
      }
    }
    return b;
  }();
  return t;
}

// fp8_ds_mla's tile codes by one byte lookup a value. With amax = (1 + M / 128) 2^(Ea - 127) and
// x = (1 + m / 128) 2^(E - 127), s = RN(amax / 448) and RN(x / s) scale exactly with 2^Ea and
// 2^E, so wherever the e4m3 code of x / s is normal (>= 8) it is U_M[m] + 8 (E - Ea), U_M[m] the
// code at E = Ea (up to 0x86: unbounded above, as |x| <= amax keeps the sum <= 0x7E). The low byte
// of x's bits >> 4 is (E << 3 | m >> 4) mod 256, so code = that byte + t[M][m] - 8 Ea (mod 256),
// t[M][m] = U_M[m] - (m >> 4): one vpermt2b on m (x's low byte: vpermt2b reads 7 index bits). The
// code is normal for every |x| whose bits are at least lo[M] + (Ea - 20) << 7 (the code rises with
// x): a tile with a smaller |x| (a zero among them) takes the arithmetic lanes. Built at Ea = 127
// and checked there against the scalar codes (`ok`); bench/simd_check.cpp runs every bf16 amax.
struct Fp8DsCodes {
  alignas(64) uint8_t t[128][128];
  uint16_t lo[128];
  bool ok = true;
  // the least |x| bits whose code is normal under the scale of amax bits raw
  uint32_t threshold(uint32_t raw) const { return lo[raw & 0x7F] + (((raw >> 7) - 20) << 7); }
};
KVW_AVX512 const Fp8DsCodes& fp8_ds_codes() {
  static const Fp8DsCodes c = [] {
    Fp8DsCodes b;
    for (int M = 0; M < 128; ++M) {
      const float s = bits_to_float(fp8_ds_tab().s[M]);
      int u[128];
      for (int m = 0; m < 128; ++m) {  // at E = Ea - 1: x / s in [112, 448), a normal code
        u[m] = fp8_bits<E4M3>(bf16_to_float(uint16_t(126 << 7 | m)) / s) + 8;
        b.t[M][m] = uint8_t(u[m] - (m >> 4));
      }
      int lo = 21 << 7;  // relative bits (E - Ea + 20) << 7 | m: the first whose code is normal
      for (int r = (21 << 7) - 1; r >= 0 && u[r & 127] + 8 * ((r >> 7) - 20) >= 8; --r) lo = r;
      b.lo[M] = uint16_t(lo);
      for (int r = lo; r <= (20 << 7 | M); ++r) {  // every |x| the lookup codes, at Ea = 127
        const uint32_t x = uint32_t(r + (107 << 7));
        const int want = fp8_bits<E4M3>(bf16_to_float(uint16_t(x)) / s);
        b.ok = b.ok && want == int(uint8_t((x >> 4) + b.t[M][x & 127] - 8 * 127));
      }
    }
    return b;
  }();
  return c;
}

// The lookup's row for amax bits raw in two registers: t[M] + (-8 Ea mod 256).
KVW_AVX512 void fp8_ds_row(const Fp8DsCodes& ct, uint32_t raw, __m512i& t0, __m512i& t1) {
  const __m512i c = _mm512_set1_epi8(char(-8 * int(raw >> 7)));
  t0 = _mm512_add_epi8(_mm512_load_si512(ct.t[raw & 0x7F]), c), t1 = _mm512_add_epi8(_mm512_load_si512(ct.t[raw & 0x7F] + 64), c);
}

// 64 codes of bf16 words l0, l1 by the lookup (t0, t1: fp8_ds_row), signs kept.
KVW_AVX512 __m512i fp8_ds_codes64(__m512i l0, __m512i l1, __m512i t0, __m512i t1) {
  const __m512i lo = _mm512_load_si512(BYTE_IDX.lo), hi = _mm512_load_si512(BYTE_IDX.hi);
  const __m512i e = _mm512_permutex2var_epi8(_mm512_srli_epi16(l0, 4), lo, _mm512_srli_epi16(l1, 4));
  const __m512i m = _mm512_permutex2var_epi8(l0, lo, l1), sign = _mm512_permutex2var_epi8(l0, hi, l1);
  const __m512i code = _mm512_add_epi8(e, _mm512_permutex2var_epi8(t0, m, t1));
  return _mm512_ternarylogic_epi32(code, sign, _mm512_set1_epi8(char(0x80)), 0xF8);  // code | (sign & 0x80)
}

// The e4m3 codes of a dynamic scale's run (n % 32 == 0; every |x| <= amax, raw its bf16 bits) under
// s = RN(amax / 448), fp8_ds_tab's scale of amax: 64 at a time by the lookup (ct.ok) up to the first
// 64 holding an |x| below its threshold, the rest by fp8_bf16_run_512 (one multiply by the table's
// rf, else the division).
__attribute__((always_inline)) KVW_AVX512 void e4m3_lookup_codes_512(const Fp8DsCodes& ct, const uint16_t* __restrict__ x, int n,
                                                                   uint32_t raw, float s, char* __restrict__ dst) {
  const __m512i am = _mm512_set1_epi16(0x7FFF), thr = _mm512_set1_epi16(short(ct.threshold(raw)));  // below: not normal
  __m512i t0, t1;
  fp8_ds_row(ct, raw, t0, t1);
  int j = 0;
  for (; j + 64 <= n; j += 64) {
    const __m512i l0 = _mm512_loadu_si512(x + j), l1 = _mm512_loadu_si512(x + j + 32);
    if ((_mm512_cmplt_epu16_mask(_mm512_and_si512(l0, am), thr) | _mm512_cmplt_epu16_mask(_mm512_and_si512(l1, am), thr)) != 0)
      break;  // the rest of the run by the arithmetic lanes (rows with outliers hold such values throughout)
    store_line(dst + j, fp8_ds_codes64(l0, l1, t0, t1));
  }
  const float rf = fp8_ds_tab().recip(raw);
  if (j < n && rf != 0.0f) j += fp8_bf16_run_512<E4M3, true, true>(x + j, n - j, s, dst + j, rf);
  if (j < n) fp8_bf16_run_512<E4M3, true>(x + j, n - j, s, dst + j, 1.0f / s);
}

// e4m3_lookup_codes_512 for a run's amax bits raw and its dynamic scale s; false (nothing written)
// where s is not fp8_ds_tab's (a floor, the table's exponents) or the lookup failed its check.
KVW_AVX512 bool e4m3_lookup_run_512(const uint16_t* __restrict__ x, int n, uint32_t raw, float s, char* __restrict__ dst) {
  const Fp8DsCodes& ct = fp8_ds_codes();
  if (!ct.ok || !Fp8DsTab::covers(raw) || s != fp8_ds_tab().scale(raw)) return false;
  e4m3_lookup_codes_512(ct, x, n, raw, s, dst);
  return true;
}

// A token's fp8_ds_mla tiles under the plain scale rule (ds_mla_scale: s = RN(amax / 448)):
// `tiles` tiles of `tile` bf16 values (tile % 64 == 0, tiles <= 16), each tile's amax and least
// |x|, then s from fp8_ds_tab (no division), codes by the lookup (fp8_ds_codes) where every code of
// the tile is normal, else by fp8_bf16_run_512's RF lanes (by the division where the table has no
// rf). False (nothing written) where a tile's amax is NaN / inf, outside the table's
// exponents or (as raw bf16 bits) below min_raw (a scale rule with a floor: the indexer's 1e-4).
KVW_AVX512 bool fp8_ds_tiles_512(const uint16_t* x, int tiles, int tile, char* dst, float* scales, uint32_t min_raw = 0) {
  const Fp8DsTab& t = fp8_ds_tab();
  const Fp8DsCodes& ct = fp8_ds_codes();
  uint32_t raw[16], all = 0;  // all: the tiles whose every |x| takes the lookup (bit w)
  for (int w = 0; w < tiles; ++w) {
    __m512i low;
    raw[w] = bf16_absrange_raw_512(x + w * tile, tile, low);
    if (!Fp8DsTab::covers(raw[w]) || raw[w] < min_raw) return false;  // NaN / inf: E = 255
    all |= uint32_t(_mm512_cmplt_epu16_mask(low, _mm512_set1_epi16(short(ct.threshold(raw[w])))) == 0) << w;
  }
  for (int w = 0; w < tiles; ++w) {
    scales[w] = t.scale(raw[w]);
    const uint16_t* xt = x + w * tile;
    char* dt = dst + w * tile;
    if (ct.ok && (all >> w & 1)) {
      __m512i t0, t1;
      fp8_ds_row(ct, raw[w], t0, t1);
      for (int j = 0; j < tile; j += 64)
        store_line(dt + j, fp8_ds_codes64(_mm512_loadu_si512(xt + j), _mm512_loadu_si512(xt + j + 32), t0, t1));
    } else if (t.recip(raw[w]) != 0.0f) {
      fp8_bf16_run_512<E4M3, true, true>(xt, tile, scales[w], dt, t.recip(raw[w]));
    } else {
      fp8_bf16_run_512<E4M3, true>(xt, tile, scales[w], dt, 1.0f / scales[w]);
    }
  }
  return true;
}

// ---- e4m3 codes under a power-of-two scale, in 16-bit lanes ----------------------------------
// |x| / 2^(es - 127) of a bf16 x (es: the scale's exponent byte) is exact: its bits are |x| - (es -
// 127) << 7. At and above e4m3's normal range (exponent field E' = E - es + 7 >= 1) the 7 mantissa
// bits round to 3, nearest even, the carry running into the exponent; below it (|x| / s < 2^-6)
// the significand 128 | M shifts right by 5 - E' (at most 10: 9 or more leaves 0), nearest even.
// Thirty-two codes without sign from a = |x| (a word each); the caller keeps |x| / s <= 448.
KVW_AVX512 __m512i e4m3_pow2_codes32(__m512i a, __m512i bias, int es) {
  const __m512i one = _mm512_set1_epi16(1), t = _mm512_sub_epi16(a, bias);  // E' << 7 | M (E' <= 0: t < 128)
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi16(t, 4), one);
  __m512i code = _mm512_srli_epi16(_mm512_add_epi16(_mm512_add_epi16(t, _mm512_set1_epi16(7)), lsb), 4);
  const __mmask32 sub = _mm512_cmplt_epi16_mask(t, _mm512_set1_epi16(1 << 7));
  if (sub != 0) {
    const __m512i v = _mm512_or_si512(_mm512_and_si512(a, _mm512_set1_epi16(0x7F)), _mm512_set1_epi16(0x80));
    const __m512i sh = _mm512_min_epi16(_mm512_sub_epi16(_mm512_set1_epi16(int16_t(es - 2)), _mm512_srli_epi16(a, 7)),
                                        _mm512_set1_epi16(10));
    const __m512i q = _mm512_srlv_epi16(v, sh), unit = _mm512_sllv_epi16(one, sh);
    const __m512i rem = _mm512_and_si512(v, _mm512_sub_epi16(unit, one)), half = _mm512_srli_epi16(unit, 1);
    const __mmask32 up = _mm512_cmpgt_epu16_mask(rem, half) | (_mm512_cmpeq_epi16_mask(rem, half) & _mm512_test_epi16_mask(q, one));
    code = _mm512_mask_mov_epi16(code, sub, _mm512_mask_add_epi16(q, up, q, one));
  }
  return code;
}

// The e4m3 codes of n bf16 values (n % 64 == 0) from x divided by 2^(es - 127), signs kept, to dst:
// e4m3_pow2_codes32, no fp32 arithmetic (so no MXCSR dependence), the same bytes as RN(x / s).
KVW_AVX512 void e4m3_pow2_run_512(const uint16_t* __restrict__ x, int n, int es, char* __restrict__ dst) {
  const __m512i bias = _mm512_set1_epi16(int16_t((es - 7) << 7)), am = _mm512_set1_epi16(0x7FFF);
  for (int j = 0; j < n; j += 64) {
    __m512i c[2];
    for (int h = 0; h < 2; ++h) {
      const __m512i v = _mm512_loadu_si512(x + j + 32 * h);
      c[h] = _mm512_ternarylogic_epi32(e4m3_pow2_codes32(_mm512_and_si512(v, am), bias, es), _mm512_srli_epi16(v, 8),
                                       _mm512_set1_epi16(0x80), 0xF8);  // code | (sign & 0x80)
    }
    _mm512_storeu_si512(dst + j, in_order64(_mm512_packus_epi16(c[0], c[1])));  // plain: the records never stream
  }
}

// The exponent byte of max(ue8m0_ceil(RN(amax / 448)), floor) for a finite bf16 amax (raw bits)
// and the floor's exponent byte, without the division: amax / 448 = (1 + m / 128) / 1.75 2^(E - 135)
// lies above 2^(E - 135) iff m > 96 (m = 96: exactly on it; RN moves no other m across it), and
// ue8m0_ceil commutes with the max. bench/simd_check.cpp runs every bf16 amax through the three
// rules that take it (dsv4_scale, indexer_scale ue8m0, ds_mla_scale_pow2).
inline int pow2_448_exponent(uint32_t raw, int floor_e) {
  const int e = int(raw >> 7) - 8 + int((raw & 0x7F) > 96);
  return e > floor_e ? e : floor_e;
}

// The e4m3 codes of `tiles` tiles of `tile` bf16 values (tile % 64 == 0, tiles <= 16) from x, each
// under its power-of-two scale s = scale_of(amax), a rule max(ue8m0_ceil(RN(amax / 448)), floor)
// (so no code saturates; s by pow2_448_exponent, floor = scale_of(0)), given to put_scale(w, s):
// every tile's amax first, then scales and codes by e4m3_pow2_run_512. False (nothing written)
// where a tile holds a NaN or an inf: the caller's tile loop handles those.
template <class ScaleOf, class PutScale>
KVW_AVX512 bool e4m3_pow2_tiles_512(const uint16_t* x, int tiles, int tile, ScaleOf&& scale_of, char* dst,
                                    PutScale&& put_scale) {
  uint32_t raw[16];
  for (int w = 0; w < tiles; ++w)
    if ((raw[w] = bf16_absmax_raw32_512(x + w * tile, tile)) > 0x7F7Fu) return false;
  const int floor_e = int(float_to_bits(scale_of(0.0f)) >> 23);
  for (int w = 0; w < tiles; ++w) {
    const int es = pow2_448_exponent(raw[w], floor_e);
    put_scale(w, bits_to_float(uint32_t(es) << 23));
    e4m3_pow2_run_512(x + w * tile, tile, es, dst + w * tile);
  }
  return true;
}

// int8_bf16_run_avx2, 64 elements a step.
KVW_AVX512 int int8_bf16_run_512(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r) {
  const __m512 vs = _mm512_set1_ps(s), vr = _mm512_set1_ps(r != 0.0f ? r : 1.0f / s);
  int j = 0;
  for (; j + 64 <= n; j += 64) {
    __m512 x[4];
    widen_bf16x64(_mm512_loadu_si512(src + j), _mm512_loadu_si512(src + j + 32), x);
    __m512i c[4];
    for (int k = 0; k < 4; ++k) c[k] = _mm512_cvtps_epi32(div_cr16(x[k], vs, vr));
    store_line(dst + j, in_order64(_mm512_packs_epi16(_mm512_packs_epi32(c[0], c[1]), _mm512_packs_epi32(c[2], c[3]))));
  }
  return j + int8_bf16_run_avx2(src + j, n - j, s, dst + j, r);
}

// ---- int8 codes of a dynamic scale's row by one FMA a value -------------------------------------
// For s = RN(amax / 127) (amax a normal bf16, s above the floor) and |x| <= amax (bf16), the code
// RNE(RN(x / s)) is RNE(x * rf) (the exact product rounded once to an integer) for an fp32 rf near
// 1 / s: with A = amax / 127 (real), q = x / A = 127 m 2^g / M (x = m 2^(g + e), amax = M 2^e,
// M in [128, 256), m < 256 integers, g <= 0) is a rational of denominator 2M, so a q that is not a
// half-integer h is at least 2^(g-9) from every h (|127 m 2^(g+1) - (2k+1) M| >= 2^min(g+1, 0)),
// while |q| < 2^(g+8) and both RN(x / s) and x * rf are within |q| (2^-23 + |rf s - 1|) (1 + 2^-23)
// of q: below 2^(g-11) for |rf s - 1| <= 2^-20. So RN(x / s) and x * rf lie strictly between the
// same two half-integers, and round to the same integer. A q that is a half-integer: 127 m 2^(g+1)
// = (2k+1) M, 127 prime, |h| < 127.5, so 2k + 1 = +-127 (x = +-amax / 2, h = +-63.5) or 127 | M
// (M = 254: s is a power of two, 1 / s exact, x * rf = x / s). So the one value to settle is
// amax / 2: int8_fast_recip takes rf = RN(127 / amax) (within 2^-23 of 1 / s) where its code is
// RNE(RN((amax / 2) / s)), else the next fp32 towards it (one ulp settles every bf16 amax the rule
// covers; both are checked, and neither: rf = 0, the exact lanes); -amax / 2 follows by symmetry.
// bench/simd_check.cpp checks every bf16 amax with every |x| <= amax. The code is the low byte of
// x * rf + 1.5 * 2^23.
constexpr float INT8_MAGIC = 12582912.0f;  // 1.5 * 2^23: an fp32 in [2^23, 2^24) holds an integer

// int8_fast_recip of 4 rows (amax: policy amax values, s their dynamic scales; rows with s at the
// floor get 0). No step waits on a division by s: RN(127 / amax) is divided beside s, and
// RNE(RN((amax / 2) / s)) is 64 iff (amax / 2) / s >= 63.5 - 2^-19 (RN's midpoint below 63.5 rounds
// to 63.5, an even mantissa), i.e. iff 127 s - amax <= 2^-18 s, with 127 s - amax exact by one FMA
// (a multiple of s's ulp, at most 64 of them); else 63.
KVW_AVX512 __m128 int8_fast_recip4(__m128 amax, __m128 s, float floor) {
  const __m128 half = _mm_mul_ps(amax, _mm_set1_ps(0.5f)), c = _mm_set1_ps(INT8_MAGIC);
  const __m128 r = _mm_div_ps(_mm_set1_ps(127.0f), amax);
  const __mmask8 up = _mm_cmp_ps_mask(_mm_fmsub_ps(_mm_set1_ps(127.0f), s, amax), _mm_mul_ps(s, _mm_set1_ps(0x1p-18f)), _CMP_LE_OQ);
  const __m128 want = _mm_mask_blend_ps(up, _mm_set1_ps(63.0f), _mm_set1_ps(64.0f));
  const auto code = [&](__m128 rf) KVW_AVX512_FN { return _mm_sub_ps(_mm_fmadd_ps(half, rf, c), c); };
  const __m128 got = code(r);
  const __m128i step = _mm_mask_blend_epi32(up, _mm_set1_epi32(-1), _mm_set1_epi32(1));
  const __m128 r1 = _mm_castsi128_ps(_mm_add_epi32(_mm_castps_si128(r), step));  // r > 0: the next fp32 towards want
  const __mmask8 ok = _mm_cmp_ps_mask(s, _mm_set1_ps(floor), _CMP_GT_OQ);
  const __mmask8 at_r = _mm_mask_cmp_ps_mask(ok, got, want, _CMP_EQ_OQ);
  const __mmask8 at_r1 = _mm_mask_cmp_ps_mask(ok & ~at_r, code(r1), want, _CMP_EQ_OQ);
  return _mm_mask_mov_ps(_mm_maskz_mov_ps(at_r1, r1), at_r, r);
}

// rf for int8_bf16_run_rf of a row with amax `amax` (policy amax: finite, >= 0) and its dynamic
// scale s; 0 where the rule above does not apply: the caller takes int8_bf16_run.
KVW_AVX512 float int8_fast_recip(float amax, float s, float floor) {
  return _mm_cvtss_f32(int8_fast_recip4(_mm_set1_ps(amax), _mm_set1_ps(s), floor));
}

// int8_fast_recip for 8 rows from their bf16_absmax_raw bits and dynamic_scales8's s (no NaN /
// inf: dynamic_scales8 passed).
KVW_AVX512 void int8_fast_recips8(const uint32_t* raw, const float* s, float floor, float* rf) {
  for (int k = 0; k < 8; k += 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(raw + k));
    const __m128 amax = _mm_castsi128_ps(_mm_and_si128(_mm_slli_epi32(b, 16), _mm_cmpgt_epi32(b, _mm_set1_epi32(0x7F))));
    _mm_storeu_ps(rf + k, int8_fast_recip4(amax, _mm_loadu_ps(s + k), floor));
  }
}

// The dynamic int8 scale and int8_fast_recip's rf by table, no division: for a bf16 amax
// (1 + M / 128) 2^(E - 127) with E in [INT8_TAB_E0, INT8_TAB_E0 + INT8_TAB_NE), s = RN(amax / 127)
// and RN(127 / amax) are the E = 127 values scaled by 2^(E - 127) and 2^(127 - E) exactly (all
// normal; 2^-12 / 127 <= s < 2^46 / 127: above the floor, below cr_div_ok's 2^40), and int8_fast_recip's
// tests (the amax / 2 code, 127 s - amax against 2^-18 s) scale with them: so s and rf are
// table[M] with E - 127 added to / taken from the exponent bits. A table entry with rf = 0 (the rule
// declined; none does) leaves the row to int8_fast_recip. bench/simd_check.cpp compares both with
// dynamic_scale / int8_fast_recip over every bf16 amax.
constexpr int INT8_TAB_E0 = 115, INT8_TAB_NE = 58;
struct Int8ScaleTab {
  alignas(64) uint32_t s[128], rf[128];
};
KVW_AVX512 const Int8ScaleTab& int8_scale_tab() {
  static const Int8ScaleTab t = [] {
    Int8ScaleTab b;
    for (int m = 0; m < 128; ++m) {
      const float amax = bits_to_float(0x3F800000u | uint32_t(m) << 16), s = amax / 127.0f;  // E = 127: above any floor
      b.s[m] = float_to_bits(s);
      b.rf[m] = float_to_bits(int8_fast_recip(amax, s, 0.0f));
    }
    return b;
  }();
  return t;
}

// dynamic_scale<Int8Fmt> and int8_fast_recip of a row from its bf16_absmax_raw bits; false
// (nothing written) where its E is outside the table or its rf entry is 0.
KVW_AVX512 bool int8_scale_tab1(uint32_t raw, float& s, float& rf) {
  const Int8ScaleTab& t = int8_scale_tab();
  const uint32_t e = raw >> 7, m = raw & 0x7F;
  if (e - INT8_TAB_E0 >= uint32_t(INT8_TAB_NE) || t.rf[m] == 0) return false;
  s = bits_to_float(t.s[m] + ((e - 127) << 23));
  rf = bits_to_float(t.rf[m] - ((e - 127) << 23));
  return true;
}

// int8 codes RNE(x / s) of a row under int8_fast_recip's rule (rf from it, n % 64 == 0): one FMA
// per value, the code the low byte of x * rf + 1.5 * 2^23. 32 bf16 a load, widened as the even
// elements (the words shifted up) and the odd ones (the high words masked), no unpacks; the codes
// gathered back in element order by one vpermt2b a load.
KVW_AVX512 __m512i int8_rf_gather_idx() {
  // byte p (and p + 32): element e = p % 32, the low byte of dword e / 2 of the even (e even) or
  // the odd (index + 64) vector
  alignas(64) static constexpr struct Low {
    uint8_t i[64];
    constexpr Low() : i() {
      for (int p = 0; p < 64; ++p) i[p] = uint8_t((p % 2) * 64 + 4 * (p % 32 / 2));
    }
  } low;
  return _mm512_load_si512(low.i);
}
KVW_AVX512 __m512i int8_rf_codes32(__m512i l, __m512 vr, __m512i idx) {
  const __m512 c = _mm512_set1_ps(INT8_MAGIC);
  const __m512 even = _mm512_castsi512_ps(_mm512_slli_epi32(l, 16));
  const __m512 odd = _mm512_castsi512_ps(_mm512_and_si512(l, _mm512_set1_epi32(int(0xFFFF0000u))));
  return _mm512_permutex2var_epi8(_mm512_castps_si512(_mm512_fmadd_ps(even, vr, c)), idx,
                                  _mm512_castps_si512(_mm512_fmadd_ps(odd, vr, c)));
}
KVW_AVX512 void int8_rf_step(const uint16_t* __restrict__ src, char* __restrict__ dst, __m512 vr, __m512i idx) {
  const __m512i a = int8_rf_codes32(_mm512_loadu_si512(src), vr, idx), b = int8_rf_codes32(_mm512_loadu_si512(src + 32), vr, idx);
  store_line(dst, _mm512_mask_blend_epi8(0xFFFFFFFF00000000ull, a, b));  // elements 0-31 | 32-63
}
KVW_AVX512 void int8_bf16_run_rf_512(const uint16_t* __restrict__ src, int n, char* __restrict__ dst, float rf) {
  const __m512i idx = int8_rf_gather_idx();
  const __m512 vr = _mm512_set1_ps(rf);
  for (int j = 0; j < n; j += 64) int8_rf_step(src + j, dst + j, vr, idx);
}

// One (side, head) run of a per token-head int8 / e4m3 token: its bf16 source, its codes, its scale.
struct HeadRun {
  const uint16_t* src;
  char* dst;
  float* scale;
};

// Per token-head int8 of n runs of D bf16 values (D % 64 == 0, n <= 64), each by its own dynamic
// scale and rf from table (int8_scale_tab1) and int8_bf16_run_rf's codes; the next run's amax is
// taken one run ahead, so that its load-and-reduce chain runs beside this run's codes. Returns
// the runs left undone (bit u: run u's amax is outside the table: NaN / inf, tiny, huge). D0: D
// at compile time (the loops unrolled), 0: D at run time.
template <int D0>
KVW_AVX512 uint64_t int8_head_runs_512(const HeadRun* r, int n, int d) {
  const int D = D0 != 0 ? D0 : d;
  const __m512i idx = int8_rf_gather_idx();
  uint64_t left = 0;
  uint32_t next = bf16_absmax_raw32_512(r[0].src, D);
  for (int u = 0; u < n; ++u) {
    const uint32_t raw = next;
    if (u + 1 < n) next = bf16_absmax_raw32_512(r[u + 1].src, D);
    float s, rf;
    if (!int8_scale_tab1(raw, s, rf)) {
      left |= 1ull << u;
      continue;
    }
    *r[u].scale = s;
    const __m512 vr = _mm512_set1_ps(rf);
    for (int j = 0; j < D; j += 64) int8_rf_step(r[u].src + j, r[u].dst + j, vr, idx);
  }
  return left;
}

// The same for e4m3 under the dynamic scale max(RN(amax / 448), floor): each run's scale from
// fp8_ds_tab and its codes by e4m3_lookup_codes_512 (the division lanes where the lookup failed its
// check); left: a run whose scale is not the table's (NaN / inf, the floor, the table's exponents).
template <int D0>
KVW_AVX512 uint64_t e4m3_head_runs_512(const HeadRun* r, int n, int d, float floor) {
  const int D = D0 != 0 ? D0 : d;
  const Fp8DsTab& t = fp8_ds_tab();
  const Fp8DsCodes& ct = fp8_ds_codes();
  uint64_t left = 0;
  uint32_t next = bf16_absmax_raw32_512(r[0].src, D);
  for (int u = 0; u < n; ++u) {
    const uint32_t raw = next;
    if (u + 1 < n) next = bf16_absmax_raw32_512(r[u + 1].src, D);
    const float s = t.scale(raw);
    if (!Fp8DsTab::covers(raw) || s < floor) {
      left |= 1ull << u;
      continue;
    }
    *r[u].scale = s;
    if (ct.ok) {
      e4m3_lookup_codes_512(ct, r[u].src, D, raw, s, r[u].dst);
    } else {
      fp8_bf16_run_512<E4M3, true>(r[u].src, D, s, r[u].dst, 1.0f / s);
    }
  }
  return left;
}

// bf16_absmax_raw_avx2: the max of the |x| bits over n elements (n % 16 == 0), 64 a step.
KVW_AVX512 uint32_t bf16_absmax_raw_512(const uint16_t* p, int n) {
  const __m512i m = _mm512_set1_epi16(0x7FFF);
  __m512i a = _mm512_setzero_si512(), b = a;
  int j = 0;
  for (; j + 64 <= n; j += 64) {
    a = _mm512_max_epu16(a, _mm512_and_si512(_mm512_loadu_si512(p + j), m));
    b = _mm512_max_epu16(b, _mm512_and_si512(_mm512_loadu_si512(p + j + 32), m));
  }
  for (; j < n; j += 16)  // masked loads read nothing past the run
    a = _mm512_max_epu16(a, _mm512_and_si512(_mm512_maskz_loadu_epi16(0xFFFFu, p + j), m));
  return hmax_epu16_512(_mm512_max_epu16(a, b));
}

// bf16_absmax_raw8_avx2, n % 32 == 0, 32 a step: each run read start to end (one stream at a time,
// not eight interleaved), its 512-bit max folded to 256 bits, then the same max tree for the eight.
KVW_AVX512 void bf16_absmax_raw8_512(const uint16_t* p, i64 stride, int n, uint32_t* raw) {
  const __m512i m = _mm512_set1_epi16(0x7FFF);
  __m256i a[8];
  for (int k = 0; k < 8; ++k) {
    const uint16_t* q = p + k * stride;
    __m512i acc = _mm512_and_si512(_mm512_loadu_si512(q), m);
    for (int j = 32; j < n; j += 32) acc = _mm512_max_epu16(acc, _mm512_and_si512(_mm512_loadu_si512(q + j), m));
    a[k] = _mm256_max_epu16(_mm512_castsi512_si256(acc), _mm512_extracti64x4_epi64(acc, 1));
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(raw), hmax16x8(a));
}

// fp8_bf16_table_run_avx2, 64 elements a step (n % 64 == 0; else the AVX2 lanes), in "order O"
// (qword q: elements 4q..4q+3, then 32 + 4q..32 + 4q + 3; one vpermb puts the codes in order):
// E by two vpmultishiftqb (each word's bits 7..14), m and the sign byte by vpermt2b of the raw
// words, the code of a binade-W mantissa by one 128-entry lookup (Fp8Table::code; vpermt2b reads
// 7 index bits, so m's byte needs no mask), E8 = STEP * (E -sat Z) mod 256 (one GF2P8AFFINEQB
// shifts each byte; TH: the first E - Z whose STEP multiple leaves a byte: a lane at or past TH
// is in a redone block, below, so its wrapped E8 never reaches a stored byte). A block
// with a binade in fp8's subnormal range (1 <= E - Z <= KF / STEP) is coded by the binades' own
// tables (Fp8Table::sub, one masked lookup for each binade present) in the loop; a block with
// E - Z >= TH (NaN, inf, a quotient past the table) is redone by fp8_table_redo, as is a flagged
// block when the table has no sub tables. Integer lanes only: no MXCSR dependence.
template <class F>
KVW_AVX512 void fp8_bf16_table_run_512(const Fp8Table& t, float s, const uint16_t* __restrict__ src, int n,
                                       char* __restrict__ dst) {
  if (n % 64 != 0) return fp8_bf16_table_run_avx2<F>(t, s, src, n, dst);
  constexpr uint8_t CMAX = F::mant == 3 ? 0x7E : 0x7B;
  constexpr int TH = (255 + (1 << F::mant) - 1) >> F::mant;
  alignas(64) static constexpr struct Order {  // constexpr: no guard to test on every call
    uint8_t m[64], out[64];  // m: the words' low bytes in order O (byte + 1: their high bytes); out: O -> elements
    constexpr Order() : m(), out() {
      for (int j = 0; j < 64; ++j) m[j] = uint8_t(j % 8 < 4 ? 2 * (j / 8 * 4 + j % 8) : 64 + 2 * (j / 8 * 4 + j % 8 - 4));
      for (int e = 0; e < 64; ++e) out[e] = uint8_t(8 * (e % 32 / 4) + 4 * (e / 32) + e % 4);
    }
  } order;
  const __m512i tab0 = _mm512_loadu_si512(t.code), tab1 = _mm512_loadu_si512(t.code + 64);
  const __m512i im = _mm512_load_si512(order.m), ih = _mm512_add_epi8(im, _mm512_set1_epi8(1));
  const __m512i iout = _mm512_load_si512(order.out), ectl = _mm512_set1_epi64(0x3727170737271707ll);
  const __m512i z = _mm512_set1_epi8(char(t.zstep >> F::mant));
  const __m512i shl = _mm512_set1_epi64(F::mant == 3 ? 0x0000000102040810ll : 0x0000010204081020ll);
  const __m512i k = _mm512_set1_epi8(char(t.k)), cmax = _mm512_set1_epi8(char(CMAX)), one = _mm512_set1_epi8(1);
  const __m512i kfu = _mm512_set1_epi8(char(t.kf >> F::mant)), smask = _mm512_set1_epi8(char(0x80));
  const auto u_of = [&](const uint16_t* x) KVW_AVX512_FN {  // E -sat Z, order O
    const __m512i e = _mm512_multishift_epi64_epi8(ectl, _mm512_loadu_si512(x));
    return _mm512_subs_epu8(_mm512_mask_multishift_epi64_epi8(e, 0xF0F0F0F0F0F0F0F0ull, ectl, _mm512_loadu_si512(x + 32)), z);
  };
  const auto run = [&](auto neg) KVW_AVX512_FN {  // the divisor's sign as a type: no test in the loop
    for (int j0 = 0; j0 < n; j0 += 4096) {
      const int nb = (n - j0 < 4096 ? n - j0 : 4096) / 64;
      uint64_t flags[64], any = 0;
      __m512i umax = _mm512_setzero_si512();
      for (int b = 0; b < nb; ++b) {
        const uint16_t* x = src + j0 + 64 * b;
        const __m512i l0 = _mm512_loadu_si512(x), l1 = _mm512_loadu_si512(x + 32), u = u_of(x);
        const __m512i mi = _mm512_permutex2var_epi8(l0, im, l1);
        const __m512i e8 = _mm512_gf2p8affine_epi64_epi8(u, shl, 0);  // u << MANT in each byte
        __m512i code = _mm512_min_epu8(_mm512_subs_epu8(_mm512_adds_epu8(e8, _mm512_permutex2var_epi8(tab0, mi, tab1)), k), cmax);
        uint64_t sub = _mm512_cmplt_epu8_mask(_mm512_sub_epi8(u, one), kfu);  // subnormal-range lanes
        if (__builtin_expect(sub != 0 && t.nsub != 0, 0)) {
          alignas(64) uint8_t ub[64];
          _mm512_store_si512(ub, u);
          for (uint64_t rest = sub; rest != 0;) {  // the binades present (E - Z = i), one lookup each
            const int i = ub[__builtin_ctzll(rest)];
            const __mmask64 in = _mm512_mask_cmpeq_epu8_mask(rest, u, _mm512_set1_epi8(char(i)));
            code = _mm512_mask_mov_epi8(code, in, _mm512_permutex2var_epi8(_mm512_load_si512(t.sub[i - 1]), mi,
                                                                           _mm512_load_si512(t.sub[i - 1] + 64)));
            rest &= ~in;
          }
          sub = 0;  // coded here: nothing to redo
        }
        const __m512i hi = _mm512_permutex2var_epi8(l0, ih, l1);  // sign | E >> 1
        const __m512i b8 = neg ? _mm512_ternarylogic_epi32(code, hi, smask, 0xF2)    // code | (~hi & 0x80)
                               : _mm512_ternarylogic_epi32(code, hi, smask, 0xF8);   // code | (hi & 0x80)
        store_line(dst + j0 + 64 * b, _mm512_permutexvar_epi8(iout, b8));
        umax = _mm512_max_epu8(umax, u);
        flags[b] = sub;
        any |= sub;
      }
      if (__builtin_expect(_mm512_cmpge_epu8_mask(umax, _mm512_set1_epi8(char(TH))) != 0, 0)) {
        for (int b = 0; b < nb; ++b) {
          flags[b] |= _mm512_cmpge_epu8_mask(u_of(src + j0 + 64 * b), _mm512_set1_epi8(char(TH)));
          any |= flags[b];
        }
      }
      if (__builtin_expect(any == 0, 1)) continue;
      stream_fence();  // the streamed codes before their redo
      for (int b = 0; b < nb; ++b)  // order O: each qword's low four bytes are the first half's
        for (int h = 0; h < 2; ++h)
          if (flags[b] & (0x0F0F0F0F0F0F0F0Full << (4 * h))) fp8_table_redo<F>(t, s, src + j0 + 64 * b + 32 * h, dst + j0 + 64 * b + 32 * h);
    }
  };
  return s < 0 ? run(std::true_type{}) : run(std::false_type{});
}

// ---- The lanes of one level, chosen once for a loop of runs ------------------------------------
// Lanes<2>: AVX-512, Lanes<1>: AVX2. with_lanes(f) calls f(Lanes<L>{}) at the level simd_level()
// picks: a token's tile or head loop reads the level once and calls one level's lanes directly
// (inlined where the build allows), not a dispatcher per run.
template <int L>
struct Lanes {
  static constexpr int level = L;
  template <class F, bool DYN = false>
  static int fp8_bf16_run(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r = 0.0f) {
    if constexpr (L == 2) return fp8_bf16_run_512<F, DYN>(src, n, s, dst, r);
    return fp8_bf16_run_avx2<F, DYN>(src, n, s, dst, r);
  }
  // fp8_ds_mla's tiles under the plain scale rule by one multiply a value; false: the AVX2 level,
  // or a tile the table does not take (the caller's general tile loop)
  static bool fp8_ds_tiles(const uint16_t* x, int tiles, int tile, char* dst, float* scales, uint32_t min_raw = 0) {
    if constexpr (L == 2) return fp8_ds_tiles_512(x, tiles, tile, dst, scales, min_raw);
    return false;
  }
  // e4m3 codes of a dynamic scale's run by the lookup (e4m3_lookup_run_512); false: the AVX2 level,
  // or a scale the lookup does not take
  static bool e4m3_lookup_run(const uint16_t* __restrict__ x, int n, uint32_t raw, float s, char* __restrict__ dst) {
    if constexpr (L == 2) return e4m3_lookup_run_512(x, n, raw, s, dst);
    return false;
  }
  static int int8_bf16_run(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r = 0.0f) {
    if constexpr (L == 2) return int8_bf16_run_512(src, n, s, dst, r);
    return int8_bf16_run_avx2(src, n, s, dst, r);
  }
  // int8 under int8_fast_recip's rule: rf (0: the exact lanes) and the codes; AVX-512 only (the
  // AVX2 level returns 0 and keeps int8_bf16_run)
  static float int8_fast_recip(float amax, float s, float floor) {
    if constexpr (L == 2) return kvwrite::int8_fast_recip(amax, s, floor);
    return 0.0f;
  }
  static void int8_fast_recips8(const uint32_t* raw, const float* s, float floor, float* rf) {
    if constexpr (L == 2) return kvwrite::int8_fast_recips8(raw, s, floor, rf);
    for (int k = 0; k < 8; ++k) rf[k] = 0.0f;
  }
  // dynamic_scale and rf by table (int8_scale_tab1); false: the AVX2 level, or a row outside the table
  static bool int8_scale_tab1(uint32_t raw, float& s, float& rf) {
    if constexpr (L == 2) return kvwrite::int8_scale_tab1(raw, s, rf);
    return false;
  }
  static void int8_bf16_run_rf(const uint16_t* __restrict__ src, int n, char* __restrict__ dst, float rf) {
    if constexpr (L == 2) int8_bf16_run_rf_512(src, n, dst, rf);
  }
  static void bf16_absmax_raw8(const uint16_t* p, i64 stride, int n, uint32_t* raw) {  // n % 32 == 0
    if constexpr (L == 2) return bf16_absmax_raw8_512(p, stride, n, raw);
    bf16_absmax_raw8_avx2(p, stride, n, raw);
  }
  // e4m3 tiles under power-of-two scales (e4m3_pow2_tiles_512); false: the AVX2 level, or a NaN / inf
  template <class ScaleOf, class PutScale>
  static bool e4m3_pow2_tiles(const uint16_t* x, int tiles, int tile, ScaleOf&& scale_of, char* dst, PutScale&& put) {
    if constexpr (L == 2) return e4m3_pow2_tiles_512(x, tiles, tile, scale_of, dst, put);
    return false;
  }
  static uint32_t bf16_absmax_raw(const uint16_t* p, int n) {
    if constexpr (L == 2) return bf16_absmax_raw_512(p, n);
    return bf16_absmax_raw_avx2(p, n);
  }
};

template <class Body>
inline decltype(auto) with_lanes(Body&& body) {
  return simd512_ok() ? body(Lanes<2>{}) : body(Lanes<1>{});
}

// ---- Dispatchers for single runs: the AVX-512 lanes where simd_level() says so, else AVX2 -----
template <class F, bool DYN = false>
inline int fp8_bf16_run(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r = 0.0f) {
  return with_lanes([&](auto l) { return l.template fp8_bf16_run<F, DYN>(src, n, s, dst, r); });
}
inline int int8_bf16_run(const uint16_t* __restrict__ src, int n, float s, char* __restrict__ dst, float r = 0.0f) {
  return with_lanes([&](auto l) { return l.int8_bf16_run(src, n, s, dst, r); });
}
inline uint32_t bf16_absmax_raw(const uint16_t* p, int n) {
  return with_lanes([&](auto l) { return l.bf16_absmax_raw(p, n); });
}
template <class ScaleOf, class PutScale>
inline bool e4m3_pow2_tiles(const uint16_t* x, int tiles, int tile, ScaleOf&& scale_of, char* dst, PutScale&& put) {
  return tile % 64 == 0 && tiles <= 16 && with_lanes([&](auto l) { return l.e4m3_pow2_tiles(x, tiles, tile, scale_of, dst, put); });
}
template <class F>
inline void fp8_bf16_table_run(const Fp8Table& t, float s, const uint16_t* __restrict__ src, int n, char* __restrict__ dst) {
  return simd512_ok() ? fp8_bf16_table_run_512<F>(t, s, src, n, dst) : fp8_bf16_table_run_avx2<F>(t, s, src, n, dst);
}

}  // namespace kvwrite
#endif

#include "simd_avx512_fp4.h"
