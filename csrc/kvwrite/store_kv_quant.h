// store_kv_quant: the paged K+V store with static int8 or dynamic per-token / per-token-head
// int8 / fp8 scales (kvwrite.ops.kv_quant; the Triton twin is kernels/store_kv_quant.py). One
// token's work is `store_kv_quant_token`, over `nlanes` lanes (one warp's worth at most on the
// device: the amax is combined with group_max; 1 on the CPU). The scale goes to the same local
// row as the codes, written by lane 0 after the amax.
#pragma once

#include "dispatch.h"
#include "kv_quant.h"
#include "locs.h"
#include "paged.h"

namespace kvwrite {

// One of K or V: source rows [n, H, D] (feat stride 1), the code cache (1 byte an element) and
// its scales: static fp32 [1] / [H], or a dynamic scale cache [pages, pool_page_size, 1 or H].
struct KVQuantSide {
  const char* src = nullptr;
  i64 s_tok = 0, s_head = 0;
  PagedCache cache;
  const float* scale = nullptr;  // static
  i64 scale_stride = 0;          // 0 (per tensor) or 1 (per head)
  PagedCache scales;             // dynamic: heads dim 1 (per token) or H (per token-head)
  int D = 0;
};

struct StoreKVQuantParams {
  KVQuantSide k, v;
  int H = 0;
  DType in_dtype = DType::F32;
  int fmt = FMT_INT8;        // KVQuantFmt
  int quant = QUANT_TOKEN;   // KVQuantMode
  int rule = RULE_RNE;       // QuantRule
  LocArgs locs;
};

// Codes of head h (D elements) of the token starting at `src` into `dst`, lanes striding.
template <DType IN, class F>
KVW_HD void quant_head(const KVQuantSide& s, const Quantizer<F>& q, i64 src, int h, char* dst,
                       int lane, int nlanes) {
  if (nlanes == 1) {
    quantize_run<IN, F>(s.src, src + h * s.s_head, s.D, q, dst + s.cache.in_row(h, 0));
    return;
  }
  for (int d = lane; d < s.D; d += nlanes) dst[s.cache.in_row(h, d)] = char(q(load_quant<IN>(s.src, src + h * s.s_head + d)));
}

KVW_HD void store_scale(const PagedCache& scales, i64 row, int h, float v) {
  *reinterpret_cast<float*>(scales.at(row, h, 0)) = v;
}

// Head h of token i with its own dynamic scale (per token-head), the generic way.
template <DType IN, class F>
KVW_HD void quant_kv_head(const KVQuantSide& s, int rule, i64 i, i64 row, int h, int lane, int nlanes) {
  const i64 src = i * s.s_tok;
  const float sc = dynamic_scale<F>(heads_amax<IN>(s.src, src + h * s.s_head, 0, 1, s.D, lane, nlanes));
  if (lane == 0) store_scale(s.scales, row, h, sc);
  quant_head<IN>(s, Quantizer<F>(sc, rule), src, h, s.cache.row_ptr(row), lane, nlanes);
}

#if KVW_SIMD_X86
// The host's streaming lanes for bf16 sides with dynamic scales under the rne rule (int8 / e4m3 /
// e5m2, whole rows of D % 32 == 0; per token-head at most MAX_LANE_HEADS heads): the amax as the
// raw max of 16-bit magnitudes, codes by int8_bf16_run / fp8_bf16_run, the same bytes as the
// generic path. Two phases, so that a token's K and V scales (each a chain of amax and two
// divisions) are both under way before either side's codes wait on them.
constexpr int MAX_LANE_HEADS = 64;
struct LaneScales {
  float sc[MAX_LANE_HEADS], rc[MAX_LANE_HEADS];  // per token: [0] only
  float rf[MAX_LANE_HEADS];  // int8: int8_fast_recip's rf (0: int8_bf16_run), where the run is whole 64s
  uint32_t raw[MAX_LANE_HEADS];  // e4m3: the amax's bf16 bits (e4m3_lookup_run)
};

// The side's heads back to back in the source and in the row: one run of H * D.
inline bool one_run(const KVQuantSide& s) { return s.s_head == s.D && s.cache.in_row(1, 0) == s.D; }

// Whether a side's dynamic scales take the host lanes (whole rows of 32-multiple heads).
template <int QUANT>
inline bool lanes_apply(const KVQuantSide& s, int H) {
  return QUANT != QUANT_STATIC && !s.cache.split && s.D % 32 == 0 && (QUANT == QUANT_TOKEN || H <= MAX_LANE_HEADS) &&
         simd_ok();
}

// Phase one: the side's scales and their reciprocals. False (nothing decided) where a NaN or inf
// is in the token or a scale leaves cr_div_ok's range: the generic path then writes the side.
template <class F, int QUANT, class L>
inline bool lane_scales(L l, const KVQuantSide& s, int H, const uint16_t* src, LaneScales& o) {
  constexpr bool INT8 = std::is_same<F, Int8Fmt>::value;
  if constexpr (QUANT == QUANT_TOKEN) {
    const bool whole = one_run(s);
    uint32_t raw = 0;
    for (int h = 0; h < (whole ? 1 : H); ++h) {
      const uint32_t r = l.bf16_absmax_raw(src + h * s.s_head, whole ? H * s.D : s.D);
      raw = r > raw ? r : raw;
    }
    const float amax = bf16_policy_amax(raw);
    if (amax < 0.0f) return false;
    o.raw[0] = raw;
    o.sc[0] = dynamic_scale<F>(amax);
    o.rc[0] = 1.0f / o.sc[0];
    if (!cr_div_ok(o.sc[0])) return false;
    if constexpr (INT8) o.rf[0] = (whole ? H * s.D : s.D) % 64 == 0 ? l.int8_fast_recip(amax, o.sc[0], DYN_SCALE_FLOOR) : 0.0f;
    return true;
  } else {
    int h = 0;
    for (; h + 8 <= H; h += 8) {  // eight heads' scales in one vector
      uint32_t raw[8];
      l.bf16_absmax_raw8(src + h * s.s_head, s.s_head, s.D, raw);
      if (!dynamic_scales8(raw, quant_max<F>(), DYN_SCALE_FLOOR, o.sc + h, o.rc + h)) return false;
      for (int k = 0; k < 8; ++k) o.raw[h + k] = raw[k];
      if constexpr (INT8) {
        if (s.D % 64 == 0) {
          l.int8_fast_recips8(raw, o.sc + h, DYN_SCALE_FLOOR, o.rf + h);
        } else {
          for (int k = 0; k < 8; ++k) o.rf[h + k] = 0.0f;
        }
      }
    }
    for (; h < H; ++h) {
      o.raw[h] = l.bf16_absmax_raw(src + h * s.s_head, s.D);
      const float amax = bf16_policy_amax(o.raw[h]);
      if (amax < 0.0f) return false;
      o.sc[h] = dynamic_scale<F>(amax);
      o.rc[h] = 1.0f / o.sc[h];
      if (!cr_div_ok(o.sc[h])) return false;
      if constexpr (INT8) o.rf[h] = s.D % 64 == 0 ? l.int8_fast_recip(amax, o.sc[h], DYN_SCALE_FLOOR) : 0.0f;
    }
    return true;
  }
}

// Phase two: the side's scales into the scale cache and its codes into row `row`.
template <class F, int QUANT, class L>
inline void lane_codes(L l, const KVQuantSide& s, int H, const uint16_t* src, const LaneScales& o, i64 row) {
  char* dst = s.cache.row_ptr(row);
  const auto codes = [&](const uint16_t* x, int n, int k, char* out) {
    const float sc = o.sc[k], rc = o.rc[k];
    if constexpr (std::is_same<F, Int8Fmt>::value) {
      if (o.rf[k] != 0.0f) return l.int8_bf16_run_rf(x, n, out, o.rf[k]);  // n % 64 == 0 (lane_scales)
      l.int8_bf16_run(x, n, sc, out, rc);
    } else {
      if (std::is_same<F, E4M3>::value && l.e4m3_lookup_run(x, n, o.raw[k], sc, out)) return;
      l.template fp8_bf16_run<F, true>(x, n, sc, out, rc);  // a dynamic scale's row
    }
  };
  if constexpr (QUANT == QUANT_TOKEN) {
    store_scale(s.scales, row, 0, o.sc[0]);
    if (one_run(s)) return codes(src, H * s.D, 0, dst);
    for (int h = 0; h < H; ++h) codes(src + h * s.s_head, s.D, 0, dst + s.cache.in_row(h, 0));
  } else {
    if (s.scales.stride_head == 1) {  // the scales are adjacent: one copy
      memcpy(s.scales.at(row, 0, 0), o.sc, sizeof(float) * H);
    } else {
      for (int h = 0; h < H; ++h) store_scale(s.scales, row, h, o.sc[h]);
    }
    for (int h = 0; h < H; ++h) codes(src + h * s.s_head, s.D, h, dst + s.cache.in_row(h, 0));
  }
}

// Per token-head int8 / e4m3 at the AVX-512 level: the token's 2H (side, head) runs in one loop,
// int8_head_runs_512 / e4m3_head_runs_512 (each run's amax one run ahead of its codes: the two
// phases of lane_scales / lane_codes left each token's codes waiting on its scale chains, and the
// next token's amax on those codes); a run they leave goes by quant_kv_head.
constexpr int MAX_RUN_HEADS = 32;
inline bool head_runs_apply(const StoreKVQuantParams& p) {
  return p.H <= MAX_RUN_HEADS && p.k.D == p.v.D && p.k.D % 64 == 0 && lanes_apply<QUANT_HEAD>(p.k, p.H) &&
         lanes_apply<QUANT_HEAD>(p.v, p.H);
}
template <class F>
inline void head_runs(const StoreKVQuantParams& p, i64 i, i64 row) {
  const KVQuantSide* side[2] = {&p.k, &p.v};
  HeadRun r[2 * MAX_RUN_HEADS];
  for (int k = 0; k < 2; ++k) {
    const KVQuantSide& s = *side[k];
    const uint16_t* src = reinterpret_cast<const uint16_t*>(s.src) + i * s.s_tok;
    char* dst = s.cache.row_ptr(row);
    char* sc = s.scales.row_ptr(row);
    for (int h = 0; h < p.H; ++h)
      r[k * p.H + h] = {src + h * s.s_head, dst + s.cache.in_row(h, 0), reinterpret_cast<float*>(sc + s.scales.in_row(h, 0))};
  }
  const int D = p.k.D;  // 128: the usual head
  const auto runs = [&](auto d0) -> uint64_t {  // d0: D at compile time (0: at run time)
    if constexpr (std::is_same<F, Int8Fmt>::value) return int8_head_runs_512<d0.value>(r, 2 * p.H, D);
    else return e4m3_head_runs_512<d0.value>(r, 2 * p.H, D, DYN_SCALE_FLOOR);
  };
  uint64_t left = D == 128 ? runs(IntTag<128>{}) : runs(IntTag<0>{});
  for (; left != 0; left &= left - 1) {
    const int u = __builtin_ctzll(left);
    quant_kv_head<DType::BF16, F>(*side[u / p.H], RULE_RNE, i, row, u % p.H, 0, 1);
  }
}

// A token's K and V by the lanes, both scales first; returns which sides are still to write
// (bit 0: K, bit 1: V) by the generic path.
template <DType IN, class F, int QUANT>
inline int quant_kv_lanes(const StoreKVQuantParams& p, i64 i, i64 row) {
  if constexpr (IN != DType::BF16) {
    return 3;
  } else {
    if (p.rule != RULE_RNE) return 3;
    const KVQuantSide* side[2] = {&p.k, &p.v};
    return with_lanes([&](auto l) {  // the level once a token
      constexpr bool RUNS = std::is_same<F, Int8Fmt>::value || std::is_same<F, E4M3>::value;
      if constexpr (RUNS && QUANT == QUANT_HEAD && decltype(l)::level == 2) {
        if (head_runs_apply(p)) {
          head_runs<F>(p, i, row);
          return 0;
        }
      }
      LaneScales o[2];
      const uint16_t* src[2];
      bool ok[2];
      for (int k = 0; k < 2; ++k) {
        src[k] = reinterpret_cast<const uint16_t*>(side[k]->src) + i * side[k]->s_tok;
        ok[k] = lanes_apply<QUANT>(*side[k], p.H) && lane_scales<F, QUANT>(l, *side[k], p.H, src[k], o[k]);
      }
      int rest = 0;
      for (int k = 0; k < 2; ++k) {
        if (ok[k]) {
          lane_codes<F, QUANT>(l, *side[k], p.H, src[k], o[k], row);
        } else {
          rest |= 1 << k;
        }
      }
      return rest;
    });
  }
}
#endif

template <DType IN, class F, int QUANT>
KVW_HD void quant_kv_side(const KVQuantSide& s, int rule, int H, i64 i, i64 row, int lane, int nlanes) {
  char* dst = s.cache.row_ptr(row);
  const i64 src = i * s.s_tok;
  if constexpr (QUANT == QUANT_STATIC) {
    for (int h = 0; h < H; ++h) quant_head<IN>(s, Quantizer<F>(s.scale[h * s.scale_stride], rule), src, h, dst, lane, nlanes);
  } else if constexpr (QUANT == QUANT_TOKEN) {
    const float sc = dynamic_scale<F>(heads_amax<IN>(s.src, src, s.s_head, H, s.D, lane, nlanes));
    if (lane == 0) store_scale(s.scales, row, 0, sc);
    const Quantizer<F> q(sc, rule);
    for (int h = 0; h < H; ++h) quant_head<IN>(s, q, src, h, dst, lane, nlanes);
  } else {
    for (int h = 0; h < H; ++h) quant_kv_head<IN, F>(s, rule, i, row, h, lane, nlanes);
  }
}

template <int CHECK, DType IN, class F, int QUANT>
struct StoreKVQuantToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreKVQuantParams& p, i64 i, int lane, int nlanes) const {
#if !defined(__CUDA_ARCH__)
    const i64 ahead = nlanes == 1 ? prefetch_row(p.locs, i + PREFETCH_AHEAD) : -1;
    if (ahead >= 0) {
      p.k.cache.prefetch_heads(ahead, p.H, p.k.D);
      p.v.cache.prefetch_heads(ahead, p.H, p.v.D);
      if (QUANT != QUANT_STATIC) {
        __builtin_prefetch(p.k.scales.row_ptr(ahead), 1, 3);
        __builtin_prefetch(p.v.scales.row_ptr(ahead), 1, 3);
      }
    }
#endif
    const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
    if (!r.write) return;
    int rest = 3;  // the sides the generic path writes
#if KVW_SIMD_X86
    if (nlanes == 1) rest = quant_kv_lanes<IN, F, QUANT>(p, i, r.row);
#endif
    if (rest & 1) quant_kv_side<IN, F, QUANT>(p.k, p.rule, p.H, i, r.row, lane, nlanes);
    if (rest & 2) quant_kv_side<IN, F, QUANT>(p.v, p.rule, p.H, i, r.row, lane, nlanes);
  }
};

