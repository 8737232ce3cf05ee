// store_kv's int4 format (vLLM's INT4_PER_TOKEN_HEAD), host + device: the twin of
// kernels/store_kv_int4.py and kvwrite/reference/kv_int4.py (the formulas are there). Per token
// and head: rotate the D inputs (randomized Hadamard, the radix-2 butterfly in fp32), round them
// to the input dtype, take the finite min / max, then asymmetric 4-bit codes packed two a byte and
// the fp32 scale with the zero point in its low 4 mantissa bits. Every fp32 step is rounded and
// never fused (rn.h). One lane codes one (side, head): the work items of a token are 2H.
#pragma once

#include "dispatch.h"
#include "kv_quant.h"
#include "locs.h"
#include "paged.h"
#include "rope_store.h"  // float_to_half_rn, float_to_bf16_rn

namespace kvwrite {

constexpr int INT4_MAX_DIM = 512;  // kvwrite.facts.INT4_MAX_DIM: the rotation buffer of one head
constexpr float INT4_LEVELS = 15.0f;

// Word w of the rotation's signs (bit j set: element j of a block is negated). The signs of a
// block of b elements are the first b of these (kvwrite.facts.int4_rht_signs, tests compare).
KVW_HD uint64_t int4_sign_word(int w) {
  switch (w) {
    case 0: return 0x7f7fca4e9a8ca6f2ull;
    case 1: return 0x9480abc759bbc293ull;
    case 2: return 0x54503bbeb55b747eull;
    case 3: return 0x05dfbc5fcdf467b7ull;
    case 4: return 0x57563834b291e3ccull;
    case 5: return 0x67fc4ca6e46ae225ull;
    case 6: return 0x32d9dff1cfc78691ull;
    default: return 0x75625346365fdb89ull;
  }
}

// One of K or V: source rows [n, H, D] (feat stride 1), the uint8 code cache [pages, pps, H, D/2]
// and the fp32 scale cache [pages, pps, H, 1].
struct Int4Side {
  const char* src = nullptr;
  i64 s_tok = 0, s_head = 0;
  PagedCache cache, scales;
  int D = 0;
};

struct StoreKVInt4Params {
  Int4Side k, v;
  int H = 0;
  DType in_dtype = DType::F32;
  LocArgs locs;
};

// fp32 y rounded to the input dtype and read back (RNE; fp16 overflows to inf).
template <DType IN>
KVW_HD float int4_round_input(float y) {
  if constexpr (IN == DType::F32) {
    return y;
  } else if constexpr (IN == DType::F16) {
    return half_to_float(float_to_half_rn(y));
  } else {
    return bf16_to_float(float_to_bf16_rn(y));
  }
}

KVW_HD float int4_clamp(float t) {  // to [0, 15]; t is not NaN
  t = t > 0.0f ? t : 0.0f;
  return t < INT4_LEVELS ? t : INT4_LEVELS;
}

// trunc(clamp(t) + 0.5): round half away from zero of a value clamped to [0, 15].
KVW_HD int int4_round(float t) { return int(add_rn(int4_clamp(t), 0.5f)); }

// The codes (D / 2 bytes at `codes`) and stored scale of the head of D inputs at `start`.
template <DType IN>
KVW_HD void int4_head(const Int4Side& s, i64 start, char* codes, float* scale_out) {
  float y[INT4_MAX_DIM];
  const int D = s.D, b = D & -D;
  for (int j = 0; j < D; ++j) {
    const int e = j & (b - 1);
    const float x = load_quant<IN>(s.src, start + j);
    y[j] = (int4_sign_word(e >> 6) >> (e & 63)) & 1u ? -x : x;
  }
  for (int h = 1; h < b; h <<= 1)
    for (int run = 0; run < D; run += 2 * h)
      for (int t = run; t < run + h; ++t) {
        const float u = y[t], w = y[t + h];
        y[t] = add_rn(u, w);
        y[t + h] = sub_rn(u, w);
      }
  float mn = 0.0f, mx = 0.0f;
  bool any = false;
  for (int j = 0; j < D; ++j) {
    const float r = int4_round_input<IN>(y[j]);
    y[j] = r;
    if ((float_to_bits(r) & 0x7F800000u) != 0x7F800000u) {
      mn = !any || r < mn ? r : mn;
      mx = !any || r > mx ? r : mx;
      any = true;
    }
  }
  float scale = div_rn(sub_rn(mx, mn), INT4_LEVELS);
  scale = scale < DYN_SCALE_FLOOR ? DYN_SCALE_FLOOR : scale;
  const int zp = int4_round(div_rn(-mn, scale));
  const float inv = div_rn(1.0f, scale), zpf = float(zp);
  for (int j = 0; j < D; j += 2) {
    int q[2];
    for (int t = 0; t < 2; ++t) {
      const float r = y[j + t];
      q[t] = r != r ? zp : int4_round(add_rn(mul_rn(r, inv), zpf));
    }
    codes[j / 2] = char(q[0] | (q[1] << 4));
  }
  *scale_out = bits_to_float((float_to_bits(scale) & ~0xFu) | uint32_t(zp));
}

template <int CHECK, DType IN>
struct StoreKVInt4Token {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreKVInt4Params& p, i64 i, int lane, int nlanes) const {
    const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
    if (!r.write) return;
    for (int w = lane; w < 2 * p.H; w += nlanes) {
      const bool k = w < p.H;
      const Int4Side& s = k ? p.k : p.v;
      const int h = k ? w : w - p.H;
      int4_head<IN>(s, i * s.s_tok + h * s.s_head, s.cache.at(r.row, h, 0),
                    reinterpret_cast<float*>(s.scales.at(r.row, h, 0)));
    }
  }
};

