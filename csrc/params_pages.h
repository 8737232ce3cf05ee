// Tensors -> page-move kernel parameters (host only, torch); shared by ops.cpp (CPU) and
// cuda_ops.cpp. kvwrite.ops.pages validated every argument already (canonical [pages, rows,
// heads, feat] pools, index tensors on the pools' device); these checks guard direct callers.
#pragma once

#include "params.h"

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

}  // namespace kvwrite
