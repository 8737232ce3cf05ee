// rope_store: RoPE (+ q/k RMS norm) fused with the paged K/V store (store_kv's formats) and with
// the MLA row store (store_mla's formats). The arithmetic and where it rounds are those of
// kvwrite/reference/rope.py, bit for bit: fp32, every product and sum rounded once (no fused
// multiply-add: explicit __fmul_rn / __fadd_rn on the device, -ffp-contract=off on the host),
// the sum of squares as the fixed adjacent-pair tree, one rounding to the input dtype.
//
// One token is two phases over its `nlanes` lanes: (1) rotate its q heads in place (valid
// position) and its k heads (k_pe) into a scratch row (the token is stored); a barrier (the
// device's block barrier: every thread of a block runs both phases); (2) store the scratch row
// with v (kv_c) exactly as store_kv (store_mla) stores a row, through their own row writers.
#pragma once

#include "kv_quant.h"
#include "rn.h"
#include "store_kv.h"
#include "store_kv_quant.h"
#include "store_mla.h"

namespace kvwrite {

// fp32 operations rounded once each, never fused: rn.h.

#if defined(__CUDA_ARCH__)
#define KVW_BARRIER() __syncthreads()
#else
#define KVW_BARRIER() ((void)0)
#endif

constexpr int ROPE_MAX_DIM = 1024;  // kvwrite.ops.rope.MAX_HEAD_DIM

// fp32 -> IEEE half bits, round to nearest even (overflow -> inf, NaN -> sign | 0x7E00, as c10).
KVW_HD uint16_t float_to_half_rn(float f) {
  const uint32_t x = float_to_bits(f), sign = (x >> 16) & 0x8000u, ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return uint16_t(sign | 0x7E00u);
  if (ax >= 0x477FF000u) return uint16_t(sign | 0x7C00u);  // >= 65520 rounds to inf
  if (ax >= 0x38800000u) {                                  // normal half (>= 2^-14)
    const uint32_t r = ax + 0xFFFu + ((ax >> 13) & 1u);
    return uint16_t(sign | ((r - 0x38000000u) >> 13));
  }
  // subnormal half: + 0.5 rounds (RNE) to a multiple of 2^-24, read off the low bits
  return uint16_t(sign | (float_to_bits(add_rn(bits_to_float(ax), 0.5f)) - 0x3F000000u));
}

// fp32 -> bf16 bits, round to nearest even (NaN -> 0x7FC0, as c10); branch-free (vectorises).
KVW_HD uint16_t float_to_bf16_rn(float f) {
  const uint32_t u = float_to_bits(f);
  const uint16_t r = uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  return f != f ? uint16_t(0x7FC0) : r;
}

// Store fp32 `y` rounded once to IN at element `i` of `dst`.
template <DType IN>
KVW_HD void store_rounded(void* dst, i64 i, float y) {
  if constexpr (IN == DType::F32) {
    static_cast<float*>(dst)[i] = y;
  } else if constexpr (IN == DType::F16) {
    static_cast<uint16_t*>(dst)[i] = float_to_half_rn(y);
  } else {
    static_cast<uint16_t*>(dst)[i] = float_to_bf16_rn(y);
  }
}

// What every rope op shares: positions, the cos/sin cache, the rotated part, q.
struct RopeArgs {
  const void* pos = nullptr;  // int32/int64 [n]
  bool pos64 = true;
  i64 max_pos = 0;
  const char* cos_sin = nullptr;  // [max_pos, R]: cos half then sin half, fp32 or the input dtype
  i64 cs_stride = 0;              // elements between positions
  bool cs_f32 = true;
  int R = 0;                      // rotary_dim (even, <= D)
  bool neox = true;
  char* q = nullptr;              // [n, Hq, D] rotated in place
  i64 q_sn = 0, q_sh = 0;
  int Hq = 0;
  const float* q_w = nullptr;     // RMS-norm weights (fp32 [D]) or null
  const float* k_w = nullptr;
  float eps = 0.0f;
  uint64_t call = 0;              // host: this op call's unique id (0: none), keys per-thread caches
};

template <DType IN>
KVW_HD float load_cs(const RopeArgs& r, i64 i) {
  return r.cs_f32 ? static_cast<const float*>(static_cast<const void*>(r.cos_sin))[i] : load_float<IN>(r.cos_sin, i);
}

// 1 / sqrt(sum(x_d^2) / D + eps) of the head at element `off`: the sum as the adjacent-pair tree
// over D zero-padded to a power of two, streamed as a binary counter (stk[l]: the pending left
// subtree of 2^l leaves; the padding zeros add exactly).
template <DType IN>
KVW_HD float rms_inv(const void* src, i64 off, int D, float eps) {
  float stk[12];
  int P = 1;
  while (P < D) P *= 2;
  for (int j = 0; j < P; ++j) {
    float v = 0.0f;
    if (j < D) {
      const float x = load_float<IN>(src, off + j);
      v = mul_rn(x, x);
    }
    int k = j, l = 0;
    for (; k & 1; k >>= 1, ++l) v = add_rn(stk[l], v);
    stk[l] = v;
  }
  int top = 0;
  while ((1 << top) < P) ++top;
  return div_rn(1.0f, sqrt_rn(add_rn(div_rn(stk[top], float(D)), eps)));
}

#if !defined(__CUDA_ARCH__)
// The adjacent-pair tree over a[0, n) (n a power of two): the sum of the two halves' trees.
inline float pair_tree(const float* a, int n) {
  if (n == 8) return ((a[0] + a[1]) + (a[2] + a[3])) + ((a[4] + a[5]) + (a[6] + a[7]));
  if (n < 8) {
    if (n == 1) return a[0];
    return n == 2 ? a[0] + a[1] : (a[0] + a[1]) + (a[2] + a[3]);
  }
  return pair_tree(a, n / 2) + pair_tree(a + n / 2, n / 2);
}

#if KVW_SIMD_X86
// Sixteen fp32 values from p: fp32, or bf16 widened.
KVW_AVX512 __m512 load16_ps(const void* p, bool f32) {
  if (f32) return _mm512_loadu_ps(p);
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(static_cast<const __m256i*>(p))), 16));
}

