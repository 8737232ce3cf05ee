// Host x86 AVX-512 lanes of the FP4 stores on bf16 rows (NVFP4 blocks of 16 with e4m3 scales, no
// global scale: store_kv_nvfp4, store_mla nvfp4, the DeepSeek V4 / V4.1 NVFP4 records; MXFP4 blocks
// of 32 with ue8m0 scales: the V4 MXFP4 record and the V4 indexer), 64 elements a step, and NVFP4
// by arithmetic (a global scale, fp16 / fp32 rows), selected at run time (simd_level() == 2) by the
// dispatchers at the end; else the AVX2 lanes (simd_x86.h).
//
// e2m1 codes without thresholds a block: the AVX2 lanes count the seven thresholds T = B d below
// |x| (16-bit compares; e2m1_bf16_thresholds says why that is the scalar RN(x / d) rule). With
// d = (1 + m / 8) 2^(E_d - 127) (an e4m3 value: m 3 bits; a power of two: m = 0) the thresholds
// lie in the six binades E_d - 2 .. E_d + 3, at most two in one binade, at the same mantissas
// for every E_d, and M >= 54 (|x|'s 7 mantissa bits) parts any two. So with r = clamp(E - (E_d -
// 3), 0, 7) (E: |x|'s exponent byte; 0: below every threshold, 7: above all) and h = M >= 54,
// code = base[h, m, r] + (M > t[h, m, r]): two 128-entry byte lookups (vpermt2b) and one byte
// compare for 64 elements.
#pragma once

#include "simd_avx512.h"

#if KVW_SIMD_X86
// The table lanes also take VBMI2 (vpshldw) and GFNI (gf2p8affineqb): fp4_512_ok() checks them.
#define KVW_FP4_FN __attribute__((target("avx2,f16c,fma,avx512f,avx512bw,avx512vl,avx512dq,avx512vbmi,avx512vbmi2,gfni")))
#define KVW_FP4 KVW_FP4_FN inline
#endif

