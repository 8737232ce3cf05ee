// Page moves: copy_pages (unit pairs between two pools), gather (rows at locs, a zero row for a
// token not read) and slot_mapping (block table -> slots). The twins of kernels/pages.py and
// kvwrite/reference/pages.py; host and device share these bodies (the CPU kernels in ops.cpp,
// the CUDA kernels in csrc/pages.cu).
#pragma once

#include "dispatch.h"
#include "locs.h"
#include "paged.h"

namespace kvwrite {

// Record kinds of kvwrite.errors (numbered apart from the stores' kinds).
constexpr int KIND_SRC_PAGE = 16, KIND_DST_PAGE = 17;
constexpr int KIND_BLOCK_ROW = 18, KIND_BLOCK_INDEX = 19, KIND_BLOCK_PAGE = 20;

// A pool counted in units of the smaller pool's page: unit u is rows (u % factor) * unit_rows ...
// of page u / factor. Strides in bytes; a row is `heads` runs of `head_bytes`.
struct UnitPool {
  char* base = nullptr;
  i64 stride_page = 0, stride_row = 0, stride_head = 0;
  i64 factor = 1, count = 0;
  bool run = false;  // a unit is one contiguous run of bytes

  KVW_HD char* unit_ptr(i64 u, i64 unit_rows) const {
    const i64 page = u / factor;
    return base + page * stride_page + (u - page * factor) * unit_rows * stride_row;
  }
};

struct CopyPagesParams {
  UnitPool src, dst;
  i64 unit_rows = 1;
  int heads = 1;
  i64 head_bytes = 0;
  int vec = 1;  // bytes per copy unit: divides head_bytes, every stride and both bases
  const void* src_ids = nullptr;
  bool src64 = true;
  const void* dst_ids = nullptr;
  bool dst64 = true;
  i64 n = 0;
  i64* errors = nullptr;
  int op = 0;

