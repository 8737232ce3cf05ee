// Loc resolution, written once: virtual loc -> loc_map (SWA) -> DCP shard -> bounds check.
// The twin of kernels/_common.resolve_locs and kvwrite/reference/_locs.resolve (the composition
// order is documented there): padding -1 skipped; loc_map lookup checked against its length
// (KIND_LOC_MAP; skipped in off mode), a mapped -1 skipped; DCP keeps this rank's rows at
// row // dcp_size; the local row checked against [0, capacity) (KIND_POOL).
// Page-table addressing (LocArgs::batch set; `loc` holds the positions) is resolve_table, the
// twin of kernels/_common.resolve_table (KIND_BATCH, KIND_TABLE_SLOT, KIND_TABLE_PAGE).
#pragma once

#include "record.h"
#include "stream.h"

// Off mode on the host (the cpu backend) also skips a row past the pool, so a bad loc never
// writes outside the cache tensor (its cost: bench/off_bound.py). Device code (the cuda backend)
// keeps the check-free path. Building with -DKVWRITE_OFF_BOUND=0 drops the host bound (the
// bench's baseline).
#ifndef KVWRITE_OFF_BOUND
#ifdef __CUDA_ARCH__
#define KVWRITE_OFF_BOUND 0
#else
#define KVWRITE_OFF_BOUND 1
#endif
#endif