// Sixteen fp32 to bf16 by float_to_bf16_rn (nearest even, NaN -> 0x7FC0), stored at dst.
KVW_AVX512 void store16_bf16_rn(uint16_t* dst, __m512 o) {
  const __m512i u = _mm512_castps_si512(o);
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)),
                                                 _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(o, o, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), _mm512_cvtepi32_epi16(r));
}

// pair_tree of sixteen values: the adjacent pairs, then pairs of those ... (lane 0; fp32 addition
// commutes, so each level is the vector plus its lanes swapped).
KVW_AVX512 float pair_tree16(__m512 v) {
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0xB1));
  v = _mm512_add_ps(v, _mm512_permute_ps(v, 0x4E));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0xB1));
  v = _mm512_add_ps(v, _mm512_shuffle_f32x4(v, v, 0x4E));
  return _mm512_cvtss_f32(v);
}

// The RMS norm of a bf16 head x of D values (D % 16 == 0), as rope_head_host: (1) the sum of
// squares, pair_tree over the D squares zero-padded to P (the sixteen-value blocks' trees, then
// theirs); (2) with inv = 1 / sqrt(sum / D + eps), (x inv) w into v (fp32).
KVW_AVX512 float sum_squares_bf16_512(const uint16_t* x, int D) {
  float part[ROPE_MAX_DIM / 16];
  int P = 16;
  while (P < D) P *= 2;
  for (int b = 0; b < P / 16; ++b) {
    const __m512 y = 16 * b < D ? load16_ps(x + 16 * b, false) : _mm512_setzero_ps();
    part[b] = pair_tree16(_mm512_mul_ps(y, y));
  }
  return pair_tree(part, P / 16);
}
KVW_AVX512 void rms_scale_bf16_512(const uint16_t* x, int D, float inv, const float* w, float* v) {
  const __m512 vi = _mm512_set1_ps(inv);
  for (int c = 0; c < D; c += 16)
    _mm512_storeu_ps(v + c, _mm512_mul_ps(_mm512_mul_ps(load16_ps(x + c, false), vi), _mm512_loadu_ps(w + c)));
}

// rope_head_host of a head of D values (D % 16 == 0): bf16 x, or (NORMED) its RMS-normed fp32 values
// v; the first R (R % 32 == 0) rotated by cos = cs[0, R / 2), sin = cs[R / 2, R) (fp32, or bf16 where
// !cs_f32; GPT-J: pairs (2i, 2i + 1), neox: (i, i + R / 2)), each product and difference rounded
// once, the rest passed through; every value rounded once to bf16 at dst (may be x: a chunk's
// values are read before it is written).
template <bool NORMED>
KVW_AVX512 void rope_bf16_512(const uint16_t* x, const float* v, int D, const char* cs, bool cs_f32, int R, bool neox,
                              uint16_t* dst) {
  const auto at = [&](int c) { return NORMED ? _mm512_loadu_ps(v + c) : load16_ps(x + c, false); };
  for (int c = R; c < D; c += 16) store16_bf16_rn(dst + c, at(c));
  const int half = R / 2, esz = cs_f32 ? 4 : 2;
  const auto cs_at = [&](int i) { return cs + i64(i) * esz; };
  if (neox) {
    for (int i = 0; i < half; i += 16) {
      const __m512 c = load16_ps(cs_at(i), cs_f32), s = load16_ps(cs_at(half + i), cs_f32);
      const __m512 a = at(i), b = at(half + i);
      store16_bf16_rn(dst + i, _mm512_sub_ps(_mm512_mul_ps(a, c), _mm512_mul_ps(b, s)));
      store16_bf16_rn(dst + half + i, _mm512_add_ps(_mm512_mul_ps(b, c), _mm512_mul_ps(a, s)));
    }
    return;
  }
  const __m512i dup = _mm512_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6, 7, 7);
  for (int j = 0; j < R; j += 32) {  // pairs j / 2 .. j / 2 + 15: cos / sin of 16 pairs, two vectors of x
    const __m512 c16 = load16_ps(cs_at(j / 2), cs_f32), s16 = load16_ps(cs_at(half + j / 2), cs_f32);
    for (int k = 0; k < 2; ++k) {
      const __m512i idx = _mm512_add_epi32(dup, _mm512_set1_epi32(8 * k));
      const __m512 c = _mm512_permutexvar_ps(idx, c16), s = _mm512_permutexvar_ps(idx, s16);
      const __m512 a = at(j + 16 * k), sw = _mm512_permute_ps(a, 0xB1);  // pairs swapped
      const __m512 p = _mm512_mul_ps(a, c), q = _mm512_mul_ps(sw, s);
      // even lanes x[2i] c - x[2i + 1] s, odd lanes x[2i + 1] c + x[2i] s
      store16_bf16_rn(dst + j + 16 * k, _mm512_mask_add_ps(_mm512_sub_ps(p, q), 0xAAAA, p, q));
    }
  }
}