#if KVW_SIMD_X86
namespace kvwrite {

// The byte tables: by idx = h << 6 | m << 3 | r (h: |x|'s mantissa M >= 54, which splits every
// binade's at most two thresholds) the base code and the one mantissa threshold th in that part of
// the binade, as 2 th + 1 (the lanes compare M << 1 | sign, the low byte of the bf16 word rotated
// left by one, whose + 20 saturated has bit 7 = h; 255: never passed); by an e4m3 scale code c the
// block's E_d - 3 (255 for d = 0: r = 0, every code the sign alone) and m << 3. Built once from the
// threshold rule in fp32 (exact: B d, |x| have at most 8 significant bits); `ok` false where this
// shape does not hold (never: the lanes then stay AVX2).
struct E2m1Lut {
  alignas(64) uint8_t base[128], t[128], eb[128], mx[128], sc[128];
  bool ok = true;
};

inline uint32_t e2m1_count(float x, float d) {  // the number of thresholds B d below x (x, d > 0)
  static constexpr float B[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  uint32_t c = 0;
  for (int k = 0; k < 7; ++k) c += (k & 1) ? x >= B[k] * d : x > B[k] * d;
  return c;
}

inline E2m1Lut e2m1_lut_build() {
  E2m1Lut t;
  constexpr int S = 54;  // h = M >= S: (M << 1 | sign) + 20 >= 128
  for (int i = 0; i < 128; ++i) {
    const int h = i >> 6, m = i >> 3 & 7, r = i & 7, M0 = h ? S : 0, M1 = h ? 128 : S;
    const float d = 1.0f + float(m) / 8.0f;  // E_d = 127: the binade of r is 124 + r
    uint32_t c[128];
    for (int M = M0; M < M1; ++M) c[M] = e2m1_count(bf16_to_float(uint16_t((124 + r) << 7 | M)), d);
    int th = 127;  // M > th passes the threshold
    for (int M = M0 + 1; M < M1; ++M)
      if (c[M] != c[M - 1]) th == 127 ? void(th = M - 1) : void(t.ok = false);
    t.base[i] = uint8_t(c[M0]);
    t.t[i] = uint8_t(2 * th + 1);
    for (int M = M0; M < M1; ++M) t.ok = t.ok && c[M] == c[M0] + (M > th);
    // r = 0 / 7 also stand for the binades below / above (the clamp): below / above every threshold
    if (r == 0 || r == 7) t.ok = t.ok && t.base[i] == (r ? 7 : 0) && th == 127;
  }
  // The e4m3 scale code of amax / 6 for a bf16 amax with exponent byte E and mantissa M is
  // code(127, M) + 8 (E - 127) wherever that is a normal, unsaturated code (8 .. 0x7E: the fp32
  // division and the e4m3 rounding scale with 2^E): sc[M] = code(127, M) + 8 - (M >> 4), so that
  // (|amax| bits >> 4) + sc[M] = code + 1024.
  for (int M = 0; M < 128; ++M) t.sc[M] = uint8_t(fp8_bits<E4M3>(bf16_to_float(uint16_t(127 << 7 | M)) / 6.0f) + 8 - (M >> 4));
  for (int E = 1; E < 255; ++E)
    for (int M = 0; M < 128; ++M) {
      const int c = (E << 3 | M >> 4) + t.sc[M] - 1024;
      t.ok = t.ok && (c < 8 || c > 0x7E || c == int(fp8_bits<E4M3>(bf16_to_float(uint16_t(E << 7 | M)) / 6.0f)));
    }
  for (int c = 0; c < 128; ++c) {
    const uint32_t b = float_to_bits(e4m3_to_float(uint8_t(c)));
    t.eb[c] = c == 0 ? 255 : c == 0x7F ? 0 : uint8_t((b >> 23) - 3);
    t.mx[c] = uint8_t((b >> 17) & 0x38);
    t.ok = t.ok && (c == 0x7F || (b & 0x1FFFFu) == 0);  // at most 4 significant bits
  }
  return t;
}

inline const E2m1Lut& e2m1_lut() {
  static const E2m1Lut t = e2m1_lut_build();
  return t;
}

// Whether the table lanes run: the AVX-512 level, VBMI2 and GFNI, and the tables' shape.
inline bool fp4_512_ok() {
  static const bool ok = __builtin_cpu_supports("avx512vbmi2") && __builtin_cpu_supports("gfni") && e2m1_lut().ok;
  return simd512_ok() && ok;
}

// The loops' constants in registers: the tables and the byte indices (loads only: cheap for short
// runs).
struct Fp4Consts {
  __m512i base0, base1, t0, t1, eb0, eb1, mx0, mx1, sc0, sc1, lo, hi, dup;
  KVW_FP4_FN explicit Fp4Consts(const E2m1Lut& t)
      : base0(_mm512_load_si512(t.base)), base1(_mm512_load_si512(t.base + 64)), t0(_mm512_load_si512(t.t)),
        t1(_mm512_load_si512(t.t + 64)), eb0(_mm512_load_si512(t.eb)), eb1(_mm512_load_si512(t.eb + 64)),
        mx0(_mm512_load_si512(t.mx)), mx1(_mm512_load_si512(t.mx + 64)), sc0(_mm512_load_si512(t.sc)),
        sc1(_mm512_load_si512(t.sc + 64)), lo(_mm512_load_si512(BYTE_IDX.lo)), hi(_mm512_load_si512(BYTE_IDX.hi)),
        dup(_mm512_load_si512(BYTE_IDX.dup)) {}
};

// The e2m1 codes of 64 bf16 elements (two loads; element order, sign as bit 3) for the per-lane
// E_d - 3 (eb) and m << 3 (mx), then two codes a byte: 32 bytes in the low bytes of the words.
KVW_FP4 __m512i e2m1_pack64(__m512i l0, __m512i l1, __m512i eb, __m512i mx, const Fp4Consts& k) {
  const __m512i d0 = _mm512_shldi_epi16(l0, l0, 1), d1 = _mm512_shldi_epi16(l1, l1, 1);  // rotated: E | M << 1 | sign
  const __m512i e = _mm512_permutex2var_epi8(d0, k.hi, d1), m2 = _mm512_permutex2var_epi8(d0, k.lo, d1);
  const __m512i m20 = _mm512_adds_epu8(m2, _mm512_set1_epi8(20));  // bit 7: M >= 54
  // bit matrices (gf2p8affine: byte 7 - i picks the source bits of result bit i): m20's bit 7 to
  // bit 6 (h); m2's bit 0 (the sign) to bit 3
  const __m512i h = _mm512_gf2p8affine_epi64_epi8(m20, _mm512_set1_epi64(0x8000), 0);
  const __m512i sign = _mm512_gf2p8affine_epi64_epi8(m2, _mm512_set1_epi64(0x0000000100000000ll), 0);
  const __m512i r = _mm512_min_epu8(_mm512_subs_epu8(e, eb), _mm512_set1_epi8(7));
  const __m512i idx = _mm512_ternarylogic_epi32(r, mx, h, 0xFE);  // r | mx | h
  __m512i c = _mm512_or_si512(_mm512_permutex2var_epi8(k.base0, idx, k.base1), sign);
  c = _mm512_mask_add_epi8(c, _mm512_cmpgt_epu8_mask(m2, _mm512_permutex2var_epi8(k.t0, idx, k.t1)), c, _mm512_set1_epi8(1));
  return _mm512_maddubs_epi16(c, _mm512_set1_epi16(0x1001));  // even + 16 odd
}

KVW_FP4 __mmask32 words_mask(int n) { return n >= 32 ? ~__mmask32(0) : n <= 0 ? 0 : (__mmask32(1) << n) - 1; }
KVW_FP4 __mmask64 bytes_mask(int n) { return n >= 64 ? ~__mmask64(0) : n <= 0 ? 0 : (__mmask64(1) << n) - 1; }

// Lane-wise: lane 2i of the result the max of a's lanes (2i, 2i + 1) for i < 2, lanes 2, 3 b's.
KVW_FP4 __m512i max_lane_pairs(__m512i a, __m512i b) {
  return _mm512_max_epu16(_mm512_shuffle_i64x2(a, b, 0x88), _mm512_shuffle_i64x2(a, b, 0xDD));
}

// The maxima of the eight 128-bit lanes of p (blocks 0-3) and q (blocks 4-7), 16-bit unsigned,
// as 8 dwords in block order, shifted right by one (the lanes hold |x| << 1: the result is raw |x|).
KVW_FP4 __m256i lane_max8(__m512i p, __m512i q) {
  const __m512i r = _mm512_max_epu16(_mm512_unpacklo_epi64(p, q), _mm512_unpackhi_epi64(p, q));  // lane i: b_i, b_(i+4)
  const __m512i s = _mm512_max_epu16(r, _mm512_shuffle_epi32(r, _MM_PERM_CDAB));
  const __m512i t = _mm512_max_epu16(s, _mm512_srli_epi32(s, 16));
  const __m512i g = _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 2, 6, 10, 14, 0, 0, 0, 0, 0, 0, 0, 0), t);
  return _mm256_srli_epi32(_mm256_slli_epi32(_mm512_castsi512_si256(g), 16), 17);
}

