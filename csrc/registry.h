// The raw ops of the kvwrite_ext library, each written once. KVW_OPS lists them: the op, its
// binding (a function template over a device policy: tensors -> params (params*.h) -> page table
// -> Dev::run) and its schema. From it come the schemas (define), each device's registrations
// (impl<Dev>) and the raw kernels api.h calls (Raw<Dev>). A device policy (ops.cpp: Cpu,
// cuda_ops.cpp: Cuda) has NAME and `run(params, check, ref)`: ref is the call's first tensor
// (every other tensor was checked to be on its device while building the params).
#pragma once

#include <torch/library.h>

#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "bodies.h"
#include "params.h"
#include "params_dsv4.h"
#include "params_int4.h"
#include "params_pages.h"
#include "params_rope.h"

namespace kvwrite {

// The fused RoPE stores (kvwrite/rope_store.h) rotate k (k_pe) into scratch rows, then store them:
// a row holds one token's rotated heads in the input dtype.
template <class P, class = void>
constexpr bool HAS_SCRATCH = false;
template <class P>
constexpr bool HAS_SCRATCH<P, std::void_t<decltype(P::scratch)>> = true;
struct ScratchRow {
  i64 elems, elem_bytes;
};
inline ScratchRow scratch_row(const RopeStoreKVParams& p) {
  return {i64(p.kv.H) * p.kv.k.D, dtype_size(p.kv.in_dtype)};
}
inline ScratchRow scratch_row(const RopeStoreKVQuantParams& p) {
  return {i64(p.kv.H) * p.kv.k.D, dtype_size(p.kv.in_dtype)};
}
inline ScratchRow scratch_row(const RopeStoreMLAParams& p) { return {p.mla.R, dtype_size(p.mla.in_dtype)}; }

namespace reg {

template <class T>
struct IsVariant : std::false_type {};
template <class... T>
struct IsVariant<std::variant<T...>> : std::true_type {};

inline const Tensor* tensor_ptr(const Tensor& t) { return &t; }
template <class T>
const Tensor* tensor_ptr(const T&) {
  return nullptr;
}
template <class... A>
const Tensor& first_tensor(const A&... a) {
  const Tensor* t = nullptr;
  ((t = t != nullptr ? t : tensor_ptr(a)), ...);
  return *t;
}

// The params' locs to address by a page table (locs_of is const: the params are ours to change).
template <class P>
LocArgs& locs_to_set(P& p) {
  return const_cast<LocArgs&>(locs_of(p));
}

// An op whose params `Make` builds from its arguments, which end with the common `..., check, op`
// (one params type, or a std::variant of the types a format argument picks between).
template <auto Make, class Sig = decltype(Make)>
struct Bind;
template <auto Make, class Made, class... A>
struct Bind<Make, Made (*)(A...)> {
  template <class Dev, class Table>
  static void run(const Table& table, const A&... a) {
    static_assert(std::is_same_v<std::decay_t<std::tuple_element_t<sizeof...(A) - 2, std::tuple<A...>>>, int64_t>,
                  "a params maker's arguments end with check, op");
    const int64_t check = std::get<sizeof...(A) - 2>(std::forward_as_tuple(a...));
    const Tensor& ref = first_tensor(a...);
    Made made = Make(a...);
    const auto go = [&](auto& p) {
      table(p, ref);
      Dev::run(p, check, ref);
    };
    if constexpr (IsVariant<Made>::value) {
      std::visit(go, made);
    } else {
      go(made);
    }
  }
  // the tail's page table (batch_indices, kv_indices, kv_indptr: kvwrite.PageTable)
  template <class Dev>
  static void table(A... a, const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
    run<Dev>([&](auto& p, const Tensor& ref) { set_table(locs_to_set(p), batch_indices, kv_indices, kv_indptr, ref); },
             a...);
  }
  // the same tail for a store without page tables (the DeepSeek V4 stores): rejected when given
  template <class Dev>
  static void no_table(A... a, const OptTensor& batch_indices, const OptTensor& kv_indices,
                       const OptTensor& kv_indptr) {
    run<Dev>([&](auto& p, const Tensor&) { kvw_dsv4_table(locs_to_set(p), batch_indices, kv_indices, kv_indptr); },
             a...);
  }
  // no table arguments
  template <class Dev>
  static void plain(A... a) {
    run<Dev>([](auto&, const Tensor&) {}, a...);
  }
};

// The duplicate-row pre-pass of a store in assert / guard mode (kvwrite/claims.h): the loc the
// store runs on (guard), or an empty tensor (the store runs on its own loc); see Dev::run.
template <class Dev>
Tensor claim_rows(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                  int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                  const OptTensor& kv_indices, const OptTensor& kv_indptr, int64_t capacity, int64_t pool_page_size,
                  bool dcp_page) {
  ClaimParams p;
  p.a = claim_locs(loc, loc_map, errors, dcp_rank, dcp_size, check, op, batch_indices, kv_indices, kv_indptr, capacity,
                   pool_page_size, dcp_page);
  return Dev::run(p, check, loc);
}

}  // namespace reg

// Every store ends with the same tail: loc, loc_map, errors, dcp_rank, dcp_size, check, op.
// Page-table addressing (kvwrite.PageTable: loc = positions) adds the three optional tables.
#define KVW_TAIL_NO_TABLE "Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op"
#define KVW_TAIL KVW_TAIL_NO_TABLE ", Tensor? batch_indices=None, Tensor? kv_indices=None, Tensor? kv_indptr=None"

// Schema fragments several ops share: the K/V pair and its caches, the fused RoPE stores' head.
#define KVW_KV "Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
#define KVW_ROPE "Tensor positions, Tensor(c!) q, Tensor k, Tensor v, Tensor cos_sin, " \
                 "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_scale, Tensor? v_scale, "
#define KVW_NORM "Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, bool is_neox, "

// The op table: X(op, binding, schema). `Bind<&maker>::table`: the maker's arguments plus the
// page table; `::no_table`: the same tail, tables rejected (the V4 stores and store_rows);
// `::plain`: the maker's arguments alone.
#define KVW_OPS(X)                                                                                                     \
  X(store_kv, reg::Bind<&store_kv_params>::table, "(" KVW_KV "Tensor? k_scale, Tensor? v_scale, " KVW_TAIL ") -> ()")  \
  X(store_kv_quant, reg::Bind<&store_kv_quant_params>::table,                                                          \
    "(" KVW_KV "Tensor? k_scale, Tensor? v_scale, Tensor(c!)? k_scale_cache, Tensor(d!)? v_scale_cache, int quant, "  \
    "int rule, " KVW_TAIL ") -> ()")                                                                                   \
  X(store_kv_int4, reg::Bind<&store_kv_int4_params>::table,                                                            \
    "(" KVW_KV "Tensor(c!) k_scale_cache, Tensor(d!) v_scale_cache, " KVW_TAIL ") -> ()")                              \
  X(store_kv_nvfp4, reg::Bind<&store_kv_nvfp4_params>::table,                                                          \
    "(" KVW_KV "Tensor(c!) k_scale_cache, Tensor(d!) v_scale_cache, Tensor? k_global_scale, "                         \
    "Tensor? v_global_scale, " KVW_TAIL ") -> ()")                                                                     \
  X(store_mla, reg::Bind<&store_mla_params>::table,                                                                    \
    "(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor? scale, Tensor(b!)? scale_cache, Tensor? global_scale, "  \
    "int kernel_mode, " KVW_TAIL ") -> ()")                                                                            \
  X(store_indexer_k, reg::Bind<&store_indexer_k_params>::table,                                                        \
    "(Tensor k, Tensor(a!) cache, int quant_block_size, bool ue8m0, " KVW_TAIL ") -> ()")                              \
  X(store_dsv4_kv, reg::Bind<&store_dsv4_kv_params>::no_table,                                                         \
    "(Tensor kv, Tensor(a!) cache, int pool_page_size, " KVW_TAIL ") -> ()")                                           \
  X(store_dsv4_indexer_k, reg::Bind<&store_dsv4_indexer_k_params>::no_table,                                           \
    "(Tensor k, Tensor(a!) cache, int pool_page_size, int fmt_code, bool ue8m0, " KVW_TAIL ") -> ()")                  \
  X(store_rows, reg::Bind<&store_rows_params>::no_table, "(Tensor src, Tensor(a!) pool, " KVW_TAIL ") -> ()")          \
  X(store_dsv4_kv_fp4, reg::Bind<&store_dsv4_fp4_params>::plain,                                                       \
    "(Tensor kv, Tensor(a!) cache, int pool_page_size, int fmt_code, " KVW_TAIL_NO_TABLE ") -> ()")                    \
  X(rope_store_dsv4_kv_fp4, reg::Bind<&rope_store_dsv4_fp4_params>::plain,                                             \
    "(Tensor positions, Tensor kv, Tensor cos_sin, Tensor(b!)? q, Tensor(a!) cache, "                                  \
    "int pool_page_size, int fmt_code, "                                                                               \
    KVW_TAIL_NO_TABLE ") -> ()")                                                                                       \
  X(rope_store_kv, reg::Bind<&rope_store_kv_params>::table, "(" KVW_ROPE KVW_NORM KVW_TAIL ") -> ()")                  \
  X(rope_store_kv_quant, reg::Bind<&rope_store_kv_quant_params>::table,                                                \
    "(" KVW_ROPE "Tensor(d!)? k_scale_cache, Tensor(e!)? v_scale_cache, int quant, int rule, " KVW_NORM KVW_TAIL       \
    ") -> ()")                                                                                                         \
  X(rope_store_mla, reg::Bind<&rope_store_mla_params>::table,                                                          \
    "(Tensor positions, Tensor(c!) q, Tensor kv_c, Tensor k_pe, Tensor cos_sin, Tensor(a!) kv_cache, "                 \
    "Tensor? scale, Tensor(b!)? scale_cache, Tensor? global_scale, int kernel_mode, bool is_neox, "                    \
    KVW_TAIL ") -> ()")                                                                                                \
  X(copy_pages, reg::Bind<&copy_pages_params>::plain,                                                                  \
    "(Tensor src, Tensor(a!) dst, Tensor src_pages, Tensor dst_pages, Tensor(z!)? errors, int check, int op) -> ()")  \
  X(gather, reg::Bind<&gather_params>::table, "(Tensor cache, Tensor(a!) out, " KVW_TAIL ") -> ()")                    \
  X(slot_mapping, reg::Bind<&slot_mapping_params>::plain,                                                              \
    "(Tensor block_table, Tensor batch_indices, Tensor positions, Tensor(a!) out, int pool_page_size, int num_pages, " \
    "Tensor(z!)? errors, int check, int op) -> ()")                                                                    \
  X(claim_rows, reg::claim_rows,                                                                                       \
    "(Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op, "               \
    "Tensor? batch_indices, Tensor? kv_indices, Tensor? kv_indptr, int capacity, int pool_page_size, "                \
    "bool dcp_page) -> Tensor")

// The schemas (TORCH_LIBRARY(kvwrite_ext)).
inline void define_ops(torch::Library& m) {
#define KVW_DEF(op, bind, schema) m.def(#op schema);
  KVW_OPS(KVW_DEF)
#undef KVW_DEF
}

// A typed raw kernel called with its arguments as IValues (schema order): the generic launcher
// of api.h (`Program::raw`), no dispatcher on the way.
template <class Ret, class... A, size_t... I>
void call_unboxed(Ret (*f)(A...), std::vector<c10::IValue>& s, std::index_sequence<I...>) {
  f(std::move(s[I]).template to<std::decay_t<A>>()...);
}
template <class Ret, class... A>
void call_unboxed(Ret (*f)(A...), std::vector<c10::IValue>& s) {
  TORCH_CHECK(s.size() == sizeof...(A), "kvwrite: a raw kernel takes ", sizeof...(A), " arguments, got ", s.size());
  call_unboxed(f, s, std::index_sequence_for<A...>{});
}

// The raw ops' names in KVW_OPS order (Raw<Dev>::boxed's index).
inline const std::vector<std::string>& raw_names() {
  static const std::vector<std::string> names = {
#define KVW_NAME(op, bind, schema) #op,
      KVW_OPS(KVW_NAME)
#undef KVW_NAME
  };
  return names;
}

// One device's raw kernels by op name: what api::register_ops<R> calls (R::NAME, R::store_kv...),
// and by index into raw_names() with IValue arguments (R::boxed).
template <class Dev>
struct Raw {
  static constexpr const char* NAME = Dev::NAME;
#define KVW_RAW(op, bind, schema) static constexpr auto op = &bind<Dev>;
  KVW_OPS(KVW_RAW)
#undef KVW_RAW
  using Boxed = void (*)(std::vector<c10::IValue>&);
  static void boxed(size_t i, std::vector<c10::IValue>& s) {
    static const Boxed fns[] = {
#define KVW_BOXED(op, bind, schema) [](std::vector<c10::IValue>& s) { call_unboxed(&bind<Dev>, s); },
        KVW_OPS(KVW_BOXED)
#undef KVW_BOXED
    };
    fns[i](s);
  }
};

// The registrations of one device (TORCH_LIBRARY_IMPL(kvwrite_ext, <key>)).
template <class Dev>
void impl_ops(torch::Library& m) {
#define KVW_IMPL(op, bind, schema) m.impl(#op, Raw<Dev>::op);
  KVW_OPS(KVW_IMPL)
#undef KVW_IMPL
}

}  // namespace kvwrite