// Whether rope_bf16_512 takes heads of D values (bf16 heads only); position pos's cos / sin row.
inline bool rope_lanes_ok(const RopeArgs& r, int D) { return r.R % 32 == 0 && D % 16 == 0 && simd512_ok(); }
inline const char* cs_row(const RopeArgs& r, i64 pos) { return r.cos_sin + pos * r.cs_stride * (r.cs_f32 ? 4 : 2); }

// A bf16 head x normed by inv (1 / sqrt(sum / D + eps)) and w, then rotated to dst (may be x).
KVW_AVX512 void rope_normed_bf16_512(const RopeArgs& r, const char* cs, const uint16_t* x, int D, float inv, const float* w,
                                     uint16_t* dst) {
  float v[ROPE_MAX_DIM];
  rms_scale_bf16_512(x, D, inv, w, v);
  rope_bf16_512<true>(nullptr, v, D, cs, r.cs_f32, r.R, r.neox, dst);
}

// nh RMS-normed bf16 heads (q, in place: head h at x + h * stride) as rope_head_host each, sixteen
// heads' 1 / sqrt(sum / D + eps) in one vector (the division and root of one head would chain
// every head's work behind them).
KVW_AVX512 void rope_heads_normed_bf16_512(const RopeArgs& r, i64 pos, uint16_t* x, i64 stride, int nh, int D) {
  const char* cs = cs_row(r, pos);
  for (int h0 = 0; h0 < nh; h0 += 16) {
    const int m = nh - h0 < 16 ? nh - h0 : 16;
    alignas(64) float inv[16] = {};
    for (int h = 0; h < m; ++h) inv[h] = sum_squares_bf16_512(x + (h0 + h) * stride, D);
    const __m512 q = _mm512_add_ps(_mm512_div_ps(_mm512_load_ps(inv), _mm512_set1_ps(float(D))), _mm512_set1_ps(r.eps));
    _mm512_store_ps(inv, _mm512_div_ps(_mm512_set1_ps(1.0f), _mm512_sqrt_ps(q)));
    for (int h = 0; h < m; ++h) rope_normed_bf16_512(r, cs, x + (h0 + h) * stride, D, inv[h], r.q_w, x + (h0 + h) * stride);
  }
}
#endif

// The host's rope_head: the same operations in the same order, as whole-head loops over local
// fp32 rows that the compiler vectorises (the tree level by level, then the pairs).
template <DType IN>
inline void rope_head_host(const RopeArgs& r, i64 pos, const void* src, i64 off, void* dst, i64 doff, int D,
                           const float* w) {
#if KVW_SIMD_X86
  if (IN == DType::BF16 && rope_lanes_ok(r, D)) {  // the AVX-512 lanes
    const uint16_t* xh = static_cast<const uint16_t*>(src) + off;
    uint16_t* d = static_cast<uint16_t*>(dst) + doff;
    if (w == nullptr) return rope_bf16_512<false>(xh, nullptr, D, cs_row(r, pos), r.cs_f32, r.R, r.neox, d);
    const float inv = 1.0f / __builtin_sqrtf(sum_squares_bf16_512(xh, D) / float(D) + r.eps);
    return rope_normed_bf16_512(r, cs_row(r, pos), xh, D, inv, w, d);
  }
#endif
  float x[ROPE_MAX_DIM], o[ROPE_MAX_DIM];
  for (int c = 0; c < D; ++c) x[c] = load_float<IN>(src, off + c);
  const int half = r.R / 2;
  // the token's cos/sin row as fp32, converted once for all its heads (this thread's last row)
  // (keyed by the op call's unique id and the position: never reused across calls)
  thread_local struct { uint64_t call = 0; i64 pos = -1; float v[ROPE_MAX_DIM]; } row;
  if (r.call == 0 || row.call != r.call || row.pos != pos) {
    const i64 at = pos * r.cs_stride;
    for (int c = 0; c < r.R; ++c) row.v[c] = load_cs<IN>(r, at + c);
    row.call = r.call;
    row.pos = pos;
  }
  const float* cs = row.v;
  if (w != nullptr) {
    float a[ROPE_MAX_DIM];
    int P = 1;
    while (P < D) P *= 2;
    for (int c = 0; c < D; ++c) a[c] = x[c] * x[c];
    for (int c = D; c < P; ++c) a[c] = 0.0f;
    const float inv = 1.0f / __builtin_sqrtf(pair_tree(a, P) / float(D) + r.eps);
    for (int c = 0; c < D; ++c) x[c] = (x[c] * inv) * w[c];
  }
  const float* cos = cs;
  const float* sin = cs + half;
  if (r.neox) {
    for (int i = 0; i < half; ++i) {
      o[i] = x[i] * cos[i] - x[i + half] * sin[i];
      o[i + half] = x[i + half] * cos[i] + x[i] * sin[i];
    }
  } else {
    for (int i = 0; i < half; ++i) {
      o[2 * i] = x[2 * i] * cos[i] - x[2 * i + 1] * sin[i];
      o[2 * i + 1] = x[2 * i + 1] * cos[i] + x[2 * i] * sin[i];
    }
  }
  for (int c = r.R; c < D; ++c) o[c] = x[c];
  if constexpr (IN == DType::F32) {
    memcpy(static_cast<float*>(dst) + doff, o, size_t(D) * 4);
  } else {
    uint16_t* d = static_cast<uint16_t*>(dst) + doff;
    for (int c = 0; c < D; ++c) d[c] = IN == DType::F16 ? float_to_half_rn(o[c]) : float_to_bf16_rn(o[c]);
  }
}
#endif