  KVW_HD i64 unit_bytes() const { return unit_rows * heads * head_bytes; }
};

struct PairResolved {
  i64 s, d, target, limit;
  int kind;
  bool write, bad;
};

// Pair i: a -1 on either side skips it; assert/guard check src, then dst, against the pools'
// units; off skips negative ids (and, on the host, ids past a pool: see locs.h).
template <int CHECK>
KVW_HD PairResolved resolve_pair(const CopyPagesParams& p, i64 i) {
  PairResolved r;
  r.s = load_index(p.src_ids, p.src64, i);
  r.d = load_index(p.dst_ids, p.dst64, i);
  const bool live = r.s != -1 && r.d != -1;
  const bool bad_s = live && (r.s < 0 || r.s >= p.src.count);
  const bool bad_d = live && !bad_s && (r.d < 0 || r.d >= p.dst.count);
  r.kind = bad_s ? KIND_SRC_PAGE : KIND_DST_PAGE;
  r.target = bad_s ? r.s : r.d;
  r.limit = bad_s ? p.src.count : p.dst.count;
  if (CHECK == CHECK_OFF) {
    r.bad = false;
    r.write = live && r.s >= 0 && r.d >= 0 && (KVWRITE_OFF_BOUND == 0 || (r.s < p.src.count && r.d < p.dst.count));
  } else {
    r.bad = bad_s || bad_d;
    r.write = live && !r.bad;
  }
  return r;
}

KVW_HD Violation pair_violation(const CopyPagesParams& p, i64 i, const PairResolved& r) {
  return Violation{i, r.target, r.target, r.limit, p.unit_rows, r.kind, p.op};
}

template <int CHECK>
KVW_HD PairResolved resolve_pair_checked(const CopyPagesParams& p, i64 i, bool lead) {
  const PairResolved r = resolve_pair<CHECK>(p, i);
  if (CHECK != CHECK_OFF && r.bad && lead) on_bad<CHECK>(p.errors, pair_violation(p, i, r));
  return r;
}

// Copy items [begin, end) of a unit (item = VEC bytes of one head of one row), lane-strided.
template <int VEC>
KVW_HD void copy_unit_items(const CopyPagesParams& p, const char* s, char* d, i64 begin, i64 end, int lane,
                            int nlanes) {
  const i64 per_head = p.head_bytes / VEC, per_row = per_head * p.heads;
  for (i64 k = begin + lane; k < end; k += nlanes) {
    const i64 r = k / per_row, rem = k - r * per_row, h = rem / per_head, b = (rem - h * per_head) * VEC;
    copy_unit<VEC>(d + r * p.dst.stride_row + h * p.dst.stride_head + b,
                   s + r * p.src.stride_row + h * p.src.stride_head + b);
  }
}

#if !defined(__CUDA_ARCH__)
// Host: one memcpy per unit when both sides are runs, else one per (row, head) run.
inline void copy_unit_host(const CopyPagesParams& p, const char* s, char* d) {
  if (p.src.run && p.dst.run) {
    memcpy(d, s, size_t(p.unit_bytes()));
    return;
  }
  for (i64 r = 0; r < p.unit_rows; ++r)
    copy_runs(d + r * p.dst.stride_row, p.dst.stride_head, s + r * p.src.stride_row, p.src.stride_head, p.heads,
              p.head_bytes);
}
#endif

// gather: row loc[i] of `cache` into out[i] (a zero row when the token is not read).
struct GatherParams {
  PagedCache cache;  // canonical [pages, rows, heads, feat], feat contiguous
  char* out = nullptr;
  i64 out_sn = 0;  // bytes between out rows; a row is heads * head_bytes contiguous bytes
  int heads = 1;
  i64 head_bytes = 0;
  int vec = 1;
  LocArgs locs;
};

template <int VEC>
KVW_HD void zero_unit(char* dst) {
  alignas(16) const char zeros[16] = {0};
  copy_unit<VEC>(dst, zeros);
}

template <int CHECK, int VEC>
KVW_HD void gather_token(const GatherParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  char* o = p.out + i * p.out_sn;
  const i64 row_bytes = p.heads * p.head_bytes;
#if !defined(__CUDA_ARCH__)
  if (nlanes == 1) {
    if (!r.write) {
      memset(o, 0, size_t(row_bytes));
    } else {
      copy_runs(o, p.head_bytes, p.cache.row_ptr(r.row), p.cache.stride_head * p.cache.elem_size, p.heads,
                p.head_bytes);
    }
    return;
  }
#endif
  const i64 per_head = p.head_bytes / VEC;
  if (!r.write) {
    for (i64 u = lane; u < row_bytes / VEC; u += nlanes) zero_unit<VEC>(o + u * VEC);
    return;
  }
  const char* s = p.cache.row_ptr(r.row);
  for (i64 u = lane; u < p.heads * per_head; u += nlanes) {
    const i64 h = u / per_head, b = (u - h * per_head) * VEC;
    copy_unit<VEC>(o + h * p.head_bytes + b, s + p.cache.in_row(h, 0) + b);
  }
}

template <int CHECK, int VEC>
struct GatherToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const GatherParams& p, i64 i, int lane, int nlanes) const {
    gather_token<CHECK, VEC>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_gather(const GatherParams& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_vec(p.vec, [&](auto v) { f(TypeTag<GatherToken<c.value, v.value>>{}, p.heads * p.head_bytes / v.value); });
  });
}

// slot_mapping: slot = block_table[b, pos // page_size] * page_size + pos % page_size, or -1.
struct SlotMappingParams {
  const void* table = nullptr;
  bool table64 = true;
  i64 rows = 0, width = 0, row_stride = 0;  // block_table [rows, width], elements
  const void* batch = nullptr;
  bool batch64 = true;
  const void* pos = nullptr;
  bool pos64 = true;
  i64 n = 0;
  i64 page_size = 1, num_pages = 0;
  i64* out = nullptr;
  i64* errors = nullptr;
  int op = 0;
};

