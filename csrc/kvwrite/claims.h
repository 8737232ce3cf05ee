// Duplicate rows: the pre-pass kvwrite/ops/claims.py runs before every store in assert and guard
// mode (never in off mode), the twin of kvwrite/reference/claims.py. It resolves each token once
// (resolve(): padding, loc_map, DCP, page table, bounds), keeps the lowest token index of every
// row and marks the later ones KIND_DUPLICATE (target = the row, limit = the first writer).
// Guard: bad and duplicate tokens go into the record (no EPOCH advance: the store that follows
// shares the call's epoch, so the record holds its lowest bad or duplicate token) and the scratch
// loc `out` the store runs on holds -1 (padding, skipped by every store) for them; a page-table
// call's `out` holds the rows (the store runs it as plain locs). Assert: a duplicate fails (the
// CPU caller throws, a GPU asserts); the store then runs on the caller's own loc. The host in
// guard mode first runs the pass without `out` or record: a call with neither a bad nor a
// duplicate token (the usual one) returns an empty result, and the store runs on its own loc
// (its guard finds nothing), no scratch loc written or allocated; else the full pass.
//
// The table: an open-addressing hash of `slots` (a power of two, 2n..4n) int64 rows (-1: free)
// and uint32 first tokens (UINT32_MAX: none); on the host one pass in token order (the first
// insert of a row is its lowest token), on a GPU an insert kernel (atomicCAS the row, atomicMin the
// token) then a check kernel. Extra memory per call: slots * 12 bytes + the n * 8-byte `out`, at
// most 56 bytes a token; nothing sized by the pool.
#pragma once

#include <cstdint>

#include "locs.h"