// Rotate one head of D elements at `src` + `off` (norm weight `w` or null) and store each
// result, rounded to IN, at `dst` + `doff` (dst may be src: each pair is read before written).
template <DType IN>
KVW_HD void rope_head(const RopeArgs& r, i64 pos, const void* src, i64 off, void* dst, i64 doff, int D,
                      const float* w) {
#if !defined(__CUDA_ARCH__)
  return rope_head_host<IN>(r, pos, src, off, dst, doff, D, w);
#endif
  const float inv = w != nullptr ? rms_inv<IN>(src, off, D, r.eps) : 1.0f;
  const auto y = [&](int c) {
    const float x = load_float<IN>(src, off + c);
    return w != nullptr ? mul_rn(mul_rn(x, inv), w[c]) : x;
  };
  const int half = r.R / 2;
  const i64 cs = pos * r.cs_stride;
  for (int i = 0; i < half; ++i) {
    const int a = r.neox ? i : 2 * i, b = r.neox ? i + half : 2 * i + 1;
    const float ya = y(a), yb = y(b);
    const float c = load_cs<IN>(r, cs + i), s = load_cs<IN>(r, cs + half + i);
    store_rounded<IN>(dst, doff + a, add_rn(mul_rn(ya, c), -mul_rn(yb, s)));
    store_rounded<IN>(dst, doff + b, add_rn(mul_rn(yb, c), mul_rn(ya, s)));
  }
  for (int c = r.R; c < D; ++c) store_rounded<IN>(dst, doff + c, y(c));
}

// Token i's position and whether it is inside the cos/sin cache.
KVW_HD i64 rope_position(const RopeArgs& r, i64 i, bool& ok) {
  const i64 pos = load_index(r.pos, r.pos64, i);
  ok = pos >= 0 && pos < r.max_pos;
  return pos;
}

// The store's loc resolution with the position check folded in (kvwrite.reference.rope
// resolve_with_positions): a bad position is a KIND_POSITION error (checked first), never
// written, in every mode; the lead lane records / asserts.
template <int CHECK>
KVW_HD Resolved resolve_rope(const LocArgs& a, const RopeArgs& r, i64 i, bool pos_ok, i64 pos) {
  Resolved res = resolve<CHECK>(a, i);
  if (!pos_ok) {
    res.write = false;
    if (CHECK != CHECK_OFF) {
      res.bad = true;
      res.kind = KIND_POSITION;
      res.target = pos;
      res.limit = r.max_pos;
    }
  }
  return res;
}

template <int CHECK>
KVW_HOT Resolved resolve_rope_checked(const LocArgs& a, const RopeArgs& r, i64 i, bool pos_ok, i64 pos, bool lead) {
  const Resolved res = resolve_rope<CHECK>(a, r, i, pos_ok, pos);
  if (CHECK != CHECK_OFF && res.bad && lead) report_bad<CHECK>(a, i, res);
  return res;
}

// Phase 1 work items `lane`, `lane + nlanes`, ... of token i: q heads [0, Hq) when the position
// is valid, then `extra` more heads (k) when `store` (the callback rotates them).
template <DType IN, class KHead>
KVW_HD void rope_q_and(const RopeArgs& r, i64 i, i64 pos, bool pos_ok, int D, bool store, int extra, int lane,
                       int nlanes, KHead&& k_head) {
  const int nq = pos_ok ? r.Hq : 0, total = nq + (store ? extra : 0);
  int j0 = lane;
#if !defined(__CUDA_ARCH__) && KVW_SIMD_X86
  if (IN == DType::BF16 && nlanes == 1 && r.q_w != nullptr && nq > 1 && rope_lanes_ok(r, D)) {  // one thread: every q head
    rope_heads_normed_bf16_512(r, pos, reinterpret_cast<uint16_t*>(r.q) + i * r.q_sn, r.q_sh, nq, D);
    j0 = nq;
  }
#endif
  for (int j = j0; j < total; j += nlanes) {
    if (j < nq) {
      const i64 off = i * r.q_sn + j * r.q_sh;
      rope_head<IN>(r, pos, r.q, off, r.q, off, D, r.q_w);
    } else {
      k_head(j - nq);
    }
  }
}

// ---- rope_store_kv ----------------------------------------------------------------------------

// Phase 1 of the fused RoPE store_kv (both formats' params, KV: StoreKVParams or
// StoreKVQuantParams): token i's position and row (`res`), its q heads rotated in place, its k
// heads rotated into its scratch row. True where the token stores.
template <int CHECK, DType IN, class KV>
KVW_HD bool rope_kv_phase1(const KV& kv, const RopeArgs& rope, char* scratch, i64 scratch_sn, i64 i, bool live, int lane,
                           int nlanes, Resolved& res) {
  if (!live) return false;
  const int D = kv.k.D;
  bool pos_ok = false;
  const i64 pos = rope_position(rope, i, pos_ok);
  res = resolve_rope_checked<CHECK>(kv.locs, rope, i, pos_ok, pos, lane == 0);
  char* row = scratch + i * scratch_sn * dtype_size(IN);
  rope_q_and<IN>(rope, i, pos, pos_ok, D, res.write, kv.H, lane, nlanes, [&](int h) {
    rope_head<IN>(rope, pos, kv.k.src, i * kv.k.s_tok + h * kv.k.s_head, row, i64(h) * D, D, rope.k_w);
  });
  return res.write;
}