// The call's format as a type: int8, or float8 e4m3 / e5m2 (dynamic scales).
template <class G>
void with_quant_fmt(int fmt, G&& g) {
  switch (fmt) {
    case FMT_INT8: return g(TypeTag<Int8Fmt>{});
    case FMT_E4M3: return g(TypeTag<E4M3>{});
    case FMT_E5M2: return g(TypeTag<E5M2>{});
    default: throw std::invalid_argument("kvwrite: int8 / dynamic-scale caches must be int8, float8_e4m3fn or float8_e5m2");
  }
}

// The quant mode as a template parameter (the rule stays a runtime value): a static scale is
// int8 with the rne rule only; dynamic scales per token or per token-head.
template <class F, class G>
void with_quant_mode(int quant, int rule, G&& g) {
  if (quant == QUANT_STATIC) {
    if constexpr (std::is_same<F, Int8Fmt>::value) {
      if (rule != RULE_RNE) throw std::invalid_argument("kvwrite: a static scale takes the rne rule only");
      return g(IntTag<QUANT_STATIC>{});
    } else {
      throw std::invalid_argument("kvwrite: static fp8 scales are store_kv's fp8 path, not a dynamic-scale format");
    }
  }
  if (quant == QUANT_TOKEN) return g(IntTag<QUANT_TOKEN>{});
  if (quant == QUANT_HEAD) return g(IntTag<QUANT_HEAD>{});
  throw std::invalid_argument("kvwrite: bad quant mode");
}

