// store_kv: the fused paged K+V store of MHA/GQA (copy, or fp8 saturate(x / scale)).
// One token's work is `store_kv_token`, split over `nlanes` lanes (CUDA threads; 1 on the CPU).
#pragma once

#include <type_traits>
#include <utility>
#if !defined(__CUDACC__) && defined(__SSE2__)  // host-only SSE2 transposes (scatter_rows2)
#define KVW_SSE2_ROWS 1
#include <emmintrin.h>
#endif

#include "dispatch.h"
#include "fp8.h"
#include "locs.h"
#include "paged.h"
#include "quant.h"

namespace kvwrite {

// One of K or V: source rows [n, H, D] (strides in elements, feat stride 1) and its cache.
struct KVSide {
  const char* src = nullptr;
  i64 s_tok = 0, s_head = 0;
  PagedCache cache;
  const float* scale = nullptr;  // fp8: [1] or [H]
  i64 scale_stride = 0;          // 0 (per tensor) or 1 (per head)
  int D = 0;
};

struct StoreKVParams {
  KVSide k, v;
  int H = 0;
  DType in_dtype = DType::F32;
  DType cache_dtype = DType::F32;  // = in_dtype (copy) or E4M3 / E5M2 / E4M3FNUZ
  LocArgs locs;
};

// Bytes per copy unit for a plain copy: 16 where every row start and row length allows.
inline int store_kv_vec(const StoreKVParams& p) {
  const i64 es = dtype_size(p.in_dtype);
  uint64_t bits = 0;
  for (const KVSide* s : {&p.k, &p.v}) {
    bits |= uint64_t(s->D * es) | uint64_t(reinterpret_cast<uintptr_t>(s->src)) |
            uint64_t(s->s_tok * es) | uint64_t(s->s_head * es) |
            uint64_t(reinterpret_cast<uintptr_t>(s->cache.base)) | uint64_t(s->cache.stride_page * es) |
            uint64_t(s->cache.stride_entry * es) | uint64_t(s->cache.stride_head * es);
    if (s->cache.split) bits |= uint64_t(s->cache.split * es) | uint64_t(s->cache.stride_split * es);
  }
  return vec_bytes(bits);
}

#if !defined(__CUDA_ARCH__)
// Host copy of one head's D elements into a split head dim (feature d at (d / X) * stride_split
// + d % X): X-element runs by memcpy; X == 1 (a transposed tile: vLLM's legacy value cache, its
// CPU attention key cache) is a strided scatter of ES-byte elements.
template <int ES>
inline void scatter_elems(char* dst, i64 step, const char* src, int n) {
  int d = 0;
  for (; d + 4 <= n; d += 4, dst += 4 * step, src += 4 * ES) {  // four stores in flight
    memcpy(dst, src, ES);
    memcpy(dst + step, src + ES, ES);
    memcpy(dst + 2 * step, src + 2 * ES, ES);
    memcpy(dst + 3 * step, src + 3 * ES, ES);
  }
  for (; d < n; ++d, dst += step, src += ES) memcpy(dst, src, ES);
}

// RUN-byte runs (a compile-time size: one vector move each, no memcpy call per run).
template <int RUN>
inline void copy_runs_of(char* dst, i64 step, const char* src, int runs) {
  for (int r = 0; r < runs; ++r) memcpy(dst + r * step, src + i64(r) * RUN, RUN);
}

inline void copy_split_head(const PagedCache& c, char* dst, const char* src, int D, int es) {
  const i64 step = c.stride_split * es;
  if (c.split == 1) {
    if (es == 2) return scatter_elems<2>(dst, step, src, D);
    if (es == 4) return scatter_elems<4>(dst, step, src, D);
    return scatter_elems<1>(dst, step, src, D);
  }
  const int runs = D / c.split, run = c.split * es;
  if (run == 16) copy_runs_of<16>(dst, step, src, runs);   // vLLM's x: 16 bytes of elements
  else if (run == 8) copy_runs_of<8>(dst, step, src, runs);
  else
    for (int r = 0; r < runs; ++r) memcpy(dst + r * step, src + i64(r) * run, size_t(run));
  if (runs * c.split < D)
    memcpy(dst + runs * step, src + i64(runs) * c.split * es, size_t(D - runs * c.split) * es);
}

// Host, the page-grouped CPU store of a split head dim (ops.cpp): head h of side `s` of token i
// to local row `row`.
inline void copy_head_host(const KVSide& s, int es, int h, i64 i, i64 row) {
  char* dst = s.cache.row_ptr(row) + s.cache.in_row(h, 0);
  const char* src = s.src + (i * s.s_tok + h * s.s_head) * es;
  if (s.cache.split) copy_split_head(s.cache, dst, src, s.D, es);
  else memcpy(dst, src, size_t(s.D) * es);
}

// Store n (2..16, even) bytes as at most two overlapping stores within [dst, dst + n).
inline void store_small(char* dst, const char* src, int n) {
  if (n >= 8) { memcpy(dst, src, 8); memcpy(dst + n - 8, src + n - 8, 8); }
  else if (n >= 4) { memcpy(dst, src, 4); memcpy(dst + n - 4, src + n - 4, 4); }
  else memcpy(dst, src, 2);
}

// 2-byte value elements of k (2..8) tokens at consecutive rows (rows 2 bytes apart, features `step`
// bytes apart): 8x8 transposes, so each feature takes one k * 2-byte store instead of k.
inline void scatter_rows2(char* dst, i64 step, const char* const* src, int k, int D) {
  alignas(16) char t[8][16];
  for (int d = 0; d < D; d += 8, dst += 8 * step) {
#if defined(KVW_SSE2_ROWS)
    __m128i x[8], a[8], b[8];
    for (int j = 0; j < 8; ++j)
      x[j] = j < k ? _mm_loadu_si128(reinterpret_cast<const __m128i*>(src[j] + 2 * d)) : _mm_setzero_si128();
    for (int j = 0; j < 8; j += 2) {
      a[j] = _mm_unpacklo_epi16(x[j], x[j + 1]);
      a[j + 1] = _mm_unpackhi_epi16(x[j], x[j + 1]);
    }
    for (int j = 0; j < 8; j += 4)
      for (int q = 0; q < 2; ++q) {
        b[j + 2 * q] = _mm_unpacklo_epi32(a[j + q], a[j + q + 2]);
        b[j + 2 * q + 1] = _mm_unpackhi_epi32(a[j + q], a[j + q + 2]);
      }
    for (int e = 0; e < 8; e += 2) {  // b[e / 2] holds rows 0-3 of features e, e + 1; b[4 + e / 2] rows 4-7
      const __m128i lo = _mm_unpacklo_epi64(b[e / 2], b[4 + e / 2]), hi = _mm_unpackhi_epi64(b[e / 2], b[4 + e / 2]);
      if (k == 8) {
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + e * step), lo);
        _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + (e + 1) * step), hi);
        continue;
      }
      _mm_store_si128(reinterpret_cast<__m128i*>(t[e]), lo);
      _mm_store_si128(reinterpret_cast<__m128i*>(t[e + 1]), hi);
    }
    if (k == 8) continue;