// The rotated k the store reads: the scratch rows in place of the caller's k.
template <class Side>
KVW_HD Side scratch_side(Side k, const char* scratch, i64 scratch_sn) {
  k.src = scratch;
  k.s_tok = scratch_sn;
  k.s_head = k.D;
  return k;
}

struct RopeStoreKVParams {
  StoreKVParams kv;  // k.src: the caller's k (rotated from); the store reads the scratch rows
  RopeArgs rope;
  char* scratch = nullptr;  // [n, H, Dk] input dtype (device); the host passes a per-thread row
  i64 scratch_sn = 0;       // elements between tokens' scratch rows (0: one reused row)
};

// The whole of token i (both phases). OUT: void = copy (VEC-byte units), else the fp8 format.
template <int CHECK, DType IN, class OUT, int VEC>
KVW_HD void rope_store_kv_token(const RopeStoreKVParams& p, i64 i, bool live, int lane, int nlanes) {
  const StoreKVParams& kv = p.kv;
  Resolved res{};
  const bool store = rope_kv_phase1<CHECK, IN>(kv, p.rope, p.scratch, p.scratch_sn, i, live, lane, nlanes, res);
  KVW_BARRIER();
  if (!store) return;
  const KVSide k = scratch_side(kv.k, p.scratch, p.scratch_sn);
  if constexpr (std::is_void<OUT>::value) {
    const int es = dtype_size(kv.in_dtype);
    copy_side<VEC>(k, kv.H, es, i, res.row, lane, nlanes);
    copy_side<VEC>(kv.v, kv.H, es, i, res.row, lane, nlanes);
  } else {
    quant_side<IN, OUT>(k, kv.H, i, res.row, lane, nlanes);
    quant_side<IN, OUT>(kv.v, kv.H, i, res.row, lane, nlanes);
  }
}

template <int CHECK, DType IN, class OUT, int VEC>
struct RopeStoreKVToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const RopeStoreKVParams& p, i64 i, bool live, int lane, int nlanes) const {
    rope_store_kv_token<CHECK, IN, OUT, VEC>(p, i, live, lane, nlanes);
  }
};

// f(TypeTag<RopeStoreKVToken<...>>, work items per token) for the runtime check mode and dtypes.
template <class F>
void dispatch_rope_store_kv(const RopeStoreKVParams& p, int check, F&& f) {
  const i64 heads = p.rope.Hq + p.kv.H;
  const i64 d = p.kv.k.D > p.kv.v.D ? p.kv.k.D : p.kv.v.D;
  StoreKVParams rotated = p.kv;  // the copy unit from the scratch rows' alignment, not k's
  rotated.k = scratch_side(p.kv.k, p.scratch, p.scratch_sn);
  with_check(check, [&](auto c) {
    with_float_dtype(p.kv.in_dtype, [&](auto in) {
      if (p.kv.cache_dtype == p.kv.in_dtype) {
        with_vec(store_kv_vec(rotated), [&](auto vec) {
          const i64 w = p.kv.H * d * dtype_size(p.kv.in_dtype) / vec.value;
          f(TypeTag<RopeStoreKVToken<c.value, in.value, void, vec.value>>{}, w > heads ? w : heads);
        });
      } else {
        with_fp8(p.kv.cache_dtype, [&](auto fmt) {
          const i64 w = d % CHUNK == 0 ? 2 * p.kv.H * d / CHUNK : p.kv.H * d;
          f(TypeTag<RopeStoreKVToken<c.value, in.value, typename decltype(fmt)::type, 1>>{}, w > heads ? w : heads);
        });
      }
    });
  });
}

KVW_HD const LocArgs& locs_of(const RopeStoreKVParams& p) { return p.kv.locs; }

// ---- rope_store_kv into int8 / dynamic-scale caches (store_kv_quant's formats) ---------------

struct RopeStoreKVQuantParams {
  StoreKVQuantParams kv;  // k.src: the caller's k (rotated from); the store reads the scratch rows
  RopeArgs rope;
  char* scratch = nullptr;
  i64 scratch_sn = 0;
};

// Phase 2 is store_kv_quant's row writer, on at most one warp's lanes (its dynamic amax is a
// warp-shuffle max): lanes past 32 only rotate.
template <int CHECK, DType IN, class F, int QUANT>
KVW_HD void rope_store_kv_quant_token(const RopeStoreKVQuantParams& p, i64 i, bool live, int lane, int nlanes) {
  const StoreKVQuantParams& kv = p.kv;
  Resolved res{};
  const bool store = rope_kv_phase1<CHECK, IN>(kv, p.rope, p.scratch, p.scratch_sn, i, live, lane, nlanes, res);
  KVW_BARRIER();
  const int lanes = nlanes < 32 ? nlanes : 32;
  if (!store || lane >= lanes) return;
  const KVQuantSide k = scratch_side(kv.k, p.scratch, p.scratch_sn);
  quant_kv_side<IN, F, QUANT>(k, kv.rule, kv.H, i, res.row, lane, lanes);
  quant_kv_side<IN, F, QUANT>(kv.v, kv.rule, kv.H, i, res.row, lane, lanes);
}

