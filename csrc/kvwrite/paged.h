// Paged cache addressing, written once (FlashInfer paged_kv_t style): a cache is a base pointer
// and the strides of its canonical [pages, pool_page_size, heads, feat] shape; NHD and HND are
// two sets of strides, not two code paths. `elem_offset` is the only address arithmetic (int64).
#pragma once

#include "common.h"
#include "stream.h"

namespace kvwrite {

// The page of local row `row` (>= 0) in pages of `pps` rows: on the host a power-of-two page (the
// usual) by a shift, not a 64-bit division per token; the device keeps the division.
KVW_HD i64 page_of(i64 row, i64 pps) {
#if defined(__CUDA_ARCH__)
  return row / pps;
#else
  return (pps & (pps - 1)) == 0 ? row >> __builtin_ctzll(uint64_t(pps)) : row / pps;
#endif
}

struct PagedCache {
  char* base = nullptr;
  i64 stride_page = 0, stride_entry = 0, stride_head = 0;  // in elements; feat stride is 1
  i64 pool_page_size = 1;
  int elem_size = 1;
  // Split head dim (vLLM's legacy head-major layout): feat d at (d / split) * stride_split +
  // d % split. split = 0: unsplit, feat stride 1.
  int split = 0;
  i64 stride_split = 0;

  KVW_HD i64 feat_offset(i64 feat) const {
    return split == 0 ? feat : (feat / split) * stride_split + feat % split;
  }
  KVW_HD i64 elem_offset(i64 page, i64 entry, i64 head, i64 feat) const {
    return page * stride_page + entry * stride_entry + head * stride_head + feat_offset(feat);
  }
  // Byte address of local row `row` (page = row / pool_page_size, page_of).
  KVW_HD char* row_ptr(i64 row) const {
    const i64 page = page_of(row, pool_page_size);
    return base + elem_offset(page, row - page * pool_page_size, 0, 0) * elem_size;
  }
  // Byte offset of (head, feat) within a row.
  KVW_HD i64 in_row(i64 head, i64 feat) const { return elem_offset(0, 0, head, feat) * elem_size; }
  KVW_HD char* at(i64 row, i64 head, i64 feat) const { return row_ptr(row) + in_row(head, feat); }
#if !defined(__CUDA_ARCH__)
  // Host: prefetch (write) the H heads of `head_elems` elements each of local row `row` (>= 0).
  void prefetch_heads(i64 row, int H, i64 head_elems) const {
    const char* r = row_ptr(row);
    const i64 bytes = head_elems * elem_size;
    if (split == 0 && stride_head == head_elems) {
      for (i64 o = 0; o < H * bytes; o += 64) __builtin_prefetch(r + o, 1, 3);
      return;
    }
    for (int h = 0; h < H; ++h)
      for (i64 o = 0; o < bytes; o += 64) __builtin_prefetch(r + in_row(h, 0) + o, 1, 3);
  }
#endif
};

// Copy one `B`-byte unit (B = 16: one vector load/store when the caller checked alignment).
template <int B>
KVW_HD void copy_unit(char* dst, const char* src) {
#if defined(__CUDA_ARCH__)
  if constexpr (B == 16) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else if constexpr (B == 8) {
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(src);
  } else if constexpr (B == 4) {
    *reinterpret_cast<uint32_t*>(dst) = *reinterpret_cast<const uint32_t*>(src);
  } else if constexpr (B == 2) {
    *reinterpret_cast<uint16_t*>(dst) = *reinterpret_cast<const uint16_t*>(src);
  } else {
    *dst = *src;
  }
#else
  memcpy(dst, src, B);
#endif
}

// Largest unit in {16, 8, 4, 2, 1} bytes dividing every given byte offset/length.
KVW_HD int vec_bytes(uint64_t any_of) {
  return (any_of & 15) == 0 ? 16 : (any_of & 7) == 0 ? 8 : (any_of & 3) == 0 ? 4 : (any_of & 1) == 0 ? 2 : 1;
}

}  // namespace kvwrite

namespace kvwrite {

#if !defined(__CUDA_ARCH__)
// Host (CPU, nlanes == 1) row copy: `n` runs of `bytes` bytes at strides `d_stride` / `s_stride`;
// one copy when both sides are contiguous runs (the usual whole row), else one per run. STREAM (a
// store's pool rows): whole lines by streaming stores while the call streams (stream.h); a gather's
// output or a page move's copy stays plain (read soon after).
template <bool STREAM = false>
inline void copy_runs(char* dst, i64 d_stride, const char* src, i64 s_stride, int n, i64 bytes) {
  const auto copy = [](char* d, const char* s, size_t m) {
    if constexpr (STREAM) stream_copy(d, s, m);
    else memcpy(d, s, m);
  };
  if (d_stride == bytes && s_stride == bytes) return copy(dst, src, size_t(n) * size_t(bytes));
  for (int h = 0; h < n; ++h) copy(dst + h * d_stride, src + h * s_stride, size_t(bytes));
}
#endif

}  // namespace kvwrite