#else
    for (int j = 0; j < k; ++j)
      for (int e = 0; e < 8; ++e) memcpy(t[e] + 2 * j, src[j] + 2 * (d + e), 2);
#endif
    for (int e = 0; e < 8; ++e) store_small(dst + e * step, t[e], 2 * k);
  }
}

// Host plain copy of head h of one page's tokens g[0, m) ((local row, token), sorted by row, then
// token). A 2-byte value cache with a row stride of one element (vLLM's [P, H, D, S]) goes by runs
// of up to 8 tokens at consecutive rows (scatter_rows2); a duplicated row: its last token's bytes.
inline void copy_page_head_host(const StoreKVParams& p, int h, const std::pair<i64, i64>* g, i64 m) {
  const int es = dtype_size(p.in_dtype);
  for (i64 j = 0; j < m; ++j) copy_head_host(p.k, es, h, g[j].second, g[j].first);
  const KVSide& v = p.v;
  if (!(v.cache.split == 1 && es == 2 && v.cache.stride_entry == 1 && v.D % 8 == 0)) {
    for (i64 j = 0; j < m; ++j) copy_head_host(v, es, h, g[j].second, g[j].first);
    return;
  }
  for (i64 j = 0; j < m;) {
    const char* src[8];
    const i64 row = g[j].first;
    int k = 0;
    for (; j < m && k < 8; ++j) {
      if (j + 1 < m && g[j + 1].first == g[j].first) continue;  // a later token writes this row
      if (g[j].first != row + k) break;
      src[k++] = v.src + (g[j].second * v.s_tok + h * v.s_head) * es;
    }
    char* dst = v.cache.row_ptr(row) + v.cache.in_row(h, 0);
    if (k == 1) scatter_elems<2>(dst, v.cache.stride_split * es, src[0], v.D);
    else scatter_rows2(dst, v.cache.stride_split * es, src, k, v.D);
  }
}
#endif