// Token i's slot: -1 for padding (b or pos == -1), a row or block the table does not have (never
// read; assert/guard report it), a negative page; assert/guard: also a page past the pool.
template <int CHECK>
KVW_HD void slot_token(const SlotMappingParams& p, i64 i) {
  const i64 b = load_index(p.batch, p.batch64, i), pos = load_index(p.pos, p.pos64, i);
  i64 slot = -1;
  if (b == -1 || pos == -1) {
    p.out[i] = slot;
    return;
  }
  i64 q = pos / p.page_size, e = pos - q * p.page_size;
  if (e < 0) {
    q -= 1;
    e += p.page_size;
  }
  int kind = KIND_BLOCK_PAGE;
  i64 target = 0, limit = 0, page = -1;
  if (!(b >= 0 && b < p.rows)) {
    kind = KIND_BLOCK_ROW;
    target = b;
    limit = p.rows;
  } else if (!(q >= 0 && q < p.width)) {
    kind = KIND_BLOCK_INDEX;
    target = q;
    limit = p.width;
  } else {
    page = load_index(p.table, p.table64, b * p.row_stride + q);
    if (CHECK == CHECK_OFF ? page >= 0 : (page >= 0 && page < p.num_pages)) {
      p.out[i] = page * p.page_size + e;
      return;
    }
    target = page;
    limit = p.num_pages;
  }
  p.out[i] = slot;
  if (CHECK == CHECK_OFF) return;
  // a bad token (the rare path): its record
  Violation v{i, kind == KIND_BLOCK_PAGE ? page * p.page_size + e : -1, target, limit, p.page_size, kind, p.op};
  v.table = true;
  v.batch = b;
  v.position = pos;
  v.table_slot = kind == KIND_BLOCK_ROW ? -1 : q;
  v.table_page = kind == KIND_BLOCK_PAGE ? page : -1;
  on_bad<CHECK>(p.errors, v);
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const GatherParams& p) { return 2 * p.heads * p.head_bytes; }
KVW_BODY(GatherParams, dispatch_gather)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors -> the page moves'
// params (kvwrite.ops.pages validated every argument: canonical [pages, rows, heads, feat] pools,
// index tensors on the pools' device) and their op table rows (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_PAGES(X) \
  X(copy_pages, reg::Bind<&copy_pages_params>::plain, \
    "(Tensor src, Tensor(a!) dst, Tensor src_pages, Tensor dst_pages, Tensor(z!)? errors, int check, int op) -> ()") \
  X(gather, reg::Bind<&gather_params>::table, "(Tensor cache, Tensor(a!) out, " KVW_TAIL ") -> ()") \
  X(slot_mapping, reg::Bind<&slot_mapping_params>::plain, \
    "(Tensor block_table, Tensor batch_indices, Tensor positions, Tensor(a!) out, int pool_page_size, int num_pages, " \
    "Tensor(z!)? errors, int check, int op) -> ()") \
  X(move_rows, run_move_rows, \
    "(Tensor(a!) cache, Tensor src_loc, Tensor dst_loc, Tensor(z!)? errors, int check, int op) -> ()")