// The maxima of the sixteen 128-bit lanes of p[0..3] (blocks 4j .. 4j + 3 in p[j]), 16-bit
// unsigned, shifted right by one (raw |x|, as lane_max8), as 16 dwords in step order: lane i,
// dword j holds block 4j + i, so step j's block i sits in the lane its elements fill (one in-lane
// dword shuffle spreads it over them); step_to_block_order (its own inverse) puts them in block order.
KVW_FP4 __m512i lane_max16t(const __m512i (&p)[4]) {
  __m512i r[2];
  for (int h = 0; h < 2; ++h)  // lane i: qword 0 p[2h]'s, qword 1 p[2h + 1]'s four-word maxima
    r[h] = _mm512_max_epu16(_mm512_unpacklo_epi64(p[2 * h], p[2 * h + 1]), _mm512_unpackhi_epi64(p[2 * h], p[2 * h + 1]));
  const __m512 r0 = _mm512_castsi512_ps(r[0]), r1 = _mm512_castsi512_ps(r[1]);  // lane i, dword j: p[j]'s pair
  const __m512i s = _mm512_max_epu16(_mm512_castps_si512(_mm512_shuffle_ps(r0, r1, 0x88)), _mm512_castps_si512(_mm512_shuffle_ps(r0, r1, 0xDD)));
  const __m512i t = _mm512_max_epu16(s, _mm512_srli_epi32(s, 16));
  return _mm512_srli_epi32(_mm512_and_si512(t, _mm512_set1_epi32(0xFFFF)), 1);
}
KVW_FP4 __m512i step_to_block_order(__m512i v) {
  return _mm512_permutexvar_epi32(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), v);
}
// The step-order lanes of the first nb blocks (bit 4i + j: block 4j + i < nb).
constexpr __mmask16 step_order_mask(int nb) {
  unsigned m = 0;
  for (int b = 0; b < nb && b < 16; ++b) m |= 1u << (4 * (b & 3) + (b >> 2));
  return __mmask16(m);
}
// Lane i of the result: dword H of v's lane i in all four dwords (step H's per-block bytes spread
// over the step's lanes).
KVW_FP4 __m512i step_spread(__m512i v, int h) {
  switch (h) {
    case 0: return _mm512_shuffle_epi32(v, _MM_PERM_AAAA);
    case 1: return _mm512_shuffle_epi32(v, _MM_PERM_BBBB);
    case 2: return _mm512_shuffle_epi32(v, _MM_PERM_CCCC);
    default: return _mm512_shuffle_epi32(v, _MM_PERM_DDDD);
  }
}

// Step h (64 elements) of nb <= 16 blocks of 16 from src as two loads; false where it holds no
// block (masked: nothing past the run is read). NB > 0 (a multiple of 4: 16 a whole group, 12 the V4
// record's last): nb == NB known at compile time, plain loads, no tests; NB == 0: nb at run time.
template <int NB>
__attribute__((always_inline)) KVW_FP4 bool step_loads(const uint16_t* src, int nb, int h, __m512i& l0, __m512i& l1) {
  static_assert(NB % 4 == 0 && NB <= 16, "whole steps");
  if (NB > 0) {
    if (4 * h >= NB) return false;
    l0 = _mm512_loadu_si512(src + 64 * h), l1 = _mm512_loadu_si512(src + 64 * h + 32);
    return true;
  }
  if (4 * h >= nb) return false;
  if (4 * h + 4 <= nb) {  // a whole step
    l0 = _mm512_loadu_si512(src + 64 * h), l1 = _mm512_loadu_si512(src + 64 * h + 32);
    return true;
  }
  l0 = _mm512_maskz_loadu_epi16(words_mask(16 * nb - 64 * h), src + 64 * h);
  l1 = _mm512_maskz_loadu_epi16(words_mask(16 * nb - 64 * h - 32), src + 64 * h + 32);
  return true;
}

