// Loc resolution, written once: virtual loc -> loc_map (SWA) -> DCP shard -> bounds check.
// The twin of kernels/_common.resolve_locs and kvwrite/reference/_locs.resolve (the composition
// order is documented there): padding -1 skipped; loc_map lookup checked against its length
// (KIND_LOC_MAP; skipped in off mode), a mapped -1 skipped; DCP keeps this rank's rows at
// row // dcp_size; the local row checked against [0, capacity) (KIND_POOL).
#pragma once

#include "record.h"

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
};

KVW_HD i64 load_index(const void* p, bool is64, i64 i) {
  return is64 ? static_cast<const int64_t*>(p)[i] : static_cast<i64>(static_cast<const int32_t*>(p)[i]);
}

// Where token i writes: `write` = store it at local `row`; `bad` = out of range (never stored).
struct Resolved {
  i64 loc, row, target, limit;
  int kind;
  bool write, bad;
};

template <int CHECK>
KVW_HD Resolved resolve(const LocArgs& a, i64 i) {
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
    r.write = live && row >= 0;
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
  return Violation{token, r.loc, r.target, r.limit, a.pool_page_size, r.kind, a.op};
}

// Resolve token i and handle a bad loc the CHECK way (`lead`: the one lane that records/asserts).
template <int CHECK>
KVW_HD Resolved resolve_checked(const LocArgs& a, i64 i, bool lead) {
  Resolved r = resolve<CHECK>(a, i);
  if (CHECK != CHECK_OFF && r.bad && lead) on_bad<CHECK>(a.errors, violation(a, i, r));
  return r;
}

}  // namespace kvwrite