namespace kvwrite {

struct LocArgs {
  const void* loc = nullptr;      // int32 or int64 [n]
  bool loc64 = true;
  const void* loc_map = nullptr;  // optional int32 or int64 [map_len]
  bool map64 = true;
  i64 map_len = 0;
  i64 dcp_rank = 0, dcp_size = 1;
  bool dcp_page = false;          // DCP shards whole pages (page p on rank p % dcp_size)
  i64 capacity = 0;               // rows of the target pool
  i64 pool_page_size = 1;
  i64 n = 0;                      // tokens
  i64* errors = nullptr;          // guard record (int64[16]) or null
  int op = 0;                     // kvwrite.errors.OPS index
  // page-table addressing (kvwrite.PageTable), when `batch` is set
  const void* batch = nullptr;    // int32/int64 [n] batch_indices
  bool batch64 = true;
  const void* table = nullptr;    // int32/int64 [n_table] kv_indices
  bool table64 = true;
  i64 n_table = 0;
  const void* indptr = nullptr;   // int32/int64 [n_batch + 1] kv_indptr
  bool indptr64 = true;
  i64 n_batch = 0;
};

KVW_HD i64 load_index(const void* p, bool is64, i64 i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<i64>(static_cast<const int32_t*>(p)[i]);
}

// Where token i writes: `write` = store it at local `row`; `bad` = out of range (never stored).
struct Resolved {
  i64 loc, row, target, limit;
  int kind;
  int write, bad;  // 0 / 1 (ints: GCC merged two bools into one 16-bit store that the byte read of `bad` then waited on)
  i64 batch = -1, position = -1, table_slot = -1, table_page = -1;  // page-table context
};

// Page-table addressing: row positions[i] % P of page kv_indices[kv_indptr[b] + positions[i] // P]
// (floor division, P = pool_page_size), b = batch_indices[i]. Checked: b in [0, n_batch); the slot in
// [kv_indptr[b], min(kv_indptr[b + 1], n_table)); the page in [0, num_pages). Off mode reads
// neither table out of bounds (such tokens are skipped) and skips a negative page.
template <int CHECK>
KVW_HD Resolved resolve_table(const LocArgs& a, i64 i) {
  Resolved r;
  const i64 P = a.pool_page_size, num_pages = a.capacity / a.pool_page_size;
  const i64 pos = load_index(a.loc, a.loc64, i), b = load_index(a.batch, a.batch64, i);
  i64 q = pos / P, e = pos - q * P;
  if (e < 0) {
    q -= 1;
    e += P;
  }
  r.batch = b;
  r.position = pos;
  r.bad = false;
  r.write = false;
  r.kind = KIND_TABLE_PAGE;
  r.loc = -1;
  r.row = -1;
  if (!(b >= 0 && b < a.n_batch)) {
    r.bad = CHECK != CHECK_OFF;
    r.kind = KIND_BATCH;
    r.target = b;
    r.limit = a.n_batch;
    return r;
  }
  const i64 start = load_index(a.indptr, a.indptr64, b), slot = start + q;
  r.table_slot = slot;
  i64 hi = a.n_table;
  bool ok = slot >= 0 && slot < hi;
  if (CHECK != CHECK_OFF) {
    const i64 end = load_index(a.indptr, a.indptr64, b + 1);
    hi = end < hi ? end : hi;
    ok = ok && slot >= start && slot < hi;
  }
  if (!ok) {
    r.bad = CHECK != CHECK_OFF;
    r.kind = KIND_TABLE_SLOT;
    r.target = slot;
    r.limit = hi;
    return r;
  }
  const i64 page = load_index(a.table, a.table64, slot);
  r.row = page * P + e;
  r.target = page;
  r.limit = num_pages;
  if (CHECK == CHECK_OFF) {
    r.write = page >= 0 && (KVWRITE_OFF_BOUND == 0 || page < num_pages);  // host: bounded, see top
  } else {
    r.bad = page < 0 || page >= num_pages;
    r.write = !r.bad;
    if (r.bad) {
      r.loc = r.row;
      r.table_page = page;
    }
  }
  return r;
}

template <int CHECK>
KVW_HOT Resolved resolve(const LocArgs& a, i64 i) {
  if (a.batch != nullptr) return resolve_table<CHECK>(a, i);
  Resolved r;
  r.loc = load_index(a.loc, a.loc64, i);
  r.kind = KIND_POOL;
  r.bad = false;
  bool live = r.loc != -1;  // -1 is padding; any other negative loc is out of range
  i64 row = r.loc;
  if (a.loc_map != nullptr) {
    const bool in_map = r.loc >= 0 && r.loc < a.map_len;
    if (CHECK != CHECK_OFF && live && !in_map) {
      r.bad = true;
      r.kind = KIND_LOC_MAP;
    }
    live = live && in_map;  // off mode too: never read loc_map out of bounds, skip the token
    row = live ? load_index(a.loc_map, a.map64, r.loc) : -1;
    live = live && row != -1;  // a mapped -1 is skipped
  }
  if (a.dcp_size > 1 && a.dcp_page) {  // page p -> rank p % dcp_size, local page p / dcp_size
    const i64 vpage = row >= 0 ? row / a.pool_page_size : -1;
    live = live && (row < 0 || vpage % a.dcp_size == a.dcp_rank);
    if (row >= 0) row = (vpage / a.dcp_size) * a.pool_page_size + row % a.pool_page_size;
  } else if (a.dcp_size > 1) {
    live = live && (row < 0 || row % a.dcp_size == a.dcp_rank);
    if (row >= 0) row /= a.dcp_size;
  }
  if (CHECK == CHECK_OFF) {
    // every negative row is skipped (vLLM's `slot < 0`); on the host also a row past the pool
    r.write = live && row >= 0 && (KVWRITE_OFF_BOUND == 0 || row < a.capacity);
  } else {
    bool oob = live && (row < 0 || row >= a.capacity);
    r.bad = r.bad || oob;
    r.write = live && !oob;
  }
  r.row = row;
  r.target = r.kind == KIND_LOC_MAP ? r.loc : row;
  r.limit = r.kind == KIND_LOC_MAP ? a.map_len : a.capacity;
  return r;
}

KVW_HD Violation violation(const LocArgs& a, i64 token, const Resolved& r) {
  Violation v{token, r.loc, r.target, r.limit, a.pool_page_size, r.kind, a.op};
  if (a.batch != nullptr) {
    v.table = true;
    v.batch = r.batch;
    v.position = r.position;
    v.table_slot = r.table_slot;
    v.table_page = r.table_page;
  }
  return v;
}

// A bad token recorded or asserted the CHECK way: out of the token loop on the host (KVW_COLD).
template <int CHECK>
KVW_COLD void report_bad(const LocArgs& a, i64 i, const Resolved& r) {
  on_bad<CHECK>(a.errors, violation(a, i, r));
}

// Resolve token i and handle a bad loc the CHECK way (`lead`: the one lane that records/asserts).
// Inlined into the token loop on the host (guard's loop ran 4-6 ns a token slower with a call).
template <int CHECK>
KVW_HOT Resolved resolve_checked(const LocArgs& a, i64 i, bool lead) {
  Resolved r = resolve<CHECK>(a, i);
  if (CHECK != CHECK_OFF && r.bad && lead) report_bad<CHECK>(a, i, r);
  return r;
}

#if !defined(__CUDA_ARCH__)
// Host: the cache lines of the rows a later token writes, asked for ahead (write intent) by the
// quantising K/V stores (store_kv, store_kv_nvfp4): they do enough work per byte that a row fill
// missed by the store itself can stall it (a random row: no hardware prefetcher guesses it); a
// plain copy keeps many fills in flight on its own. store_mla's rows went faster without it on
// Zen 5 (cpu-quant/NOTES.md). Off-mode resolution (nothing recorded); prefetches never fault.
constexpr i64 PREFETCH_AHEAD = 2;

// The local row token i writes, -1 when none (or i past the call, or rows streamed: stream.h).
inline i64 prefetch_row(const LocArgs& a, i64 i) {
  if (i >= a.n || stream_rows()) return -1;
  const Resolved r = resolve<CHECK_OFF>(a, i);
  return r.write ? r.row : -1;
}
#endif

}  // namespace kvwrite