// Phase 1 of nvfp4_run_512: the scales of nb <= 16 bf16 blocks from src, no global scale: false
// (nothing written) where a block holds a NaN or an inf; else the e4m3 codes to `scales` and each
// block's E_d - 3 and m << 3 (bytes 0..15 of eb, mx).
template <int NB>
__attribute__((always_inline)) KVW_FP4 bool nvfp4_scales16_512(const uint16_t* src, int nb, float floor, const Fp4Consts& k, char* scales, __m512i& eb, __m512i& mx) {
  __m512i p[4], a, b;
  for (int j = 0; j < 4; ++j)
    p[j] = step_loads<NB>(src, nb, j, a, b) ? max_lane_pairs(_mm512_add_epi16(a, a), _mm512_add_epi16(b, b)) : _mm512_setzero_si512();
  const __m512i raw = lane_max16t(p);  // step order
  // the scale codes by the table where all are normal and unsaturated (then s > 2^-7 >= floor),
  // else by the division (a NaN or an inf: false); the code in each dword's low byte
  __m512i codes = _mm512_add_epi32(_mm512_srli_epi32(raw, 4), _mm512_maskz_permutex2var_epi8(0x1111111111111111ull, k.sc0, raw, k.sc1));
  // (only the group's blocks: the empty lanes of a short group, raw 0, would always fail the test)
  const __mmask16 in = step_order_mask(NB > 0 ? NB : nb);
  if (!(floor <= 0.0078125f) || _mm512_mask_cmpgt_epu32_mask(in, _mm512_sub_epi32(codes, _mm512_set1_epi32(1032)), _mm512_set1_epi32(0x7E - 8)) != 0) {
    if (_mm512_cmpgt_epi32_mask(raw, _mm512_set1_epi32(0x7F7F)) != 0) return false;
    const __m512 amax = _mm512_castsi512_ps(_mm512_maskz_slli_epi32(_mm512_cmpgt_epi32_mask(raw, _mm512_set1_epi32(0x7F)), raw, 16));
    const __m512 s = _mm512_max_ps(_mm512_div_ps(amax, _mm512_set1_ps(6.0f)), _mm512_set1_ps(floor));
    codes = grid_codes16<3, -6>(_mm512_min_ps(s, _mm512_set1_ps(448.0f)));
  }
  const __m128i code = _mm512_cvtepi32_epi8(step_to_block_order(codes));
  if (NB == 16) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(scales), code);
  } else if (NB == 12) {  // plain 8 + 4 byte stores (no masked store)
    _mm_storel_epi64(reinterpret_cast<__m128i*>(scales), code);
    _mm_storeu_si32(scales + 8, _mm_srli_si128(code, 8));
  } else {
    _mm_mask_storeu_epi8(scales, __mmask16((1u << nb) - 1), code);  // block order
  }
  // every byte of a dword its code, then its E_d - 3 / m << 3
  const __m512i c = _mm512_shuffle_epi8(codes, k.dup);
  eb = _mm512_permutex2var_epi8(k.eb0, c, k.eb1);
  mx = _mm512_permutex2var_epi8(k.mx0, c, k.mx1);
  return true;
}

// Phase 2: the packed codes of nb <= 16 blocks from src by phase 1's eb, mx.
template <int NB>
__attribute__((always_inline)) KVW_FP4 void nvfp4_codes16_512(const uint16_t* src, int nb, __m512i eb, __m512i mx, const Fp4Consts& k, char* bytes) {
  __m512i w[4], l0, l1;
  for (int h = 0; h < 4; ++h)
    w[h] = step_loads<NB>(src, nb, h, l0, l1)
               ? e2m1_pack64(l0, l1, step_spread(eb, h), step_spread(mx, h), k)
               : _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_permutex2var_epi8(w[2 * h], k.lo, w[2 * h + 1]);
    if (NB > 0 ? 8 * NB >= 64 * h + 64 : 8 * nb >= 64 * h + 64) store_line(bytes + 64 * h, v);
    else if (NB > 0 && 8 * NB == 64 * h + 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(bytes + 64 * h), _mm512_castsi512_si256(v));
    else if (NB == 0 && 8 * h < nb) _mm512_mask_storeu_epi8(bytes + 64 * h, bytes_mask(8 * nb - 64 * h), v);
  }
}

// Phase 2 of one group of nb blocks from block b0: its codes by phase 1's eb, mx where phase 1
// passed (ok), else block by block by the AVX2 lanes (a group holding a NaN or an inf).
template <int NB>
__attribute__((always_inline)) KVW_FP4 void nvfp4_group_512(const uint16_t* x, int b0, int nb, bool ok, __m512i eb, __m512i mx, const Fp4Consts& k, char* bytes, char* scales, float floor) {
  if (ok) return nvfp4_codes16_512<NB>(x + 16 * b0, nb, eb, mx, k, bytes + 8 * b0);
  for (int j = b0; j < b0 + nb; ++j) nvfp4_block_avx2<DType::BF16>(x, 16 * j, nullptr, bytes + 8 * j, scales + j, floor);
}

// A V4 record's 64 bf16 RoPE values from r to dst: two zmm moves (no library call).
KVW_FP4 void copy_rope64(const uint16_t* r, char* dst) {
  _mm512_storeu_si512(dst, _mm512_loadu_si512(r));
  _mm512_storeu_si512(dst + 64, _mm512_loadu_si512(r + 32));
}

