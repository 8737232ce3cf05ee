// The host side every op shares (torch): common params fields, the binding reg::Bind, the schema
// fragments. Python has validated every argument; the checks here only guard direct callers.
#pragma once

#ifdef __CUDACC__
#error "host.h is host code (torch): the CUDA units see the body headers without KVW_HOST"
#endif

#include <optional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/where.h>
#include <c10/util/Exception.h>
#include <c10/util/ScopeExit.h>

#include "kvwrite/locs.h"
#include "kvwrite/paged.h"

namespace kvwrite {

using at::Tensor;
using OptTensor = std::optional<Tensor>;

inline DType dtype_of(const Tensor& t) {
  static const std::pair<at::ScalarType, DType> types[] = {
      {at::kFloat, DType::F32}, {at::kHalf, DType::F16}, {at::kBFloat16, DType::BF16}, {at::kByte, DType::U8},
      {at::kFloat8_e4m3fn, DType::E4M3}, {at::kFloat8_e5m2, DType::E5M2}, {at::kFloat8_e4m3fnuz, DType::E4M3FNUZ}};
  for (const auto& [st, dt] : types)
    if (st == t.scalar_type()) return dt;
  TORCH_CHECK(false, "kvwrite: unsupported dtype ", t.scalar_type());
}

inline bool is_fp8(DType t) { return t == DType::E4M3 || t == DType::E5M2 || t == DType::E4M3FNUZ; }

inline void check_same_device(const Tensor& ref, const Tensor& t, const char* name) {
  TORCH_CHECK(t.device() == ref.device(), "kvwrite: ", name, " is on ", t.device(), " but the inputs are on ",
              ref.device());
}

// A side's source rows x [tokens, heads, D] (D contiguous): the fields every *Side shares.
template <class Side>
Side source_rows(const Tensor& x) {
  Side s;
  s.src = static_cast<const char*>(x.data_ptr());
  s.s_tok = x.stride(0);
  s.s_head = x.stride(1);
  s.D = int(x.size(2));
  return s;
}

// The cache whose pages, rows and heads are dims (page, row, head) of `c` (feat: its last, dense).
inline PagedCache paged_dims(const Tensor& c, int page, int row, int head) {
  PagedCache p;
  p.base = static_cast<char*>(c.data_ptr());
  p.stride_page = c.stride(page);
  p.stride_entry = c.stride(row);
  p.stride_head = c.stride(head);
  p.pool_page_size = c.size(row);
  p.elem_size = int(c.element_size());
  return p;
}

inline void check_last_dense(const Tensor& c, const char* name) {
  TORCH_CHECK(c.size(c.dim() - 1) <= 1 || c.stride(c.dim() - 1) == 1, "kvwrite: ", name,
              " must be contiguous in its last dim");
}

// A canonical [pages, pool_page_size, heads, feat] cache view (feat contiguous), or
// [pages, pool_page_size, heads, feat / X, X] (a split head dim, X contiguous).
inline PagedCache paged(const Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 4 || c.dim() == 5, "kvwrite: ", name, " must be a 4-D [pages, rows, heads, feat] view");
  check_last_dense(c, name);
  PagedCache p = paged_dims(c, 0, 1, 2);
  if (c.dim() == 5) p.split = int(c.size(4)), p.stride_split = c.stride(3);
  return p;
}

// A [pages, pool_page_size, row] cache (one head): paged(c.unsqueeze(2)) without making the view
// (a tensor op, autograd view meta and all, on every call).
inline PagedCache paged_rows(const Tensor& c, const char* name) {
  TORCH_CHECK(c.dim() == 3, "kvwrite: ", name, " must be a 3-D [pages, rows, row] tensor");
  check_last_dense(c, name);
  PagedCache p = paged_dims(c, 0, 1, 2);
  p.stride_head = c.size(2) * c.stride(2);  // unsqueeze(2)'s stride of the inserted dim
  return p;
}

// An index tensor (loc_map, a page table's): a contiguous 1-D int32/int64 tensor on ref's device.
inline const void* index_ptr(const Tensor& t, const char* name, const Tensor& ref, bool& is64) {
  TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) &&
                  (t.numel() <= 1 || t.stride(0) == 1),
              "kvwrite: ", name, " must be a contiguous 1-D int32/int64 tensor");
  check_same_device(ref, t, name);
  is64 = t.scalar_type() == at::kLong;
  return t.data_ptr();
}

inline LocArgs loc_args(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                        int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
                        int64_t capacity, int64_t pool_page_size, const Tensor& ref) {
  TORCH_CHECK(loc.dim() == 1 && (loc.scalar_type() == at::kInt || loc.scalar_type() == at::kLong),
              "kvwrite: loc must be a 1-D int32/int64 tensor");
  TORCH_CHECK(loc.numel() <= 1 || loc.stride(0) == 1, "kvwrite: loc must be contiguous");
  TORCH_CHECK(dcp_size >= 1 && 0 <= dcp_rank && dcp_rank < dcp_size, "kvwrite: bad dcp_rank/dcp_size");
  TORCH_CHECK(0 <= check && check <= 2, "kvwrite: check must be 0, 1 or 2");
  check_same_device(ref, loc, "loc");
  LocArgs a;
  a.loc = loc.data_ptr();
  a.loc64 = loc.scalar_type() == at::kLong;
  a.n = loc.size(0);
  if (loc_map.has_value()) {
    a.loc_map = index_ptr(*loc_map, "loc_map", ref, a.map64);
    a.map_len = loc_map->size(0);
  }
  if (errors.has_value()) {
    const Tensor& e = *errors;
    TORCH_CHECK(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == slot::NUM_SLOTS && e.is_contiguous(),
                "kvwrite: errors must be a contiguous int64[16] ErrorBuffer tensor");
    check_same_device(ref, e, "errors");
    a.errors = e.data_ptr<int64_t>();
  }
  TORCH_CHECK(check != CHECK_GUARD || a.errors != nullptr, "kvwrite: check=guard needs an errors buffer");
  a.dcp_rank = dcp_rank;
  a.dcp_size = dcp_size;
  a.capacity = capacity;
  a.pool_page_size = pool_page_size;
  a.op = int(op);
  return a;
}