template <int CHECK, DType IN, class F, int QUANT>
struct RopeStoreKVQuantToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const RopeStoreKVQuantParams& p, i64 i, bool live, int lane, int nlanes) const {
    rope_store_kv_quant_token<CHECK, IN, F, QUANT>(p, i, live, lane, nlanes);
  }
};

// f(TypeTag<RopeStoreKVQuantToken<...>>, work items per token): static int8 (rne), or dynamic
// per-token / per-token-head int8 / e4m3 / e5m2 under either rule.
template <class Fn>
void dispatch_rope_store_kv_quant(const RopeStoreKVQuantParams& p, int check, Fn&& f) {
  const StoreKVQuantParams& kv = p.kv;
  const i64 d = kv.k.D > kv.v.D ? kv.k.D : kv.v.D;
  const i64 quant_work = kv.quant == QUANT_HEAD ? d : kv.H * d;
  const i64 heads = p.rope.Hq + kv.H;
  const i64 work = heads > (quant_work < 32 ? quant_work : 32) ? heads : (quant_work < 32 ? quant_work : 32);
  with_check(check, [&](auto c) {
    with_float_dtype(kv.in_dtype, [&](auto in) {
      with_quant_fmt(kv.fmt, [&](auto fmt) {
        using F = typename decltype(fmt)::type;
        with_quant_mode<F>(kv.quant, kv.rule, [&](auto q) {
          f(TypeTag<RopeStoreKVQuantToken<c.value, in.value, F, q.value>>{}, work);
        });
      });
    });
  });
}

KVW_HD const LocArgs& locs_of(const RopeStoreKVQuantParams& p) { return p.kv.locs; }

// ---- rope_store_mla ---------------------------------------------------------------------------

struct RopeStoreMLAParams {
  StoreMLAParams mla;  // k_pe: the caller's k_pe (rotated from); the store reads the scratch rows
  RopeArgs rope;
  char* scratch = nullptr;  // [n, R] input dtype (device); the host passes a per-thread row
  i64 scratch_sn = 0;
};

template <int CHECK, int MODE, DType IN, class OUT, int VEC>
KVW_HD void rope_store_mla_token(const RopeStoreMLAParams& p, i64 i, bool live, int lane, int nlanes) {
  const StoreMLAParams& m = p.mla;
  bool pos_ok = false, store = false;
  i64 pos = 0;
  Resolved res{};
  if (live) {
    pos = rope_position(p.rope, i, pos_ok);
    res = resolve_rope_checked<CHECK>(m.locs, p.rope, i, pos_ok, pos, lane == 0);
    store = res.write;
    rope_q_and<IN>(p.rope, i, pos, pos_ok, m.R, store, 1, lane, nlanes, [&](int) {
      rope_head<IN>(p.rope, pos, m.k_pe, i * m.pe_sn, p.scratch, i * p.scratch_sn, m.R, nullptr);
    });
  }
  KVW_BARRIER();
  if (!store) return;
  StoreMLAParams s = m;  // the rotated k_pe: this token's scratch row
  s.k_pe = p.scratch;
  s.pe_sn = p.scratch_sn;
  char* dst = s.cache.row_ptr(res.row);
  if constexpr (MODE == MLA_COPY) {
    mla_copy<VEC>(s, i, dst, lane, nlanes);
  } else if constexpr (MODE == MLA_FP8) {
    mla_fp8<IN, OUT>(s, i, dst, lane, nlanes);
  } else if constexpr (MODE == MLA_DS_MLA) {
    mla_ds<IN>(s, i, dst, lane, nlanes);
  } else {
    mla_nvfp4<IN>(s, i, res.row, dst, lane, nlanes);
  }
}

template <int CHECK, int MODE, DType IN, class OUT, int VEC>
struct RopeStoreMLAToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const RopeStoreMLAParams& p, i64 i, bool live, int lane, int nlanes) const {
    rope_store_mla_token<CHECK, MODE, IN, OUT, VEC>(p, i, live, lane, nlanes);
  }
};

template <class F>
void dispatch_rope_store_mla(const RopeStoreMLAParams& p, int check, F&& f) {
  const i64 heads = p.rope.Hq + 1;
  StoreMLAParams rotated = p.mla;
  rotated.k_pe = p.scratch;
  rotated.pe_sn = p.scratch_sn;
  const auto work = [&](i64 w) { return w > heads ? w : heads; };
  with_check(check, [&](auto c) {
    with_float_dtype(p.mla.in_dtype, [&](auto in) {
      if (p.mla.mode == MLA_COPY) {
        with_vec(store_mla_vec(rotated), [&](auto vec) {
          f(TypeTag<RopeStoreMLAToken<c.value, MLA_COPY, in.value, void, vec.value>>{},
            work(store_mla_work(rotated, vec.value)));
        });
      } else if (p.mla.mode == MLA_FP8) {
        with_fp8(p.mla.cache_dtype, [&](auto fmt) {
          f(TypeTag<RopeStoreMLAToken<c.value, MLA_FP8, in.value, typename decltype(fmt)::type, 1>>{},
            work(store_mla_work(rotated, 1)));
        });
      } else if (p.mla.mode == MLA_DS_MLA) {
        f(TypeTag<RopeStoreMLAToken<c.value, MLA_DS_MLA, in.value, void, 1>>{}, work(store_mla_work(rotated, 1)));
      } else if (p.mla.mode == MLA_NVFP4) {
        f(TypeTag<RopeStoreMLAToken<c.value, MLA_NVFP4, in.value, void, 1>>{}, work(store_mla_work(rotated, 1)));
      } else {
        throw std::invalid_argument("kvwrite: unknown store_mla mode");
      }
    });
  });
}