// nvfp4_run_avx2 for bf16 rows without a global scale, sixteen blocks a group in two phases, one
// group ahead (a group holding a NaN or an inf: nvfp4_block_avx2 block by block). Whole groups
// without masks: a run of 16 blocks or more ends with the group of its last 16 (the blocks it shares
// with the group before get the same bytes twice); a shorter run is one masked group.
KVW_FP4 void nvfp4_run_512(const uint16_t* x, int nblocks, char* bytes, char* scales, float floor) {
  const Fp4Consts k(e2m1_lut());
  __m512i eb = _mm512_setzero_si512(), mx = eb, eb1 = eb, mx1 = eb;
  if (nblocks < 16) {
    if (nblocks <= 0) return;
    const bool ok = nvfp4_scales16_512<0>(x, nblocks, floor, k, scales, eb, mx);  // before eb, mx are read
    return nvfp4_group_512<0>(x, 0, nblocks, ok, eb, mx, k, bytes, scales, floor);
  }
  bool ok = nvfp4_scales16_512<16>(x, 16, floor, k, scales, eb, mx);
  for (int b = 0; b < nblocks; b += 16) {
    const int b0 = b + 16 <= nblocks ? b : nblocks - 16, b1 = b + 32 <= nblocks ? b + 16 : nblocks - 16;
    const bool next = b + 16 < nblocks && nvfp4_scales16_512<16>(x + 16 * b1, 16, floor, k, scales + b1, eb1, mx1);
    nvfp4_group_512<16>(x, b0, 16, ok, eb, mx, k, bytes, scales, floor);
    ok = next, eb = eb1, mx = mx1;
  }
}

// ---- NVFP4 by arithmetic: a global scale, fp16 / fp32 rows ---------------------------------------
// Sixteen elements from src + i as fp32 bits, as stored (no daz).
template <DType IN>
KVW_AVX512 __m512i load16_bits(const void* src, i64 i) {
  if constexpr (IN == DType::F32) return _mm512_loadu_si512(static_cast<const float*>(src) + i);
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(src) + i));
  if constexpr (IN == DType::F16) return _mm512_castps_si512(_mm512_cvtph_ps(h));
  return _mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16);
}

// The lanes of |x| bits a that nvfp4_block divides: normal and finite, or +-inf (subnormals read
// as +-0, NaN apart).
KVW_AVX512 __mmask16 normal_or_inf16(__m512i a) {
  return _mm512_cmple_epu32_mask(_mm512_sub_epi32(a, _mm512_set1_epi32(0x00800000)), _mm512_set1_epi32(0x7F000000));
}