// Copy side `s` of token i to `row`, VEC bytes at a time, lanes striding over H * D. On the
// host (one lane) a row is one memcpy (one per head where heads are strided; split heads by
// runs, `copy_split_head`).
template <int VEC>
KVW_HD void copy_side(const KVSide& s, int H, int es, i64 i, i64 row, int lane, int nlanes) {
  char* dst = s.cache.row_ptr(row);
  const char* src = s.src + i * s.s_tok * es;
#if !defined(__CUDA_ARCH__)
  if (nlanes == 1 && !s.cache.split) {
    copy_runs<true>(dst, s.cache.stride_head * es, src, s.s_head * es, H, i64(s.D) * es);
    return;
  }
  if (nlanes == 1) {
    for (int h = 0; h < H; ++h) copy_head_host(s, es, h, i, row);
    return;
  }
#endif
  const int units = s.D * es / VEC;
  for (int u = lane; u < H * units; u += nlanes) {
    const int h = u / units, b = (u - h * units) * VEC;
    // a unit never straddles a split chunk (store_kv_vec divides split * es)
    const i64 at = s.cache.split ? s.cache.in_row(h, b / es) + b % es : s.cache.in_row(h, 0) + b;
    copy_unit<VEC>(dst + at, src + h * s.s_head * es + b);
  }
}

// Quantise side `s` of token i to fp8 format F: code = fp8(x / scale[h]), x in input type IN.
// Lanes take CHUNK-element chunks of a head (16-byte loads/stores on the device) when D allows;
// the host (one lane) runs a head as one vectorisable loop. Same codes either way.
template <DType IN, class F>
KVW_HD void quant_side(const KVSide& s, int H, i64 i, i64 row, int lane, int nlanes) {
  char* dst = s.cache.row_ptr(row);
  const i64 src = i * s.s_tok;
  if (nlanes == 1 && !s.cache.split) {  // a split head dim goes elementwise (below)
    quant_heads<IN, F>(s.src, src, s.s_head, H, s.D, s.scale, s.scale_stride, dst, s.cache.in_row(1, 0));
    return;
  }
#if !defined(__CUDA_ARCH__)
  if (nlanes == 1 && s.D <= 1024) {  // host, split head dim: codes into a run, then scattered
    char codes[1024];
    for (int h = 0; h < H; ++h) {
      quant_run<IN, F>(s.src, src + h * s.s_head, s.D, s.scale[h * s.scale_stride], codes);
      copy_split_head(s.cache, dst + s.cache.in_row(h, 0), codes, s.D, 1);
    }
    return;
  }
#endif
  if (s.D % CHUNK == 0 && !s.cache.split) {
    const int per_head = s.D / CHUNK;
    for (int c = lane; c < H * per_head; c += nlanes) {
      const int h = c / per_head, d = (c - h * per_head) * CHUNK;
      float x[CHUNK];
      load_chunk<IN>(s.src, src + h * s.s_head + d, x);
      quant_chunk<F>(x, s.scale[h * s.scale_stride], dst + s.cache.in_row(h, d));
    }
    return;
  }
  for (int e = lane; e < H * s.D; e += nlanes) {
    const int h = e / s.D, d = e - h * s.D;
    const float x = daz(load_float<IN>(s.src, src + h * s.s_head + d));
    dst[s.cache.in_row(h, d)] = char(fp8_bits<F>(x / s.scale[h * s.scale_stride]));
  }
}

// The whole store of token i. OUT: void = plain copy of VEC-byte units (IN unused); else the
// fp8 format, elementwise (VEC unused).
template <int CHECK, DType IN, class OUT, int VEC>
KVW_HD void store_kv_token(const StoreKVParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  if constexpr (std::is_void<OUT>::value) {
    const int es = dtype_size(p.in_dtype);  // a copy needs only the element size
    copy_side<VEC>(p.k, p.H, es, i, r.row, lane, nlanes);
    copy_side<VEC>(p.v, p.H, es, i, r.row, lane, nlanes);
  } else {
    quant_side<IN, OUT>(p.k, p.H, i, r.row, lane, nlanes);
    quant_side<IN, OUT>(p.v, p.H, i, r.row, lane, nlanes);
  }
}

template <int CHECK, DType IN, class OUT, int VEC>
struct StoreKVToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreKVParams& p, i64 i, int lane, int nlanes) const {
#if !defined(__CUDA_ARCH__)
    if constexpr (!std::is_void<OUT>::value) {  // the fp8 rows of a later token, asked for now
      const i64 row = nlanes == 1 ? prefetch_row(p.locs, i + PREFETCH_AHEAD) : -1;
      if (row >= 0) {
        p.k.cache.prefetch_heads(row, p.H, p.k.D);
        p.v.cache.prefetch_heads(row, p.H, p.v.D);
      }
    }
#endif
    store_kv_token<CHECK, IN, OUT, VEC>(p, i, lane, nlanes);
  }
};

