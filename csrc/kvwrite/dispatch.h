// Host-side helpers shared by the CUDA launchers and the CPU kernels: runtime arguments ->
// template parameters, and the thread mapping of the CUDA kernels. No torch, no CUDA headers.
#pragma once

#include <stdexcept>
#include <type_traits>

#include "common.h"
#include "fp8.h"

namespace kvwrite {

template <int V>
using IntTag = std::integral_constant<int, V>;
template <DType T>
using DTypeTag = std::integral_constant<DType, T>;
template <class T>
struct TypeTag {
  using type = T;
};

template <class F>
void with_check(int check, F&& f) {
  switch (check) {
    case CHECK_OFF: return f(IntTag<CHECK_OFF>{});
    case CHECK_ASSERT: return f(IntTag<CHECK_ASSERT>{});
    case CHECK_GUARD: return f(IntTag<CHECK_GUARD>{});
    default: throw std::invalid_argument("kvwrite: check must be 0 (off), 1 (assert) or 2 (guard)");
  }
}

template <class F>
void with_float_dtype(DType t, F&& f) {
  switch (t) {
    case DType::F32: return f(DTypeTag<DType::F32>{});
    case DType::F16: return f(DTypeTag<DType::F16>{});
    case DType::BF16: return f(DTypeTag<DType::BF16>{});
    default: throw std::invalid_argument("kvwrite: inputs must be float32, float16 or bfloat16");
  }
}

template <class F>
void with_fp8(DType t, F&& f) {
  switch (t) {
    case DType::E4M3: return f(TypeTag<E4M3>{});
    case DType::E5M2: return f(TypeTag<E5M2>{});
    case DType::E4M3FNUZ: return f(TypeTag<E4M3FNUZ>{});
    default: throw std::invalid_argument("kvwrite: fp8 cache must be float8_e4m3fn, float8_e5m2 or float8_e4m3fnuz");
  }
}

// Copy units of 16, 4 or 1 bytes: an 8-byte-aligned row copies in 4-byte units and a 2-byte one
// in single bytes (a smaller unit always divides; such rows are rare), so each copy body has three
// instantiations, not five (compile time; same bytes).
template <class F>
void with_vec(int bytes, F&& f) {
  if (bytes >= 16) return f(IntTag<16>{});
  if (bytes >= 4) return f(IntTag<4>{});
  return f(IntTag<1>{});
}

// CUDA launch shape: `group` threads per token (a power of two covering one token's work items,
// at most 256), so a token's row is spread over many threads and small per-token work (one
// indexer block) packs up to 256 tokens into a 256-thread block.
struct LaunchShape {
  i64 blocks;
  int threads, group;
};

inline LaunchShape launch_shape(i64 n_tokens, i64 work_per_token, int threads = 256) {
  int group = 1;
  while (group < threads && group < work_per_token) group *= 2;
  const int per_block = threads / group;
  return LaunchShape{ceil_div(n_tokens, per_block), threads, group};
}

// The fused RoPE stores (kvwrite/rope_store.h) rotate k (k_pe) into scratch rows, then store them:
// a row holds one token's rotated heads in the input dtype (scratch_row(p), beside each).
template <class P, class = void>
constexpr bool HAS_SCRATCH = false;
template <class P>
constexpr bool HAS_SCRATCH<P, std::void_t<decltype(P::scratch)>> = true;
struct ScratchRow {
  i64 elems, elem_bytes;
};

// The CPU runner's cost of a token (token_bytes, next to each body): bytes read + written, a
// quantised byte counted QUANT_WEIGHT times (it costs that much more compute; ops.cpp).
constexpr i64 QUANT_WEIGHT = 8;

}  // namespace kvwrite

// An op's body, declared at the end of the header that defines its params type P and body
// dispatcher fn (inside namespace kvwrite): `KVW_BODY(StoreKVParams, dispatch_store_kv)` adds
// the overload dispatch(p, check, f) that the CPU runner (tokens_cpu.h) and the CUDA launcher
// (tokens.cuh) call. The build derives six units per use, one per device and check mode:
// `KVW_CPU_RUN(P, C)` and `KVW_LAUNCH(P, C)` (kvwrite._ext.launch_units: a KVW_BODY line at the
// start of a line in a csrc/kvwrite/*.h header).
#define KVW_BODY(P, fn) \
  template <class F>    \
  void dispatch(const P& p, int check, F&& f) { fn(p, check, f); }