namespace kvwrite {

// A pool of any rank >= 2 as its [pages, rows, heads, feat] view (ops._common.canonical_pool).
inline Tensor pool4(const Tensor& x) {
  if (x.dim() == 2) return x.unsqueeze(-1).unsqueeze(-1);
  if (x.dim() == 3) return x.unsqueeze(2);
  return x.dim() == 4 ? x : x.view({x.size(0), x.size(1), x.size(2), -1});
}

inline UnitPool unit_pool(const Tensor& t, i64 factor, const char* name) {
  TORCH_CHECK(t.dim() == 4 && (t.size(3) <= 1 || t.stride(3) == 1), "kvwrite: ", name,
              " must be a canonical [pages, rows, heads, feat] view, feat contiguous");
  const i64 es = t.element_size();
  UnitPool u;
  u.base = static_cast<char*>(t.data_ptr());
  u.stride_page = t.stride(0) * es;
  u.stride_row = t.stride(1) * es;
  u.stride_head = t.stride(2) * es;
  u.factor = factor;
  u.count = t.size(0) * factor;
  return u;
}

inline void index_tensor(const Tensor& t, const Tensor& ref, const char* name) {
  TORCH_CHECK(t.dim() == 1 && (t.scalar_type() == at::kInt || t.scalar_type() == at::kLong) &&
                  (t.numel() <= 1 || t.stride(0) == 1),
              "kvwrite: ", name, " must be a contiguous 1-D int32/int64 tensor");
  check_same_device(ref, t, name);
}

inline i64* errors_ptr(const OptTensor& errors, const Tensor& ref, int64_t check) {
  TORCH_CHECK(0 <= check && check <= 2, "kvwrite: check must be 0, 1 or 2");
  i64* p = nullptr;
  if (errors.has_value()) {
    const Tensor& e = *errors;
    TORCH_CHECK(e.scalar_type() == at::kLong && e.dim() == 1 && e.size(0) == slot::NUM_SLOTS && e.is_contiguous(),
                "kvwrite: errors must be a contiguous int64[16] ErrorBuffer tensor");
    check_same_device(ref, e, "errors");
    p = e.data_ptr<int64_t>();
  }
  TORCH_CHECK(check != CHECK_GUARD || p != nullptr, "kvwrite: check=guard needs an errors buffer");
  return p;
}

inline CopyPagesParams copy_pages_params(const Tensor& src_pool, const Tensor& dst_pool, const Tensor& src_pages,
                                         const Tensor& dst_pages, const OptTensor& errors, int64_t check,
                                         int64_t op) {
  TORCH_CHECK(src_pool.dim() >= 2 && dst_pool.dim() >= 2, "kvwrite: src and dst must be [pages, rows, ...] pools");
  const Tensor src = pool4(src_pool), dst = pool4(dst_pool);
  TORCH_CHECK(src.dim() == 4 && dst.dim() == 4 && src.scalar_type() == dst.scalar_type() &&
                  src.size(2) == dst.size(2) && src.size(3) == dst.size(3),
              "kvwrite: src and dst must be [pages, rows, heads, feat] pools of one row shape and dtype");
  check_same_device(dst, src, "src");
  index_tensor(src_pages, dst, "src_pages");
  index_tensor(dst_pages, dst, "dst_pages");
  TORCH_CHECK(src_pages.size(0) == dst_pages.size(0), "kvwrite: src_pages and dst_pages must pair up");
  const i64 ps = src.size(1), pd = dst.size(1);
  TORCH_CHECK(ps > 0 && pd > 0 && (ps % pd == 0 || pd % ps == 0),
              "kvwrite: the pools' page sizes must divide one another");
  CopyPagesParams p;
  p.unit_rows = ps < pd ? ps : pd;
  p.src = unit_pool(src, ps / p.unit_rows, "src");
  p.dst = unit_pool(dst, pd / p.unit_rows, "dst");
  p.heads = int(src.size(2));
  p.head_bytes = src.size(3) * src.element_size();
  const i64 row_bytes = p.heads * p.head_bytes;
  for (UnitPool* u : {&p.src, &p.dst})
    u->run = (p.heads == 1 || u->stride_head == p.head_bytes) && (p.unit_rows == 1 || u->stride_row == row_bytes);
  p.vec = vec_bytes(uint64_t(p.head_bytes) | uint64_t(reinterpret_cast<uintptr_t>(p.src.base)) |
                    uint64_t(reinterpret_cast<uintptr_t>(p.dst.base)) | uint64_t(p.src.stride_page) |
                    uint64_t(p.src.stride_row) | uint64_t(p.src.stride_head) | uint64_t(p.dst.stride_page) |
                    uint64_t(p.dst.stride_row) | uint64_t(p.dst.stride_head));
  p.src_ids = src_pages.data_ptr();
  p.src64 = src_pages.scalar_type() == at::kLong;
  p.dst_ids = dst_pages.data_ptr();
  p.dst64 = dst_pages.scalar_type() == at::kLong;
  p.n = src_pages.size(0);
  p.errors = errors_ptr(errors, dst, check);
  p.op = int(op);
  return p;
}

inline GatherParams gather_params(const Tensor& pool, const Tensor& out_rows, const Tensor& loc,
                                  const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                                  int64_t dcp_size, int64_t check, int64_t op) {
  TORCH_CHECK(pool.dim() >= 2 && out_rows.dim() == pool.dim() - 1,
              "kvwrite: gather needs a [pages, rows, ...] cache and [n, ...] out rows of its row shape");
  const Tensor cache = pool4(pool), out = out_rows.view({out_rows.size(0), cache.size(2), cache.size(3)});
  TORCH_CHECK(cache.dim() == 4 && out.dim() == 3 && out.scalar_type() == cache.scalar_type() &&
                  out.size(1) == cache.size(2) && out.size(2) == cache.size(3) &&
                  (out.size(2) <= 1 || out.stride(2) == 1) && (out.size(1) <= 1 || out.stride(1) == out.size(2)),
              "kvwrite: gather needs a [pages, rows, heads, feat] cache and contiguous [n, heads, feat] out rows");
  check_same_device(cache, out, "out");
  GatherParams p;
  p.cache = paged(cache, "cache");
  p.out = static_cast<char*>(out.data_ptr());
  p.out_sn = out.stride(0) * out.element_size();
  p.heads = int(cache.size(2));
  p.head_bytes = cache.size(3) * cache.element_size();
  const i64 es = cache.element_size();
  p.vec = vec_bytes(uint64_t(p.head_bytes) | uint64_t(reinterpret_cast<uintptr_t>(p.cache.base)) |
                    uint64_t(reinterpret_cast<uintptr_t>(p.out)) | uint64_t(p.out_sn) |
                    uint64_t(p.cache.stride_page * es) | uint64_t(p.cache.stride_entry * es) |
                    uint64_t(p.cache.stride_head * es));
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, cache.size(0) * cache.size(1),
                    cache.size(1), cache);
  TORCH_CHECK(p.locs.n == out.size(0), "kvwrite: loc must have one entry per out row");
  return p;
}