namespace kvwrite {

constexpr i64 FREE_ROW = -1;

struct ClaimParams {
  LocArgs a;                 // the store's addressing; a.errors: the record (guard), else null
  i64* keys = nullptr;       // [slots] rows
  uint32_t* first = nullptr; // [slots] lowest token of the row (GPU)
  i64 mask = 0;              // slots - 1
  i64* out = nullptr;        // [n] the loc the store runs on (guard)
};

// Smallest power of two >= 2n (and >= 2): the table's slots.
inline i64 claim_slots(i64 n) {
  i64 s = 2;
  while (s < 2 * n) s <<= 1;
  return s;
}

KVW_HD i64 claim_hash(i64 row, i64 mask) {
  uint64_t x = uint64_t(row) * 0x9E3779B97F4A7C15ull;
  return i64((x ^ (x >> 31)) & uint64_t(mask));
}

// The record of duplicate token i (resolved as `r`) whose row token `first` writes.
KVW_HD Violation duplicate_violation(const LocArgs& a, i64 i, const Resolved& r, i64 first) {
  Violation v = violation(a, i, r);
  v.loc = a.batch != nullptr ? r.row : r.loc;
  v.target = r.row;
  v.limit = first;
  v.kind = KIND_DUPLICATE;
  return v;
}

// What the store runs on for a token it writes: the caller's loc, or the row of a page table.
KVW_HD i64 kept_loc(const LocArgs& a, const Resolved& r) { return a.batch != nullptr ? r.row : r.loc; }

// claim_rows_host's probe (nothing recorded, no scratch loc) of plain locs (no page table, loc_map
// or DCP): a row is its loc, so the loop is a bounds test and a probe a token (the usual guard /
// assert call runs only this pass before its store: about half the general loop's time).
template <class T>
inline i64 claim_probe_plain(const ClaimParams& p, const T* loc, i64* bad) {
  i64 dups = 0, nbad = 0;
  const uint64_t cap = uint64_t(p.a.capacity);
  for (i64 i = 0; i < p.a.n; ++i) {
    const i64 row = loc[i];
    if (row == -1) continue;  // padding
    if (uint64_t(row) >= cap) {
      ++nbad;
      continue;
    }
    i64 h = claim_hash(row, p.mask);
    while (p.keys[h] != FREE_ROW && p.keys[h] != row) h = (h + 1) & p.mask;
    if (p.keys[h] == row) ++dups;
    p.keys[h] = row;
  }
  if (bad != nullptr) *bad = nbad;
  return dups;
}

// Host, one pass in token order: CHECK's resolution, the lowest token of each row kept.
// `rec`: where bad / duplicate tokens are recorded (null: not recorded). Returns the duplicates
// (and counts the bad tokens into `*bad` when given).
template <int CHECK>
inline i64 claim_rows_host(const ClaimParams& p, i64* rec, i64* first, i64* bad = nullptr) {
  const LocArgs& a = p.a;
  if (rec == nullptr && p.out == nullptr && a.batch == nullptr && a.loc_map == nullptr && a.dcp_size == 1)
    return a.loc64 ? claim_probe_plain(p, static_cast<const int64_t*>(a.loc), bad)
                   : claim_probe_plain(p, static_cast<const int32_t*>(a.loc), bad);
  i64 dups = 0, nbad = 0;
  for (i64 i = 0; i < a.n; ++i) {
    const Resolved r = resolve<CHECK>(a, i);
    i64 keep = -1;
    if (r.bad) {
      ++nbad;
      if (rec != nullptr) record(rec, violation(a, i, r));
    } else if (r.write) {
      i64 h = claim_hash(r.row, p.mask);
      while (p.keys[h] != FREE_ROW && p.keys[h] != r.row) h = (h + 1) & p.mask;
      if (p.keys[h] == FREE_ROW) {
        p.keys[h] = r.row;
        first[h] = i;
        keep = kept_loc(a, r);
      } else {
        ++dups;
        if (rec != nullptr) record(rec, duplicate_violation(a, i, r, first[h]));
      }
    }
    if (p.out != nullptr) p.out[i] = keep;
  }
  if (bad != nullptr) *bad = nbad;
  return dups;
}

#if defined(__CUDACC__)
// GPU, pass 1: every writing token claims its row's slot and folds its index into the slot's min.
template <int CHECK>
__device__ inline void claim_insert(const ClaimParams& p, i64 i) {
  const Resolved r = resolve<CHECK>(p.a, i);
  if (r.bad || !r.write) return;
  i64 h = claim_hash(r.row, p.mask);
  while (true) {
    const i64 found = atomic_cas_i64(p.keys + h, FREE_ROW, r.row);
    if (found == FREE_ROW || found == r.row) break;
    h = (h + 1) & p.mask;
  }
  atomicMin(reinterpret_cast<unsigned int*>(p.first + h), static_cast<unsigned int>(i));
}

// GPU, pass 2: bad tokens and every token that is not its row's first writer are handled the
// CHECK way (record / device assert) and skipped in `out`.
template <int CHECK>
__device__ inline void claim_check(const ClaimParams& p, i64 i) {
  const Resolved r = resolve<CHECK>(p.a, i);
  i64 keep = -1;
  if (r.bad) {
    on_bad<CHECK>(p.a.errors, violation(p.a, i, r));
  } else if (r.write) {
    i64 h = claim_hash(r.row, p.mask);
    while (p.keys[h] != r.row) h = (h + 1) & p.mask;
    const i64 first = i64(p.first[h]);
    if (first == i) {
      keep = kept_loc(p.a, r);
    } else {
      on_bad<CHECK>(p.a.errors, duplicate_violation(p.a, i, r, first));
    }
  }
  if (p.out != nullptr) p.out[i] = keep;
}
#endif

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): claim_rows' addressing and
// binding (the pre-pass on either device: Dev::run(ClaimParams)) and its row of the op table
// (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_CLAIMS(X) \
  X(claim_rows, reg::claim_rows, \
    "(Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op, " \
    "Tensor? batch_indices, Tensor? kv_indices, Tensor? kv_indptr, int capacity, int pool_page_size, " \
    "bool dcp_page) -> Tensor")

namespace kvwrite {

// claim_rows' addressing on either device.
inline LocArgs claim_locs(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                          int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                          const OptTensor& kv_indices, const OptTensor& kv_indptr, int64_t capacity,
                          int64_t pool_page_size, bool dcp_page) {
  TORCH_CHECK(check == CHECK_ASSERT || check == CHECK_GUARD, "kvwrite: claim_rows runs in assert or guard mode");
  TORCH_CHECK(capacity >= 1 && pool_page_size >= 1, "kvwrite: claim_rows needs a pool");
  LocArgs a = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, capacity, pool_page_size, loc);
  set_table(a, batch_indices, kv_indices, kv_indptr, loc);
  a.dcp_page = dcp_page;
  return a;
}

namespace reg {

// The duplicate-row pre-pass of a store in assert / guard mode: the loc the store runs on (guard),
// or an empty tensor (the store runs on its own loc); see Dev::run.
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

}  // namespace kvwrite
#endif  // KVW_HOST