// f(TypeTag<StoreKVToken<...>>, work items per token) for the runtime check mode and dtypes.
template <class F>
void dispatch_store_kv(const StoreKVParams& p, int check, F&& f) {
  const i64 d = p.k.D > p.v.D ? p.k.D : p.v.D;
  with_check(check, [&](auto c) {
    if (p.cache_dtype == p.in_dtype) {
      with_vec(store_kv_vec(p), [&](auto vec) {
        f(TypeTag<StoreKVToken<c.value, DType::F32, void, vec.value>>{}, p.H * d * dtype_size(p.in_dtype) / vec.value);
      });
    } else {
      with_float_dtype(p.in_dtype, [&](auto in) {
        with_fp8(p.cache_dtype, [&](auto fmt) {
          f(TypeTag<StoreKVToken<c.value, in.value, typename decltype(fmt)::type, 1>>{},
            d % CHUNK == 0 ? 2 * p.H * d / CHUNK : p.H * d);
        });
      });
    }
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreKVParams& p) {
  const i64 es = dtype_size(p.in_dtype), quant = p.cache_dtype != p.in_dtype;
  return i64(p.H) * (p.k.D + p.v.D) * (quant ? (es + 1) * QUANT_WEIGHT : 2 * es);
}
KVW_BODY(StoreKVParams, dispatch_store_kv)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> StoreKVParams and
// its op table row (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_KV(X) \
  X(store_kv, reg::Bind<&store_kv_params>::table, "(" KVW_KV "Tensor? k_scale, Tensor? v_scale, " KVW_TAIL ") -> ()")

namespace kvwrite {

inline KVSide kv_side(const Tensor& x, const Tensor& cache, const OptTensor& scale, const char* name) {
  TORCH_CHECK(x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1), "kvwrite: ", name,
              " must be [tokens, heads, dim], contiguous in dim");
  const int64_t feat = cache.dim() == 5 ? cache.size(3) * cache.size(4) : cache.size(3);
  TORCH_CHECK(cache.size(2) == x.size(1) && feat == x.size(2), "kvwrite: ", name,
              " cache shape does not match its rows");
  check_same_device(x, cache, "cache");
  KVSide s = source_rows<KVSide>(x);
  s.cache = paged(cache, name);
  if (scale.has_value()) {
    TORCH_CHECK(scale->scalar_type() == at::kFloat && scale->numel() >= 1, "kvwrite: ", name, " scale must be fp32");
    check_same_device(x, *scale, "scale");
    s.scale = scale->data_ptr<float>();
    s.scale_stride = scale->numel() > 1 ? 1 : 0;
  }
  return s;
}

inline StoreKVParams store_kv_params(const Tensor& k, const Tensor& v, const Tensor& k_cache,
                                     const Tensor& v_cache, const OptTensor& k_scale,
                                     const OptTensor& v_scale, const Tensor& loc,
                                     const OptTensor& loc_map, const OptTensor& errors,
                                     int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  StoreKVParams p;
  p.in_dtype = dtype_of(k);
  p.cache_dtype = dtype_of(k_cache);
  TORCH_CHECK(v.scalar_type() == k.scalar_type() && v_cache.scalar_type() == k_cache.scalar_type(),
              "kvwrite: k/v and k_cache/v_cache must share dtypes");
  const bool quant = is_fp8(p.cache_dtype);
  TORCH_CHECK(quant ? (k_scale.has_value() && v_scale.has_value()) : p.cache_dtype == p.in_dtype,
              "kvwrite: the cache dtype must equal the input dtype, or be fp8 with k_scale/v_scale");
  p.k = kv_side(k, k_cache, quant ? k_scale : std::nullopt, "k_cache");
  p.v = kv_side(v, v_cache, quant ? v_scale : std::nullopt, "v_cache");
  p.H = int(k.size(1));
  TORCH_CHECK(v.size(0) == k.size(0) && v.size(1) == k.size(1) && v_cache.size(0) == k_cache.size(0) &&
                  v_cache.size(1) == k_cache.size(1),
              "kvwrite: k/v and their caches must agree on tokens, heads, pages and rows");
  p.locs = cache_locs(k, k_cache, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  return p;
}

}  // namespace kvwrite
#endif  // KVW_HOST