// The max of each of 16 vectors' dword lanes (unsigned), as one vector (lane b: a[b]): a
// transposing max tree.
KVW_AVX512 __m512i hmax16x16(const __m512i (&a)[16]) {
  __m512i t[8], u[4], w[2];
  for (int k = 0; k < 8; ++k)  // lane i: a[2k], a[2k + 1] pairs (dwords 0 | 2, 1 | 3)
    t[k] = _mm512_max_epu32(_mm512_unpacklo_epi32(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_epi32(a[2 * k], a[2 * k + 1]));
  for (int k = 0; k < 4; ++k)  // lane i, dword j: a[4k + j]'s lane i
    u[k] = _mm512_max_epu32(_mm512_unpacklo_epi64(t[2 * k], t[2 * k + 1]), _mm512_unpackhi_epi64(t[2 * k], t[2 * k + 1]));
  for (int k = 0; k < 2; ++k)  // lanes 0, 1: u[2k] (lanes 0 | 1, 2 | 3), lanes 2, 3: u[2k + 1]
    w[k] = _mm512_max_epu32(_mm512_shuffle_i64x2(u[2 * k], u[2 * k + 1], 0x88), _mm512_shuffle_i64x2(u[2 * k], u[2 * k + 1], 0xDD));
  return _mm512_max_epu32(_mm512_shuffle_i64x2(w[0], w[1], 0x88), _mm512_shuffle_i64x2(w[0], w[1], 0xDD));
}

// nvfp4_block's e2m1 codes of the 16 elements from src + i for the divisor d (finite, >= 0),
// packed (element 2j in the low nibble) into 8 bytes; whether any was NaN. |x| / d by the
// division (the scalar quotient itself), clamped to 6 (inf: 6), grid_codes16; d == 0, subnormal
// x: the sign alone; NaN: 0.
template <DType IN>
KVW_AVX512 bool e2m1_block16(const void* src, i64 i, float d, char* bytes) {
  const __m512i x = load16_bits<IN>(src, i), a = _mm512_and_si512(x, _mm512_set1_epi32(0x7FFFFFFF));
  const __mmask16 div = normal_or_inf16(a) & (d != 0.0f ? 0xFFFF : 0), num = _mm512_cmple_epu32_mask(a, _mm512_set1_epi32(0x7F800000));
  const __m512 y = _mm512_maskz_div_ps(div, _mm512_castsi512_ps(a), _mm512_set1_ps(d));
  const __m512i code = grid_codes16<1, 0>(_mm512_min_ps(y, _mm512_set1_ps(6.0f)));
  const __m512i c = _mm512_maskz_ternarylogic_epi32(num, code, _mm512_srli_epi32(x, 28), _mm512_set1_epi32(8), 0xF8);  // code | (sign & 8)
  _mm_storel_epi64(reinterpret_cast<__m128i*>(bytes), _mm512_cvtepi64_epi8(_mm512_or_si512(c, _mm512_srli_epi64(c, 28))));
  return num != 0xFFFF;
}

// NVFP4 of nb <= 16 blocks from src + start by the scalar arithmetic, sixteen scales in one
// vector: amax (a transposing max tree of the policy |x|), s = max(amax / 6, floor) (/ g), the
// e4m3 code of min(s, 448) and its value (grid_codes16), d = value (* g). g: null, or finite,
// positive and normal (s >= 0: the code is its rounding, saturated). False (nothing written) where
// some d is not finite: the caller takes the AVX2 lanes.
template <DType IN>
KVW_AVX512 bool nvfp4_arith16_512(const void* src, i64 start, int nb, const float* global, float floor, char* bytes, char* scales) {
  __m512i a[16];
  for (int b = 0; b < 16; ++b) {
    a[b] = _mm512_setzero_si512();
    if (b >= nb) continue;
    const __m512i v = _mm512_and_si512(load16_bits<IN>(src, start + 16 * b), _mm512_set1_epi32(0x7FFFFFFF));
    a[b] = _mm512_maskz_mov_epi32(normal_or_inf16(v) & _mm512_cmplt_epu32_mask(v, _mm512_set1_epi32(0x7F800000)), v);
  }
  __m512 s = _mm512_max_ps(_mm512_div_ps(_mm512_castsi512_ps(hmax16x16(a)), _mm512_set1_ps(6.0f)), _mm512_set1_ps(floor));
  if (global != nullptr) s = _mm512_div_ps(s, _mm512_set1_ps(global[0]));
  __m512 d;
  __m512i code = grid_codes16<3, -6>(_mm512_min_ps(s, _mm512_set1_ps(448.0f)), &d);
  if (global != nullptr) d = _mm512_mul_ps(d, _mm512_set1_ps(global[0]));
  if (_mm512_cmp_ps_mask(d, _mm512_set1_ps(3.4028234663852886e38f), _CMP_NLE_UQ) != 0) return false;
  alignas(64) float dl[16];
  _mm512_store_ps(dl, d);
  uint32_t nan = 0;
  for (int b = 0; b < nb; ++b) nan |= uint32_t(e2m1_block16<IN>(src, start + 16 * b, dl[b], bytes + 8 * b)) << b;
  code = _mm512_mask_mov_epi32(code, __mmask16(nan), _mm512_set1_epi32(0x7F));  // a NaN: the scale NaN
  _mm_mask_storeu_epi8(scales, __mmask16((1u << nb) - 1), _mm512_cvtepi32_epi8(code));
  return true;
}

// The DeepSeek V4 / V4.1 NVFP4 records on a bf16 row x: NB blocks (28: groups of 16 and 12, both
// of compile-time size, no block done twice; 32: two of 16) to `bytes` / `scales`, then the ROPE
// bf16 values after them copied to rope_dst (two zmm moves, no library call). One function a
// token: the constants loaded once, no run-length branches (a group holding a NaN or an inf:
// nvfp4_block_avx2 block by block, as nvfp4_run_512).
template <int NB, int ROPE>
KVW_FP4 void nvfp4_record_512(const uint16_t* x, char* bytes, char* scales, float floor, char* rope_dst) {
  static_assert(NB > 16 && NB <= 32 && NB % 4 == 0 && (ROPE == 0 || ROPE == 64), "the V4 records");
  constexpr int NB1 = NB - 16;
  const Fp4Consts k(e2m1_lut());
  __m512i eb0 = _mm512_setzero_si512(), mx0 = eb0, eb1 = eb0, mx1 = eb0;
  const bool ok0 = nvfp4_scales16_512<16>(x, 16, floor, k, scales, eb0, mx0);
  const bool ok1 = nvfp4_scales16_512<NB1>(x + 256, NB1, floor, k, scales + 16, eb1, mx1);
  nvfp4_group_512<16>(x, 0, 16, ok0, eb0, mx0, k, bytes, scales, floor);
  nvfp4_group_512<NB1>(x, 16, NB1, ok1, eb1, mx1, k, bytes, scales, floor);
  if (ROPE) copy_rope64(x + 16 * NB, rope_dst);
}

// A DeepSeek MLA NVFP4 row (store_mla: 512 latent values from c, 64 RoPE values from pe, bf16, no
// global scale) in one call: the three groups' scales (16 + 16 latent blocks, 4 RoPE blocks) first,
// then their codes, group sizes known at compile time (nvfp4_run_512 twice took two constant loads
// and a masked, run-length-tested group for the RoPE blocks).
KVW_FP4 void nvfp4_mla_512(const uint16_t* c, const uint16_t* pe, char* bytes, char* scales) {
  const Fp4Consts k(e2m1_lut());
  __m512i eb0 = _mm512_setzero_si512(), mx0 = eb0, eb1 = eb0, mx1 = eb0, eb2 = eb0, mx2 = eb0;
  const bool ok0 = nvfp4_scales16_512<16>(c, 16, 0.0f, k, scales, eb0, mx0);
  const bool ok1 = nvfp4_scales16_512<16>(c + 256, 16, 0.0f, k, scales + 16, eb1, mx1);
  const bool ok2 = nvfp4_scales16_512<4>(pe, 4, 0.0f, k, scales + 32, eb2, mx2);
  nvfp4_group_512<16>(c, 0, 16, ok0, eb0, mx0, k, bytes, scales, 0.0f);
  nvfp4_group_512<16>(c, 16, 16, ok1, eb1, mx1, k, bytes, scales, 0.0f);
  nvfp4_group_512<4>(pe, 0, 4, ok2, eb2, mx2, k, bytes + 256, scales + 32, 0.0f);
}

// nvfp4_run_avx2 by nvfp4_arith16_512, sixteen blocks a group (a group it declines: the AVX2
// lanes).
template <DType IN>
KVW_AVX512 void nvfp4_arith_run_512(const void* src, i64 start, int nblocks, const float* global, char* bytes, char* scales, float floor) {
  for (int b0 = 0; b0 < nblocks; b0 += 16) {
    const int nb = nblocks - b0 < 16 ? nblocks - b0 : 16;
    if (!nvfp4_arith16_512<IN>(src, start + 16 * b0, nb, global, floor, bytes + 8 * b0, scales + b0))
      nvfp4_run_avx2<IN>(src, start + 16 * b0, nb, global, bytes + 8 * b0, scales + b0, floor);
  }
}

// A global scale the arithmetic lanes take: finite, positive and normal.
inline bool global_ok(const float* g) { return g == nullptr || (*g >= 1.1754943508222875e-38f && *g <= 3.4028234663852886e38f); }

// The DeepSeek V4 indexer's scale bytes (dsv4_scale: max(amax, 1e-4) / 6 rounded up to a power of
// two, the same fp32 division) of eight blocks from their raw |x| maxima into e (in [111, 253]:
// the e2m1 tables' range); returns the mask of the first nb blocks holding a NaN or an inf (left
// to the scalar rule).
KVW_AVX512 uint32_t mxfp4_ceil_scales8(__m256i raw, int nb, __m256i& e) {
  const __m256 amax = _mm256_castsi256_ps(_mm256_and_si256(_mm256_slli_epi32(raw, 16), _mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F))));
  const __m256 s = _mm256_div_ps(_mm256_max_ps(amax, _mm256_set1_ps(1e-4f)), _mm256_set1_ps(6.0f));
  e = _mm256_srli_epi32(_mm256_add_epi32(_mm256_castps_si256(s), _mm256_set1_epi32(0x7FFFFF)), 23);
  return uint32_t(_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(raw, _mm256_set1_epi32(0x7F7F))))) & ((1u << nb) - 1);
}