// f(TypeTag<StoreKVInt4Token<...>>, work items per token: one per (side, head)).
template <class F>
void dispatch_store_kv_int4(const StoreKVInt4Params& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) { f(TypeTag<StoreKVInt4Token<c.value, in.value>>{}, 2 * p.H); });
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreKVInt4Params& p) {
  return i64(p.H) * (p.k.D + p.v.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
KVW_BODY(StoreKVInt4Params, dispatch_store_kv_int4)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> StoreKVInt4Params
// and its op table row (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_KV_INT4(X) \
  X(store_kv_int4, reg::Bind<&store_kv_int4_params>::table, \
    "(" KVW_KV "Tensor(c!) k_scale_cache, Tensor(d!) v_scale_cache, " KVW_TAIL ") -> ()")

namespace kvwrite {

// One side: rows x [n, H, D], uint8 codes [pages, rows, H, D / 2], fp32 scales [pages, rows, H].
inline Int4Side int4_side(const Tensor& x, const Tensor& cache, const Tensor& scales, const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "kvwrite: ", name,
              " rows must be [tokens, heads, dim], contiguous in dim");
  const int64_t d = x.size(2);
  TORCH_CHECK(d % 2 == 0 && d <= INT4_MAX_DIM, "kvwrite: ", name, " head dim must be even and at most ",
              INT4_MAX_DIM);
  TORCH_CHECK(cache.scalar_type() == at::kByte && cache.dim() == 4 && cache.size(2) == x.size(1) &&
                  cache.size(3) == d / 2,
              "kvwrite: ", name, " must be a uint8 [pages, rows, heads, dim / 2] cache");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && scales.dim() == 3 && scales.size(0) == cache.size(0) &&
                  scales.size(1) == cache.size(1) && scales.size(2) == x.size(1),
              "kvwrite: ", name, " scale cache must be fp32 [pages, rows, heads]");
  check_same_device(x, cache, "cache");
  check_same_device(x, scales, "scale cache");
  Int4Side s = source_rows<Int4Side>(x);
  s.cache = paged(cache, name);
  s.scales = paged(scales.unsqueeze(-1), name);
  return s;
}

inline StoreKVInt4Params store_kv_int4_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                              const Tensor& v_cache, const Tensor& k_scale_cache,
                                              const Tensor& v_scale_cache, const Tensor& loc,
                                              const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                              int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(v.scalar_type() == k.scalar_type(), "kvwrite: k and v must share a dtype");
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1),
              "kvwrite: k/v and their caches must agree on tokens, heads, pages and rows");
  StoreKVInt4Params p;
  p.in_dtype = dtype_of(k);
  p.k = int4_side(k, k_cache, k_scale_cache, "k_cache");
  p.v = int4_side(v, v_cache, v_scale_cache, "v_cache");
  p.H = int(k.size(1));
  p.locs = cache_locs(k, k_cache, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  return p;
}

}  // namespace kvwrite
#endif  // KVW_HOST