// The locs of a store of one row of `x` a token into `cache` ([pages, pool_page_size, ...]).
inline LocArgs cache_locs(const Tensor& x, const Tensor& cache, const Tensor& loc, const OptTensor& loc_map,
                          const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op) {
  LocArgs a = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, cache.size(0) * cache.size(1),
                       cache.size(1), x);
  TORCH_CHECK(a.n == x.size(0), "kvwrite: loc must have one entry per token");
  return a;
}

// Page-table addressing (kvwrite.PageTable): `a.loc` already holds the positions.
inline void set_table(LocArgs& a, const OptTensor& batch_indices, const OptTensor& kv_indices,
                      const OptTensor& kv_indptr, const Tensor& ref) {
  if (!batch_indices.has_value()) {
    TORCH_CHECK(!kv_indices.has_value() && !kv_indptr.has_value(),
                "kvwrite: kv_indices/kv_indptr need batch_indices");
    return;
  }
  TORCH_CHECK(kv_indices.has_value() && kv_indptr.has_value(),
              "kvwrite: page-table addressing needs batch_indices, kv_indices and kv_indptr");
  TORCH_CHECK(a.loc_map == nullptr && a.dcp_size == 1, "kvwrite: a page table does not combine with loc_map or DCP");
  a.batch = index_ptr(*batch_indices, "batch_indices", ref, a.batch64);
  a.table = index_ptr(*kv_indices, "kv_indices", ref, a.table64);
  a.indptr = index_ptr(*kv_indptr, "kv_indptr", ref, a.indptr64);
  TORCH_CHECK(batch_indices->size(0) == a.n, "kvwrite: batch_indices must have one entry per token");
  TORCH_CHECK(kv_indptr->size(0) >= 1, "kvwrite: kv_indptr must have batch_size + 1 >= 1 entries");
  a.n_table = kv_indices->size(0);
  a.n_batch = kv_indptr->size(0) - 1;
}

// The fused RoPE stores (ROPED<P> = true beside each; ops.cpp Cpu::run).
template <class P>
constexpr bool ROPED = false;

// Tensors a params maker made for its kernel (a norm weight as fp32), alive until the kernel was
// enqueued (reg::Bind::run lets go; on a GPU the caching allocator orders their reuse on the stream).
inline thread_local std::vector<Tensor> held;
inline Tensor hold(Tensor t) {
  held.push_back(t);
  return t;
}

// The bytes of the tensors of the CPU call this thread runs (its inputs and pools), set before the
// CPU policy's run: whether the call streams its rows (stream.h).
inline thread_local int64_t call_footprint = 0;

namespace reg {

// The bytes of an argument's tensor (none: 0): a call's footprint (stream.h).
template <class A>
int64_t tensor_bytes(const A& a) {
  if constexpr (std::is_same_v<A, Tensor>) return int64_t(a.nbytes());
  else if constexpr (std::is_same_v<A, OptTensor>) return a.has_value() ? int64_t(a->nbytes()) : 0;
  else return 0;
}

template <class... A>
const Tensor& first_tensor(const A&... a) {
  const Tensor* t = nullptr;
  ([&] { if constexpr (std::is_same_v<A, Tensor>) t = t != nullptr ? t : &a; }(), ...);
  return *t;
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
    const auto release = c10::make_scope_exit([] { held.clear(); });
    Made made = Make(a...);
    if constexpr (Dev::TYPE == c10::DeviceType::CPU) call_footprint = (int64_t(0) + ... + tensor_bytes(a));
    const auto go = [&](auto& p) {
      table(p, ref);
      Dev::run(p, check, ref);
    };
    if constexpr (requires { std::variant_size<Made>::value; }) {
      std::visit(go, made);
    } else {
      go(made);
    }
  }
  // the tail's page table (batch_indices, kv_indices, kv_indptr: kvwrite.PageTable)
  template <class Dev>
  static void table(A... a, const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
    run<Dev>(
        [&](auto& p, const Tensor& ref) {  // locs_of is const: the params are ours to change
          set_table(const_cast<LocArgs&>(locs_of(p)), batch_indices, kv_indices, kv_indptr, ref);
        },
        a...);
  }
  // the same tail for a store without page tables (the DeepSeek V4 stores): rejected when given
  template <class Dev>
  static void no_table(A... a, const OptTensor& batch_indices, const OptTensor& kv_indices,
                       const OptTensor& kv_indptr) {
    run<Dev>(
        [&](auto&, const Tensor&) {
          TORCH_CHECK(!batch_indices.has_value() && !kv_indices.has_value() && !kv_indptr.has_value(),
                      "kvwrite: the DeepSeek V4 stores take no page table");
        },
        a...);
  }
  // no table arguments
  template <class Dev>
  static void plain(A... a) {
    run<Dev>([](auto&, const Tensor&) {}, a...);
  }
};

}  // namespace reg

}  // namespace kvwrite

// Every store's tail (csrc/README.md); page-table addressing (loc = positions) adds three tables.
#define KVW_TAIL_NO_TABLE "Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op"
#define KVW_TAIL KVW_TAIL_NO_TABLE ", Tensor? batch_indices=None, Tensor? kv_indices=None, Tensor? kv_indptr=None"
// The K/V pair and its caches (store_kv and its formats).
#define KVW_KV "Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, "