// mxfp4_blocks8_avx2, 64 elements a step, in phases (a record's groups: both scales first): the
// nb <= 8 blocks' loads; (1) their raw maxima by a lane max tree, their scale bytes by mxfp4_scales8
// (CEIL: the indexer's mxfp4_ceil_scales8) to `scales`, each block's E_d - 3 = e - 3 in step order
// (lane i, dword h: block 2h + i / 2, the lanes step h's block fills; every byte of the dword) to
// eb; returns the blocks it leaves (any bytes: the caller rewrites them); (2) the codes (d = 2^(e -
// 127), m = 0) by e2m1_pack64.
KVW_FP4 void mxfp4_loads8(const uint16_t* src, int nb, __m512i (&l)[8]) {
  for (int b = 0; b < 8; ++b) l[b] = b < nb ? _mm512_loadu_si512(src + 32 * b) : _mm512_setzero_si512();
}

template <bool CEIL>
__attribute__((always_inline)) KVW_FP4 uint32_t mxfp4_scales8_512(const __m512i (&l)[8], int nb, char* scales, const Fp4Consts& k, __m512i& eb) {
  __m512i p[4];
  for (int j = 0; j < 4; ++j)
    p[j] = max_lane_pairs(_mm512_add_epi16(l[2 * j], l[2 * j]), _mm512_add_epi16(l[2 * j + 1], l[2 * j + 1]));
  __m256i e;
  const __m256i raw = lane_max8(max_lane_pairs(p[0], p[1]), max_lane_pairs(p[2], p[3]));
  const uint32_t left = CEIL ? mxfp4_ceil_scales8(raw, nb, e) : mxfp4_scales8(raw, nb, e);
  if (nb == 8 && left == 0) {
    _mm_storel_epi64(reinterpret_cast<__m128i*>(scales), _mm256_cvtepi32_epi8(e));
  } else if (nb == 6 && left == 0) {  // the V4 record's last group: plain 4 + 2 byte stores
    const __m128i v = _mm256_cvtepi32_epi8(e);
    _mm_storeu_si32(scales, v);
    _mm_storeu_si16(scales + 4, _mm_srli_si128(v, 4));
  } else {
    _mm_mask_storeu_epi8(scales, __mmask16(((1u << nb) - 1) & ~left), _mm256_cvtepi32_epi8(e));
  }
  const __m512i ebd = _mm512_castsi256_si512(_mm256_sub_epi32(e, _mm256_set1_epi32(3)));
  eb = _mm512_shuffle_epi8(_mm512_permutexvar_epi32(_mm512_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6, 1, 3, 5, 7, 1, 3, 5, 7), ebd), k.dup);
  return left;
}