KVW_HD const LocArgs& locs_of(const RopeStoreMLAParams& p) { return p.mla.locs; }

// A token's scratch row (dispatch.h HAS_SCRATCH): its rotated heads in the input dtype.
inline ScratchRow scratch_row(const RopeStoreKVParams& p) {
  return {i64(p.kv.H) * p.kv.k.D, dtype_size(p.kv.in_dtype)};
}
inline ScratchRow scratch_row(const RopeStoreKVQuantParams& p) {
  return {i64(p.kv.H) * p.kv.k.D, dtype_size(p.kv.in_dtype)};
}
inline ScratchRow scratch_row(const RopeStoreMLAParams& p) { return {p.mla.R, dtype_size(p.mla.in_dtype)}; }

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
// the store's bytes plus the rotation of q's heads and of k (k_pe)
inline i64 token_bytes(const RopeStoreKVParams& p) {
  return token_bytes(p.kv) + i64(p.rope.Hq + p.kv.H) * p.kv.k.D * dtype_size(p.kv.in_dtype) * QUANT_WEIGHT;
}
inline i64 token_bytes(const RopeStoreKVQuantParams& p) {
  return token_bytes(p.kv) + i64(p.rope.Hq + p.kv.H) * p.kv.k.D * dtype_size(p.kv.in_dtype) * QUANT_WEIGHT;
}
inline i64 token_bytes(const RopeStoreMLAParams& p) {
  return token_bytes(p.mla) + i64(p.rope.Hq + 1) * p.mla.R * dtype_size(p.mla.in_dtype) * QUANT_WEIGHT;
}
KVW_BODY(RopeStoreKVParams, dispatch_rope_store_kv)
KVW_BODY(RopeStoreKVQuantParams, dispatch_rope_store_kv_quant)
KVW_BODY(RopeStoreMLAParams, dispatch_rope_store_mla)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> the fused RoPE
// stores' params, their scratch rows and their op table rows (registry.h).
#ifdef KVW_HOST
#include "../host.h"

// The fused RoPE stores' shared schema: their head and the optional q/k RMS norm.
#define KVW_ROPE "Tensor positions, Tensor(c!) q, Tensor k, Tensor v, Tensor cos_sin, " \
                 "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_scale, Tensor? v_scale, "
#define KVW_NORM "Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, bool is_neox, "

#define KVW_OPS_ROPE_STORE(X) \
  X(rope_store_kv, reg::Bind<&rope_store_kv_params>::table, "(" KVW_ROPE KVW_NORM KVW_TAIL ") -> ()") \
  X(rope_store_kv_quant, reg::Bind<&rope_store_kv_quant_params>::table, \
    "(" KVW_ROPE "Tensor(d!)? k_scale_cache, Tensor(e!)? v_scale_cache, int quant, int rule, " KVW_NORM KVW_TAIL \
    ") -> ()") \
  X(rope_store_mla, reg::Bind<&rope_store_mla_params>::table, \
    "(Tensor positions, Tensor(c!) q, Tensor kv_c, Tensor k_pe, Tensor cos_sin, Tensor(a!) kv_cache, " \
    "Tensor? scale, Tensor(b!)? scale_cache, Tensor? global_scale, int kernel_mode, bool is_neox, " \
    KVW_TAIL ") -> ()")