// f(TypeTag<StoreKVQuantToken<...>>, work items per token) for the runtime mode and format.
// Work items are capped at 32 (one warp): the dynamic amax is combined by warp shuffles.
template <class Fn>
void dispatch_store_kv_quant(const StoreKVQuantParams& p, int check, Fn&& f) {
  const i64 d = p.k.D > p.v.D ? p.k.D : p.v.D;
  const i64 work = p.quant == QUANT_HEAD ? d : p.H * d;
  const i64 lanes = work < 32 ? work : 32;
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) {
      with_quant_fmt(p.fmt, [&](auto fmt) {
        using F = typename decltype(fmt)::type;
        with_quant_mode<F>(p.quant, p.rule, [&](auto q) {
          f(TypeTag<StoreKVQuantToken<c.value, in.value, F, q.value>>{}, lanes);
        });
      });
    });
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreKVQuantParams& p) {
  return i64(p.H) * (p.k.D + p.v.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
KVW_BODY(StoreKVQuantParams, dispatch_store_kv_quant)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> StoreKVQuantParams
// and its op table row (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_KV_QUANT(X) \
  X(store_kv_quant, reg::Bind<&store_kv_quant_params>::table, \
    "(" KVW_KV "Tensor? k_scale, Tensor? v_scale, Tensor(c!)? k_scale_cache, Tensor(d!)? v_scale_cache, int quant, " \
    "int rule, " KVW_TAIL ") -> ()")

namespace kvwrite {

// The heads of a dynamic scale cache [pages, pool_page_size] (per token: 1) or [pages,
// pool_page_size, 1 or H].
inline int64_t scale_heads(const Tensor& c) { return c.dim() == 2 ? 1 : c.size(2); }

// store_kv_quant: canonical [pages, pool_page_size, H, D] int8 / fp8 caches (read as bytes),
// static fp32 scales ([], [1] or [H]) or dynamic fp32 scale caches (scale_heads).
inline KVQuantSide kv_quant_side(const Tensor& x, const Tensor& cache, const OptTensor& scale,
                                 const OptTensor& scale_cache, const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "kvwrite: ", name,
              " must be [tokens, heads, dim], contiguous in dim");
  TORCH_CHECK(cache.dim() == 4 && cache.size(2) == x.size(1) && cache.size(3) == x.size(2) && cache.element_size() == 1,
              "kvwrite: ", name, " must be a 1-byte [pages, rows, heads, dim] cache matching its rows");
  check_same_device(x, cache, "cache");
  KVQuantSide s = source_rows<KVQuantSide>(x);
  s.cache = paged(cache, name);
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && (scale->numel() == 1 || scale->numel() == x.size(1)) &&
                    (scale->numel() <= 1 || scale->stride(-1) == 1),
                "kvwrite: ", name, " static scale must be fp32 [], [1] or [H]");
    check_same_device(x, *scale, "scale");
    s.scale = scale->data_ptr<float>();
    s.scale_stride = scale->numel() > 1 ? 1 : 0;
  } else {
    TORCH_CHECK(scale_cache.has_value(), "kvwrite: ", name, " needs a static scale or a scale cache");
    const Tensor& c = *scale_cache;
    TORCH_CHECK(c.scalar_type() == at::kFloat && (c.dim() == 2 || c.dim() == 3) && c.size(0) == cache.size(0) &&
                    c.size(1) == cache.size(1) && (scale_heads(c) == 1 || scale_heads(c) == x.size(1)),
                "kvwrite: ", name, " scale cache must be fp32 [pages, rows], [pages, rows, 1] or [pages, rows, H]");
    check_same_device(x, c, "scale cache");
    s.scales = paged(c.dim() == 2 ? c.unsqueeze(-1).unsqueeze(-1) : c.unsqueeze(-1), name);
  }
  return s;
}