__attribute__((always_inline)) KVW_FP4 void mxfp4_codes8_512(const __m512i (&l)[8], int nb, __m512i eb, const Fp4Consts& k, char* bytes) {
  __m512i w[4];
  for (int h = 0; h < 4; ++h)  // the steps holding blocks
    w[h] = 2 * h < nb ? e2m1_pack64(l[2 * h], l[2 * h + 1], step_spread(eb, h), _mm512_setzero_si512(), k) : _mm512_setzero_si512();
  for (int h = 0; h < 2; ++h) {
    const __m512i v = _mm512_permutex2var_epi8(w[2 * h], k.lo, w[2 * h + 1]);
    if (16 * nb >= 64 * h + 64) _mm512_storeu_si512(bytes + 64 * h, v);
    else if (16 * nb == 64 * h + 32) _mm256_storeu_si256(reinterpret_cast<__m256i*>(bytes + 64 * h), _mm512_castsi512_si256(v));
    else _mm512_mask_storeu_epi8(bytes + 64 * h, bytes_mask(16 * nb - 64 * h), v);
  }
}

template <bool CEIL = false>
KVW_FP4 uint32_t mxfp4_blocks8_512(const uint16_t* src, int nb, char* bytes, char* scales, const Fp4Consts& k) {
  __m512i l[8], eb;
  mxfp4_loads8(src, nb, l);
  const uint32_t left = mxfp4_scales8_512<CEIL>(l, nb, scales, k, eb);
  mxfp4_codes8_512(l, nb, eb, k, bytes);
  return left;
}

template <bool CEIL = false>
KVW_FP4 uint64_t mxfp4_run_512(const uint16_t* x, int nblocks, char* bytes, char* scales) {
  const Fp4Consts k(e2m1_lut());
  if (nblocks < 8) return nblocks > 0 ? mxfp4_blocks8_512<CEIL>(x, nblocks, bytes, scales, k) : 0;
  uint64_t left = 0;
  for (int b = 0; b < nblocks; b += 8) {  // whole groups: the last one ends the run (shared blocks twice, same bytes)
    const int b0 = b + 8 <= nblocks ? b : nblocks - 8;
    left |= uint64_t(mxfp4_blocks8_512<CEIL>(x + 32 * b0, 8, bytes + 16 * b0, scales + b0, k)) << b0;
  }
  return left;
}

// The DeepSeek V4 MXFP4 record on a bf16 row x: its NB = 14 blocks as groups of 8 and 6 (nb known
// at compile time: no block done twice, no masked stores; both scales, then both codes), then the
// ROPE bf16 values after them copied to rope_dst (two zmm moves). Returns the mask of blocks left to
// the scalar rule.
template <int NB, int ROPE>
KVW_FP4 uint64_t mxfp4_record_512(const uint16_t* x, char* bytes, char* scales, char* rope_dst) {
  static_assert(NB == 14 && (ROPE == 0 || ROPE == 64), "the V4 MXFP4 record");
  const Fp4Consts k(e2m1_lut());
  __m512i l0[8], l1[8], eb0, eb1;
  mxfp4_loads8(x, 8, l0);
  mxfp4_loads8(x + 256, NB - 8, l1);
  const uint64_t left = mxfp4_scales8_512<false>(l0, 8, scales, k, eb0) |
                        uint64_t(mxfp4_scales8_512<false>(l1, NB - 8, scales + 8, k, eb1)) << 8;
  mxfp4_codes8_512(l0, 8, eb0, k, bytes);
  mxfp4_codes8_512(l1, NB - 8, eb1, k, bytes + 128);
  if (ROPE) copy_rope64(x + 32 * NB, rope_dst);
  return left;
}

// ---- Dispatchers: the AVX-512 lanes where simd_level() says so (and they apply), else AVX2 ----
template <DType IN>
inline void nvfp4_run_simd(const void* src, i64 start, int nblocks, const float* global, char* bytes, char* scales,
                           float floor = 0.0f) {
  if (IN == DType::BF16 && global == nullptr && fp4_512_ok())
    return nvfp4_run_512(static_cast<const uint16_t*>(src) + start, nblocks, bytes, scales, floor);
  if (simd512_ok() && global_ok(global)) return nvfp4_arith_run_512<IN>(src, start, nblocks, global, bytes, scales, floor);
  nvfp4_run_avx2<IN>(src, start, nblocks, global, bytes, scales, floor);
}
// MXFP4 of nblocks <= 64 bf16 blocks of 32 from x, eight at a time; returns the mask of blocks left
// to the scalar rule (mxfp4_blocks8_avx2's).
inline uint64_t mxfp4_run_bf16(const uint16_t* x, int nblocks, char* bytes, char* scales) {
  const bool wide = fp4_512_ok();
  return wide ? mxfp4_run_512(x, nblocks, bytes, scales) : mxfp4_run_avx2(x, nblocks, bytes, scales);
}

// The indexer's MXFP4 blocks (dsv4_scale's power-of-two scales) of nblocks <= 64 bf16 blocks of 32
// from x: mxfp4_run_512<true> where the AVX-512 lanes apply (true); false: nothing written.
inline bool mxfp4_ceil_run_bf16(const uint16_t* x, int nblocks, char* bytes, char* scales, uint64_t& left) {
  if (!fp4_512_ok()) return false;
  left = mxfp4_run_512<true>(x, nblocks, bytes, scales);
  return true;
}

}  // namespace kvwrite
#endif