namespace kvwrite {

inline RopeArgs rope_args(const Tensor& positions, const Tensor& q, const Tensor& cos_sin, const OptTensor& q_w,
                          const OptTensor& k_w, double eps, bool is_neox, const Tensor& ref, int64_t D) {
  const int64_t n = ref.size(0);
  TORCH_CHECK(positions.dim() == 1 && positions.size(0) == n &&
                  (positions.scalar_type() == at::kInt || positions.scalar_type() == at::kLong) &&
                  (n <= 1 || positions.stride(0) == 1),
              "kvwrite: positions must be a contiguous int32/int64 [n] tensor");
  TORCH_CHECK(q.dim() == 3 && q.size(0) == n && q.size(2) == D && q.scalar_type() == ref.scalar_type() &&
                  (D <= 1 || q.stride(2) == 1),
              "kvwrite: q must be [n, Hq, D] in the input dtype, contiguous in D");
  TORCH_CHECK(cos_sin.dim() == 2 && cos_sin.size(0) >= 1 &&
                  (cos_sin.scalar_type() == at::kFloat || cos_sin.scalar_type() == ref.scalar_type()) &&
                  (cos_sin.size(1) <= 1 || cos_sin.stride(1) == 1),
              "kvwrite: cos_sin_cache must be [max_position, rotary_dim] fp32 or the input dtype");
  const int64_t R = cos_sin.size(1);
  TORCH_CHECK(R >= 2 && R % 2 == 0 && R <= D && D <= ROPE_MAX_DIM, "kvwrite: rotary_dim must be even, in [2, D], D <= ",
              ROPE_MAX_DIM);
  for (const Tensor* t : {&positions, &q, &cos_sin}) check_same_device(ref, *t, "rope argument");
  RopeArgs r;
  r.pos = positions.data_ptr();
  r.pos64 = positions.scalar_type() == at::kLong;
  r.max_pos = cos_sin.size(0);
  r.cos_sin = static_cast<const char*>(cos_sin.data_ptr());
  r.cs_stride = cos_sin.stride(0);
  r.cs_f32 = cos_sin.scalar_type() == at::kFloat;
  r.R = int(R);
  r.neox = is_neox;
  r.q = static_cast<char*>(q.data_ptr());
  r.q_sn = q.stride(0);
  r.q_sh = q.stride(1);
  r.Hq = int(q.size(1));
  const OptTensor* ws[] = {&q_w, &k_w};
  const float** dst[] = {&r.q_w, &r.k_w};
  for (int j = 0; j < 2; ++j) {
    if (!ws[j]->has_value()) continue;
    const Tensor& w = **ws[j];
    TORCH_CHECK(w.dim() == 1 && w.size(0) == D && at::isFloatingType(w.scalar_type()) && (D <= 1 || w.stride(0) == 1),
                "kvwrite: norm weights must be contiguous float [D]");
    check_same_device(ref, w, "norm weight");
    *dst[j] = (w.scalar_type() == at::kFloat ? w : hold(w.to(at::kFloat))).data_ptr<float>();
  }
  TORCH_CHECK(eps >= 0, "kvwrite: norm_eps must be >= 0");
  r.eps = float(eps);
  return r;
}

inline RopeStoreKVParams rope_store_kv_params(const Tensor& positions, const Tensor& q, const Tensor& k,
                                              const Tensor& v, const Tensor& cos_sin, const Tensor& k_cache,
                                              const Tensor& v_cache, const OptTensor& k_scale,
                                              const OptTensor& v_scale, const OptTensor& q_w, const OptTensor& k_w,
                                              double eps, bool is_neox, const Tensor& loc, const OptTensor& loc_map,
                                              const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                              int64_t check, int64_t op) {
  RopeStoreKVParams p;
  p.kv = store_kv_params(k, v, k_cache, v_cache, k_scale, v_scale, loc, loc_map, errors, dcp_rank, dcp_size, check,
                         op);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.size(0) >= 1 && k_cache.size(1) >= 1,
              "kvwrite: the caches must be [pages >= 1, rows >= 1, heads, D] views");
  // scales: fp32 [] / [1] / [H] (contiguous), for fp8 caches only (kvwrite.validate.scale)
  const bool fp8 = is_fp8(p.kv.cache_dtype);
  for (const OptTensor* s : {&k_scale, &v_scale}) {
    TORCH_CHECK(s->has_value() == fp8, "kvwrite: k_scale/v_scale are required for (only for) fp8 caches");
    if (!fp8) continue;
    const Tensor& t = **s;
    TORCH_CHECK(t.dim() <= 1 && (t.numel() == 1 || (t.numel() == k.size(1) && t.stride(0) == 1)),
                "kvwrite: k_scale/v_scale must be fp32 [], [1] or [H]");
  }
  p.rope = rope_args(positions, q, cos_sin, q_w, k_w, eps, is_neox, k, k.size(2));
  return p;
}

inline RopeStoreKVQuantParams rope_store_kv_quant_params(
    const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& cos_sin,
    const Tensor& k_cache, const Tensor& v_cache, const OptTensor& k_scale, const OptTensor& v_scale,
    const OptTensor& k_scale_cache, const OptTensor& v_scale_cache, int64_t quant, int64_t rule, const OptTensor& q_w,
    const OptTensor& k_w, double eps, bool is_neox, const Tensor& loc, const OptTensor& loc_map,
    const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  RopeStoreKVQuantParams p;
  p.kv = store_kv_quant_params(k, v, k_cache, v_cache, k_scale, v_scale, k_scale_cache, v_scale_cache, quant, rule,
                               loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  TORCH_CHECK(k_cache.size(0) >= 1 && k_cache.size(1) >= 1, "kvwrite: the caches need pages and rows");
  p.rope = rope_args(positions, q, cos_sin, q_w, k_w, eps, is_neox, k, k.size(2));
  return p;
}

inline RopeStoreMLAParams rope_store_mla_params(const Tensor& positions, const Tensor& q_pe, const Tensor& kv_c,
                                                const Tensor& k_pe, const Tensor& cos_sin, const Tensor& kv_cache,
                                                const OptTensor& scale, const OptTensor& scale_cache,
                                                const OptTensor& global_scale, int64_t mode, bool is_neox,
                                                const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                                                int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  RopeStoreMLAParams p;
  p.mla = store_mla_params(kv_c, k_pe, kv_cache, scale, scale_cache, global_scale, mode, loc, loc_map, errors,
                           dcp_rank, dcp_size, check, op);
  p.rope = rope_args(positions, q_pe, cos_sin, std::nullopt, std::nullopt, 0.0, is_neox, k_pe, k_pe.size(1));
  TORCH_CHECK(p.rope.R == p.mla.R, "kvwrite: rope_store_mla rotates the whole k_pe: cos_sin_cache must be R wide");
  return p;
}

// Fused RoPE stores (host.h ROPED): the CPU checks a token's position with its loc.
template <>
constexpr bool ROPED<RopeStoreKVParams> = true;
template <>
constexpr bool ROPED<RopeStoreKVQuantParams> = true;
template <>
constexpr bool ROPED<RopeStoreMLAParams> = true;

}  // namespace kvwrite
#endif  // KVW_HOST