inline StoreKVQuantParams store_kv_quant_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                               const Tensor& v_cache, const OptTensor& k_scale,
                                               const OptTensor& v_scale, const OptTensor& k_scale_cache,
                                               const OptTensor& v_scale_cache, int64_t quant, int64_t rule,
                                               const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                                               int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "kvwrite: k/v and k_cache/v_cache must share dtypes");
  TORCH_CHECK(quant >= QUANT_STATIC && quant <= QUANT_HEAD && (rule == RULE_RNE || rule == RULE_VLLM),
              "kvwrite: bad quant mode or rule");
  const bool dyn = quant != QUANT_STATIC;
  TORCH_CHECK(dyn ? (k_scale_cache.has_value() && v_scale_cache.has_value())
                  : (k_scale.has_value() && v_scale.has_value()),
              "kvwrite: store_kv_quant needs k/v scales (static) or k/v scale caches (dynamic)");
  StoreKVQuantParams p;
  p.in_dtype = dtype_of(k);
  switch (k_cache.scalar_type()) {
    case at::kChar: p.fmt = FMT_INT8; break;
    case at::kFloat8_e4m3fn: p.fmt = FMT_E4M3; break;
    case at::kFloat8_e5m2: p.fmt = FMT_E5M2; break;
    default: TORCH_CHECK(false, "kvwrite: store_kv_quant caches must be int8, float8_e4m3fn or float8_e5m2");
  }
  p.quant = int(quant);
  p.rule = int(rule);
  p.k = kv_quant_side(k, k_cache, dyn ? std::nullopt : k_scale, dyn ? k_scale_cache : std::nullopt, "k_cache");
  p.v = kv_quant_side(v, v_cache, dyn ? std::nullopt : v_scale, dyn ? v_scale_cache : std::nullopt, "v_cache");
  p.H = int(k.size(1));
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1),
              "kvwrite: k/v and their caches must agree on tokens, heads, pages and rows");
  const int64_t heads = dyn ? scale_heads(*k_scale_cache) : 0;
  if (dyn) TORCH_CHECK(heads == scale_heads(*v_scale_cache), "kvwrite: k/v scale caches must match");
  TORCH_CHECK(!dyn || heads == (quant == QUANT_HEAD ? k.size(1) : 1),
              "kvwrite: the scale caches' last dim must be 1 (per token) or H (per token-head)");
  p.locs = cache_locs(k, k_cache, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  return p;
}

}  // namespace kvwrite
#endif  // KVW_HOST