inline SlotMappingParams slot_mapping_params(const Tensor& block_table, const Tensor& batch_indices,
                                             const Tensor& positions, const Tensor& out, int64_t page_size,
                                             int64_t num_pages, const OptTensor& errors, int64_t check, int64_t op) {
  TORCH_CHECK(block_table.dim() == 2 && (block_table.scalar_type() == at::kInt || block_table.scalar_type() == at::kLong) &&
                  (block_table.size(1) <= 1 || block_table.stride(1) == 1),
              "kvwrite: block_table must be a 2-D int32/int64 tensor, contiguous in its last dim");
  index_tensor(batch_indices, block_table, "batch_indices");
  index_tensor(positions, block_table, "positions");
  TORCH_CHECK(out.scalar_type() == at::kLong && out.dim() == 1 && out.is_contiguous() &&
                  out.size(0) == positions.size(0) && batch_indices.size(0) == positions.size(0),
              "kvwrite: one batch index, position and int64 out slot per token");
  check_same_device(block_table, out, "out");
  TORCH_CHECK(page_size >= 1 && num_pages >= 0, "kvwrite: page_size must be positive");
  SlotMappingParams p;
  p.table = block_table.data_ptr();
  p.table64 = block_table.scalar_type() == at::kLong;
  p.rows = block_table.size(0);
  p.width = block_table.size(1);
  p.row_stride = block_table.stride(0);
  p.batch = batch_indices.data_ptr();
  p.batch64 = batch_indices.scalar_type() == at::kLong;
  p.pos = positions.data_ptr();
  p.pos64 = positions.scalar_type() == at::kLong;
  p.n = positions.size(0);
  p.page_size = page_size;
  p.num_pages = num_pages;
  p.out = out.data_ptr<int64_t>();
  p.errors = errors_ptr(errors, block_table, check);
  p.op = int(op);
  return p;
}

// move_rows (ops.pages.move): row dst_loc[i] of the pool takes the row at src_loc[i]. The source
// rows are gathered first (bad ones reported), then copied as one-row units; pair i reads gathered
// row i, or nothing (-1) when src_loc[i] is outside [0, capacity).
template <class Dev>
void run_move_rows(const Tensor& pool, const Tensor& src_loc, const Tensor& dst_loc, const OptTensor& errors,
                   int64_t check, int64_t op) {
  const Tensor cache = pool4(pool);
  const int64_t n = src_loc.size(0), capacity = cache.size(0) * cache.size(1);
  const Tensor rows = at::empty({n, 1, cache.size(2), cache.size(3)}, cache.options());
  reg::Bind<&gather_params>::table<Dev>(cache, rows.squeeze(1), src_loc, std::nullopt, errors, 0, 1, check, op,
                                         std::nullopt, std::nullopt, std::nullopt);
  Tensor live;
  if (src_loc.is_cpu()) {
    live = src_loc.to(at::kLong, false, true);  // a copy
    int64_t* p = live.data_ptr<int64_t>();
    for (int64_t i = 0; i < n; ++i) p[i] = p[i] >= 0 && p[i] < capacity ? i : -1;
  } else {
    live = at::where(src_loc.ge(0).logical_and_(src_loc.lt(capacity)), at::arange(n, src_loc.options()), -1);
  }
  reg::Bind<&copy_pages_params>::plain<Dev>(rows, cache, live, dst_loc, errors, check, op);
}

}  // namespace kvwrite
#endif  // KVW_HOST
