// The kvwrite_ext op library: schemas (TORCH_LIBRARY) and the CPU kernels (TORCH_LIBRARY_IMPL,
// CPU key). The CPU kernels run the same header functions as the CUDA kernels, one token per
// iteration of at::parallel_for; kvwrite's backend="cpu".
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "api.h"
#include "engines.h"
#include "params.h"
#include "params_dsv4.h"
#include "params_int4.h"
#include "params_pages.h"
#include "params_rope.h"

namespace kvwrite {
namespace {

constexpr int64_t GRAIN = 64;  // tokens per parallel_for chunk

// kvwrite.facts.OPS (op code -> name), handed over when the extension loads (set_op_names).
std::vector<std::string>& op_names() {
  static std::vector<std::string> names;
  return names;
}
std::string op_name(int op) {
  const auto& names = op_names();
  return op >= 0 && size_t(op) < names.size() ? names[op] : "op " + std::to_string(op);
}

i64 unpack(const i64* rec, int lo) {
  return i64((uint64_t(rec[lo + 1]) & 0xFFFFFFFFull) << 32 | (uint64_t(rec[lo]) & 0xFFFFFFFFull));
}

// Assert mode on the CPU: before any write, scan every token; record the bad ones (into
// `errors` when the caller passed one, so kvwrite raises its OutOfBoundsWrite from it) and throw.
// `resolve_i(i)`: token i's Resolved (rope ops fold their position check in).
template <class Resolve>
void assert_prescan_with(const LocArgs& a, Resolve&& resolve_i) {
  i64 local[slot::NUM_SLOTS];
  for (int s = 0; s < slot::NUM_SLOTS; ++s) local[s] = s == slot::COUNT ? 0 : EMPTY;
  i64* rec = a.errors != nullptr ? a.errors : local;
  const i64 before = rec[slot::COUNT];
  const i64 epoch = rec[slot::EPOCH];
  at::parallel_for(0, a.n, GRAIN, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const Resolved r = resolve_i(i);
      if (r.bad) record(rec, violation(a, i, r));
    }
  });
  rec[slot::EPOCH] = epoch + 1;
  if (rec[slot::COUNT] == before) return;
  const i64 token = rec[slot::META] >> 32, loc = unpack(rec, slot::LOC_LO);
  const i64 target = unpack(rec, slot::TARGET_LO), limit = unpack(rec, slot::LIMIT_LO);
  const int kind = int((rec[slot::META] & 0xFFFFFFFF) >> 8);
  std::ostringstream msg;
  msg << "kvwrite: store loc outside the pool (check=assert): " << op_name(a.op) << ": token " << token
      << " loc " << loc;
  if (kind == KIND_BATCH || kind == KIND_TABLE_SLOT || kind == KIND_TABLE_PAGE) {
    msg << " page table: kind " << kind << " index " << target << " outside its bound " << limit;
  } else if (kind == KIND_LOC_MAP) {
    msg << " is outside loc_map (length " << limit << ")";
  } else if (kind == KIND_POSITION) {
    msg << " has position " << target << ", outside the cos/sin cache [0, " << limit << ")";
  } else {
    msg << " (local " << target << ") page " << (target >= 0 ? target / a.pool_page_size : -1) << ", pool has "
        << limit / a.pool_page_size << " pages of " << a.pool_page_size << " rows (capacity " << limit << ")";
  }
  msg << "; " << rec[slot::COUNT] - before << " bad token(s)";
  TORCH_CHECK(false, msg.str());
}

void assert_prescan(const LocArgs& a) {
  assert_prescan_with(a, [&](i64 i) { return resolve<CHECK_ASSERT>(a, i); });
}

// Threads pay only above a size: a parallel region costs a few microseconds to start and join,
// so a call runs on one thread unless it moves at least PARALLEL_BYTES (weighted: a quantised
// byte counts QUANT_WEIGHT times, it costs that much more compute). 256 KiB is a chosen default,
// not a measured crossover: on the shared 2-core dev VM the 2-thread runs are dominated by
// OpenMP scheduling stalls (even torch's contiguous copy), so no threshold could be measured.
// KVWRITE_CPU_PARALLEL_BYTES overrides the threshold (read once).
constexpr int64_t QUANT_WEIGHT = 8;
int64_t parallel_bytes() {
  static const int64_t v = [] {
    const char* e = std::getenv("KVWRITE_CPU_PARALLEL_BYTES");
    return e != nullptr && *e ? std::max<int64_t>(1, std::atoll(e)) : int64_t(256) << 10;
  }();
  return v;
}

// Tokens per parallel_for chunk for a per-token cost of `token_bytes`: parallel_for runs the
// whole range inline when it is not larger than one grain.
int64_t grain_for(int64_t token_bytes) {
  const int64_t cost = std::max<int64_t>(1, token_bytes);
  return std::max<int64_t>(GRAIN, (parallel_bytes() + cost - 1) / cost);
}

// Weighted bytes one token moves (read + write).
int64_t token_bytes(const StoreKVParams& p) {
  const int64_t es = dtype_size(p.in_dtype), quant = p.cache_dtype != p.in_dtype;
  return int64_t(p.H) * (p.k.D + p.v.D) * (quant ? (es + 1) * QUANT_WEIGHT : 2 * es);
}
int64_t token_bytes(const StoreMLAParams& p) {
  const int64_t es = dtype_size(p.in_dtype);
  return int64_t(p.L + p.R) * (p.mode == MLA_COPY ? 2 * es : (es + 1) * QUANT_WEIGHT);
}
int64_t token_bytes(const StoreIndexerKParams& p) {
  return int64_t(p.cache.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
int64_t token_bytes(const StoreKVNVFP4Params& p) {
  return int64_t(p.H) * (p.k.D + p.v.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
int64_t token_bytes(const StoreDSV4KVParams& p) {  // DeepSeek V4
  return int64_t(DSV4_NOPE + DSV4_ROPE) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
int64_t token_bytes(const StoreMXFP4Params& p) { return int64_t(p.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT; }
int64_t token_bytes(const StoreDSV4FP4Params& p) {
  return int64_t(DSV4_NOPE + DSV4_ROPE) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
int64_t token_bytes(const StoreRowsParams& p) { return 2 * p.row_bytes; }
int64_t token_bytes(const GatherParams& p) { return 2 * p.heads * p.head_bytes; }  // page moves
int64_t token_bytes(const StoreKVInt4Params& p) {  // store_kv's int4 format
  return int64_t(p.H) * (p.k.D + p.v.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
int64_t token_bytes(const StoreKVQuantParams& p) {  // store_kv_quant
  return int64_t(p.H) * (p.k.D + p.v.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}

// Run `token(i)` for every token (in parallel above the threshold), after the assert pre-scan.
template <class Body>
void for_tokens(const LocArgs& a, int64_t check, int64_t grain, Body&& token) {
  if (check == CHECK_ASSERT) assert_prescan(a);
  at::parallel_for(0, a.n, grain, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) token(i);
  });
  if (check == CHECK_GUARD && a.errors != nullptr) a.errors[slot::EPOCH] += 1;  // the next call's epoch
}

// Run the per-token functor `Token` over every token of `p`.
template <class Token, class P>
void run_tokens(const P& p, int64_t check) {
  for_tokens(p.locs, check, grain_for(token_bytes(p)), [&](i64 i) { Token{}(p, i, 0, 1); });
}

// The bench's floor: a plain per-row memcpy scatter, dst_j[loc[i]] = src_j[i] for each pair
// (rows contiguous, int64 loc in range: no checks beyond shapes), same threading policy.
void bench_memcpy_scatter(at::TensorList src, at::TensorList dst, const Tensor& loc) {
  TORCH_CHECK(src.size() == dst.size() && loc.scalar_type() == at::kLong && loc.dim() == 1 && loc.is_contiguous(),
              "bench_memcpy_scatter: src/dst lists of equal length and a contiguous int64 loc");
  const int64_t n = loc.size(0);
  struct Pair {
    const char* s;
    char* d;
    int64_t row, d_stride, rows;
  };
  std::vector<Pair> pairs;
  int64_t bytes = 0;
  for (size_t j = 0; j < src.size(); ++j) {
    const Tensor &s = src[j], &d = dst[j];
    TORCH_CHECK(s.dim() >= 1 && s.size(0) == n && s.is_contiguous() && d.dim() >= 1,
                "bench_memcpy_scatter: src[", j, "] must be a contiguous [n, ...] tensor");
    const int64_t row = n > 0 ? s.numel() / n * s.element_size() : 0;
    TORCH_CHECK(d.stride(-1) == 1 && d.numel() / std::max<int64_t>(1, d.size(0)) * d.element_size() == row &&
                    (d.dim() == 1 || d[0].is_contiguous()),
                "bench_memcpy_scatter: dst[", j, "] rows must be contiguous and as wide as src rows");
    pairs.push_back({static_cast<const char*>(s.data_ptr()), static_cast<char*>(d.data_ptr()), row,
                     d.stride(0) * d.element_size(), d.size(0)});
    bytes += 2 * row;
  }
  const int64_t* l = loc.data_ptr<int64_t>();
  at::parallel_for(0, n, grain_for(bytes), [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i)
      for (const Pair& q : pairs) memcpy(q.d + l[i] * q.d_stride, q.s + i * q.row, size_t(q.row));
  });
}

#define KVW_RUN_CPU(op, p, check) \
  op(p, int(check), [&](auto token, i64) { run_tokens<typename decltype(token)::type>(p, check); })

void store_kv_cpu(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                  const OptTensor& k_scale, const OptTensor& v_scale, const Tensor& loc,
                  const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                  int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  StoreKVParams p = store_kv_params(k, v, k_cache, v_cache, k_scale, v_scale, loc, loc_map, errors,
                                          dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  KVW_RUN_CPU(dispatch_store_kv, p, check);
}

void store_mla_cpu(const Tensor& kv_c, const Tensor& k_pe, const Tensor& kv_cache, const OptTensor& scale,
                   const OptTensor& scale_cache, const OptTensor& global_scale,
                   int64_t mode, const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors,
                   int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  StoreMLAParams p = store_mla_params(kv_c, k_pe, kv_cache, scale, scale_cache, global_scale, mode, loc, loc_map, errors, dcp_rank,
                                            dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, kv_c);
  KVW_RUN_CPU(dispatch_store_mla, p, check);
}

void store_indexer_k_cpu(const Tensor& k, const Tensor& cache, int64_t qbs, bool ue8m0, const Tensor& loc,
                         const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                         int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  StoreIndexerKParams p = store_indexer_k_params(k, cache, qbs, ue8m0, loc, loc_map, errors, dcp_rank,
                                                       dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  KVW_RUN_CPU(dispatch_store_indexer_k, p, check);
}

void store_kv_nvfp4_cpu(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                        const Tensor& k_scale_cache, const Tensor& v_scale_cache, const OptTensor& k_global,
                        const OptTensor& v_global, const Tensor& loc, const OptTensor& loc_map,
                        const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
    const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  StoreKVNVFP4Params p = store_kv_nvfp4_params(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, k_global,
                                                     v_global, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  KVW_RUN_CPU(dispatch_store_kv_nvfp4, p, check);
}

// DeepSeek V4 (kvwrite/store_dsv4.h). fmt 0: fp8 rows (store_indexer_k's body), 1: mxfp4.
void store_dsv4_kv_cpu(const Tensor& kv, const Tensor& cache, int64_t pool_page_size, const Tensor& loc,
                       const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                       int64_t check, int64_t op, const OptTensor& batch_indices,
    const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  StoreDSV4KVParams p =
      store_dsv4_kv_params(kv, cache, pool_page_size, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
  KVW_RUN_CPU(dispatch_store_dsv4_kv, p, check);
}

void store_dsv4_indexer_k_cpu(const Tensor& k, const Tensor& cache, int64_t pool_page_size, int64_t fmt, bool ue8m0,
                              const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                              int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
    const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  if (fmt == 0) {
    StoreIndexerKParams p =
        store_indexer_k_params(k, cache, 128, ue8m0, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
    kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
    p.locs.dcp_page = true;
    KVW_RUN_CPU(dispatch_store_indexer_k, p, check);
    return;
  }
  StoreMXFP4Params p =
      store_mxfp4_params(k, cache, pool_page_size, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
  KVW_RUN_CPU(dispatch_store_mxfp4, p, check);
}

void store_dsv4_kv_fp4_cpu(const Tensor& kv, const Tensor& cache, int64_t pool_page_size, int64_t fmt,
                           const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                           int64_t dcp_size, int64_t check, int64_t op) {
  StoreDSV4FP4Params p =
      store_dsv4_fp4_params(kv, cache, pool_page_size, fmt, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  dispatch_store_dsv4_fp4<false>(p, int(check), [&](auto token, i64) { run_tokens<typename decltype(token)::type>(p, check); });
}

void store_rows_cpu(const Tensor& src, const Tensor& pool, const Tensor& loc, const OptTensor& loc_map,
                    const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
    const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  StoreRowsParams p = store_rows_params(src, pool, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  kvw_dsv4_table(p.locs, batch_indices, kv_indices, kv_indptr);
  KVW_RUN_CPU(dispatch_store_rows, p, check);
}

// The duplicate-row pre-pass (kvwrite/claims.h) of a store in assert / guard mode. Guard: the
// record takes the bad and duplicate tokens, the result is the loc the store runs on. Assert:
// an empty result (the store runs on its own loc), or, when two tokens share a row, the call's
// bad and duplicate tokens recorded into `errors` (kvwrite raises from it) and a throw.
Tensor claim_rows_cpu(const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                      int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                      const OptTensor& kv_indices, const OptTensor& kv_indptr, int64_t capacity,
                      int64_t pool_page_size, bool dcp_page) {
  ClaimParams p;
  p.a = claim_locs(loc, loc_map, errors, dcp_rank, dcp_size, check, op, batch_indices, kv_indices, kv_indptr, capacity,
                   pool_page_size, dcp_page);
  const i64 slots = claim_slots(p.a.n);
  thread_local std::vector<i64> keys, first;  // reused: no allocation per call once warm
  keys.assign(size_t(slots), FREE_ROW);
  first.resize(size_t(slots));
  p.keys = keys.data();
  p.mask = slots - 1;
  if (check == CHECK_GUARD) {
    i64 bad = 0;  // the usual call, no bad and no duplicate token: the store runs on its own loc
    if (claim_rows_host<CHECK_GUARD>(p, nullptr, first.data(), &bad) == 0 && bad == 0)
      return at::empty({0}, loc.options().dtype(at::kLong));
    keys.assign(size_t(slots), FREE_ROW);
    Tensor out = at::empty({p.a.n}, loc.options().dtype(at::kLong));
    p.out = out.data_ptr<int64_t>();
    claim_rows_host<CHECK_GUARD>(p, p.a.errors, first.data());
    return out;
  }
  if (claim_rows_host<CHECK_ASSERT>(p, nullptr, first.data()) == 0) return at::empty({0}, loc.options().dtype(at::kLong));
  i64 local[slot::NUM_SLOTS];
  for (int s = 0; s < slot::NUM_SLOTS; ++s) local[s] = s == slot::COUNT ? 0 : EMPTY;
  i64* rec = p.a.errors != nullptr ? p.a.errors : local;
  const i64 before = rec[slot::COUNT];
  keys.assign(size_t(slots), FREE_ROW);
  claim_rows_host<CHECK_ASSERT>(p, rec, first.data());
  std::ostringstream msg;
  msg << "kvwrite: two tokens of one call write the same row (check=assert): " << op_name(int(op)) << ": token "
      << (rec[slot::META] >> 32) << " row " << unpack(rec, slot::TARGET_LO) << "; " << rec[slot::COUNT] - before
      << " bad or duplicate token(s)";
  TORCH_CHECK(false, msg.str());
}

// Page moves (kvwrite/pages.h). Assert mode: every bad id or loc is recorded (into the scratch
// buffer kvwrite._ext passes) and the call throws before anything is written.

[[noreturn]] void throw_assert(const char* op, const i64* rec, i64 count) {
  std::ostringstream msg;
  msg << "kvwrite: store loc outside the pool (check=assert): " << op << ": item " << (rec[slot::META] >> 32)
      << " index " << unpack(rec, slot::TARGET_LO) << " outside [0, " << unpack(rec, slot::LIMIT_LO) << "); " << count
      << " bad item(s)";
  TORCH_CHECK(false, msg.str());
}

void copy_pages_cpu(const Tensor& src, const Tensor& dst, const Tensor& src_pages, const Tensor& dst_pages,
                    const OptTensor& errors, int64_t check, int64_t op) {
  const CopyPagesParams p = copy_pages_params(src, dst, src_pages, dst_pages, errors, check, op);
  if (check == CHECK_ASSERT) {
    i64 local[slot::NUM_SLOTS];
    for (int s = 0; s < slot::NUM_SLOTS; ++s) local[s] = s == slot::COUNT ? 0 : EMPTY;
    i64* rec = p.errors != nullptr ? p.errors : local;
    const i64 before = rec[slot::COUNT];
    const i64 epoch = rec[slot::EPOCH];
    for (i64 i = 0; i < p.n; ++i) {
      const PairResolved r = resolve_pair<CHECK_ASSERT>(p, i);
      if (r.bad) record(rec, pair_violation(p, i, r));
    }
    rec[slot::EPOCH] = epoch + 1;
    if (rec[slot::COUNT] != before) throw_assert(op_name(p.op).c_str(), rec, rec[slot::COUNT] - before);
  }
  with_check(int(check), [&](auto c) {
    at::parallel_for(0, p.n, grain_for(2 * p.unit_bytes()), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const PairResolved r = resolve_pair_checked<c.value>(p, i, true);
        if (r.write) copy_unit_host(p, p.src.unit_ptr(r.s, p.unit_rows), p.dst.unit_ptr(r.d, p.unit_rows));
      }
    });
  });
  if (check == CHECK_GUARD && p.errors != nullptr) p.errors[slot::EPOCH] += 1;  // the next call's epoch
}

void gather_cpu(const Tensor& cache, const Tensor& out, const Tensor& loc, const OptTensor& loc_map,
                const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size, int64_t check, int64_t op,
                const OptTensor& batch_indices, const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  GatherParams p = gather_params(cache, out, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, cache);
  KVW_RUN_CPU(dispatch_gather, p, check);
}

void slot_mapping_cpu(const Tensor& block_table, const Tensor& batch_indices, const Tensor& positions,
                      const Tensor& out, int64_t page_size, int64_t num_pages, const OptTensor& errors,
                      int64_t check, int64_t op) {
  SlotMappingParams p =
      slot_mapping_params(block_table, batch_indices, positions, out, page_size, num_pages, errors, check, op);
  i64 local[slot::NUM_SLOTS];
  i64 before = 0;
  const bool asserting = check == CHECK_ASSERT;
  if (asserting) {  // run as guard into a record, then throw (out is a fresh tensor)
    for (int s = 0; s < slot::NUM_SLOTS; ++s) local[s] = s == slot::COUNT ? 0 : EMPTY;
    if (p.errors == nullptr) p.errors = local;
    before = p.errors[slot::COUNT];
    check = CHECK_GUARD;
  }
  with_check(int(check), [&](auto c) {
    at::parallel_for(0, p.n, grain_for(64), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) slot_token<c.value>(p, i);
    });
  });
  if (check == CHECK_GUARD && p.errors != nullptr) p.errors[slot::EPOCH] += 1;  // the next call's epoch
  if (asserting && p.errors[slot::COUNT] != before) throw_assert(op_name(p.op).c_str(), p.errors, p.errors[slot::COUNT] - before);
}

// store_kv with static int8 or dynamic per-token / per-token-head scales (kvwrite/store_kv_quant.h).
void store_kv_quant_cpu(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                        const OptTensor& k_scale, const OptTensor& v_scale, const OptTensor& k_scale_cache,
                        const OptTensor& v_scale_cache, int64_t quant, int64_t rule, const Tensor& loc,
                        const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                        int64_t check, int64_t op, const OptTensor& batch_indices, const OptTensor& kv_indices,
                        const OptTensor& kv_indptr) {
  StoreKVQuantParams p = store_kv_quant_params(k, v, k_cache, v_cache, k_scale, v_scale, k_scale_cache, v_scale_cache,
                                               quant, rule, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  KVW_RUN_CPU(dispatch_store_kv_quant, p, check);
}

// store_kv's int4 format (kvwrite/kv_int4.h, vLLM's INT4_PER_TOKEN_HEAD).
void store_kv_int4_cpu(const Tensor& k, const Tensor& v, const Tensor& k_cache, const Tensor& v_cache,
                       const Tensor& k_scale_cache, const Tensor& v_scale_cache, const Tensor& loc,
                       const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                       int64_t check, int64_t op, const OptTensor& batch_indices, const OptTensor& kv_indices,
                       const OptTensor& kv_indptr) {
  StoreKVInt4Params p = store_kv_int4_params(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, loc_map,
                                             errors, dcp_rank, dcp_size, check, op);
  set_table(p.locs, batch_indices, kv_indices, kv_indptr, k);
  KVW_RUN_CPU(dispatch_store_kv_int4, p, check);
}

// Fused RoPE + store (kvwrite/rope_store.h): each parallel chunk rotates its tokens' k (k_pe)
// into one reused, cache-hot scratch row, then stores that row.
// One counter for every rope op and instantiation: the id keys rope_head_host's per-thread cos/sin
// row, so two calls (of any op) must never share one (a per-template counter did: stale rows).
inline uint64_t next_rope_call() {
  static std::atomic<uint64_t> calls{0};
  return ++calls;
}

template <class Token, class P>
void run_rope_tokens(P p, const LocArgs& a, int64_t check, int64_t row_bytes, int64_t token_bytes) {
  p.rope.call = next_rope_call();  // keys the per-thread cos/sin row of rope_head_host to this call
  if (check == CHECK_ASSERT)
    assert_prescan_with(a, [&](i64 i) {
      bool ok = false;
      const i64 pos = rope_position(p.rope, i, ok);
      return resolve_rope<CHECK_ASSERT>(a, p.rope, i, ok, pos);
    });
  at::parallel_for(0, a.n, grain_for(token_bytes), [&](int64_t b, int64_t e) {
    std::vector<uint64_t> row(size_t(row_bytes + 7) / 8);
    P q = p;
    q.scratch = reinterpret_cast<char*>(row.data());
    q.scratch_sn = 0;
    for (int64_t i = b; i < e; ++i) Token{}(q, i, true, 0, 1);
  });
  if (check == CHECK_GUARD && a.errors != nullptr) a.errors[slot::EPOCH] += 1;  // the next call's epoch
}

// rope_store_dsv4_kv_fp4 (kvwrite/store_dsv4_fp4.h, ROPED): no scratch row, the rotated RoPE part
// lives in the token body; assert mode pre-scans with the position check folded in.
void rope_store_dsv4_kv_fp4_cpu(const Tensor& positions, const Tensor& kv, const Tensor& cos_sin, const OptTensor& q,
                                const Tensor& cache, int64_t pool_page_size, int64_t fmt, const Tensor& loc,
                                const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                int64_t check, int64_t op) {
  StoreDSV4FP4Params p = rope_store_dsv4_fp4_params(positions, kv, cos_sin, q, cache, pool_page_size, fmt, loc,
                                                    loc_map, errors, dcp_rank, dcp_size, check, op);
  p.rope.call = next_rope_call();
  const LocArgs& a = p.locs;
  if (check == CHECK_ASSERT)
    assert_prescan_with(a, [&](i64 i) {
      bool ok = false;
      const i64 pos = rope_position(p.rope, i, ok);
      return resolve_rope<CHECK_ASSERT>(a, p.rope, i, ok, pos);
    });
  const int64_t bytes = token_bytes(p) + int64_t(p.rope.Hq) * DSV4_ROPE * dtype_size(p.in_dtype) * QUANT_WEIGHT;
  dispatch_store_dsv4_fp4<true>(p, int(check), [&](auto token, i64) {
    using Token = typename decltype(token)::type;
    at::parallel_for(0, a.n, grain_for(bytes), [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) Token{}(p, i, 0, 1);
    });
  });
  if (check == CHECK_GUARD && a.errors != nullptr) a.errors[slot::EPOCH] += 1;  // the next call's epoch
}

void rope_store_kv_cpu(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                       const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache, const OptTensor& k_scale,
                       const OptTensor& v_scale, const OptTensor& q_w, const OptTensor& k_w, double eps, bool is_neox,
                       const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                       int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                       const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  RopeStoreKVParams p = rope_store_kv_params(positions, q, k, v, cos_sin, k_cache, v_cache, k_scale, v_scale, q_w,
                                             k_w, eps, is_neox, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.kv.locs, batch_indices, kv_indices, kv_indptr, k);
  p.scratch = reinterpret_cast<char*>(uintptr_t(64));  // the copy unit of an aligned row (never read)
  const int64_t es = dtype_size(p.kv.in_dtype), row = int64_t(p.kv.H) * p.kv.k.D * es;
  const int64_t bytes = token_bytes(p.kv) + int64_t(p.rope.Hq + p.kv.H) * p.kv.k.D * es * QUANT_WEIGHT;
  dispatch_rope_store_kv(p, int(check), [&](auto token, i64) {
    run_rope_tokens<typename decltype(token)::type>(p, p.kv.locs, check, row, bytes);
  });
}

void rope_store_kv_quant_cpu(const Tensor& positions, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& cos_sin, const Tensor& k_cache, const Tensor& v_cache,
                             const OptTensor& k_scale, const OptTensor& v_scale, const OptTensor& k_scale_cache,
                             const OptTensor& v_scale_cache, int64_t quant, int64_t rule, const OptTensor& q_w,
                             const OptTensor& k_w, double eps, bool is_neox, const Tensor& loc,
                             const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                             int64_t check, int64_t op, const OptTensor& batch_indices, const OptTensor& kv_indices,
                             const OptTensor& kv_indptr) {
  RopeStoreKVQuantParams p = rope_store_kv_quant_params(positions, q, k, v, cos_sin, k_cache, v_cache, k_scale, v_scale,
                                                        k_scale_cache, v_scale_cache, quant, rule, q_w, k_w, eps,
                                                        is_neox, loc, loc_map, errors, dcp_rank, dcp_size, check, op);
  set_table(p.kv.locs, batch_indices, kv_indices, kv_indptr, k);
  const int64_t es = dtype_size(p.kv.in_dtype), row = int64_t(p.kv.H) * p.kv.k.D * es;
  const int64_t bytes = token_bytes(p.kv) + int64_t(p.rope.Hq + p.kv.H) * p.kv.k.D * es * QUANT_WEIGHT;
  dispatch_rope_store_kv_quant(p, int(check), [&](auto token, i64) {
    run_rope_tokens<typename decltype(token)::type>(p, p.kv.locs, check, row, bytes);
  });
}

void rope_store_mla_cpu(const Tensor& positions, const Tensor& q_pe, const Tensor& kv_c, const Tensor& k_pe,
                        const Tensor& cos_sin, const Tensor& kv_cache, const OptTensor& scale,
                        const OptTensor& scale_cache, const OptTensor& global_scale, int64_t mode, bool is_neox,
                        const Tensor& loc, const OptTensor& loc_map, const OptTensor& errors, int64_t dcp_rank,
                        int64_t dcp_size, int64_t check, int64_t op, const OptTensor& batch_indices,
                        const OptTensor& kv_indices, const OptTensor& kv_indptr) {
  RopeStoreMLAParams p = rope_store_mla_params(positions, q_pe, kv_c, k_pe, cos_sin, kv_cache, scale, scale_cache,
                                               global_scale, mode, is_neox, loc, loc_map, errors, dcp_rank,
                                               dcp_size, check, op);
  set_table(p.mla.locs, batch_indices, kv_indices, kv_indptr, kv_c);
  p.scratch = reinterpret_cast<char*>(uintptr_t(64));
  const int64_t es = dtype_size(p.mla.in_dtype);
  const int64_t bytes = token_bytes(p.mla) + int64_t(p.rope.Hq + 1) * p.mla.R * es * QUANT_WEIGHT;
  dispatch_rope_store_mla(p, int(check), [&](auto token, i64) {
    run_rope_tokens<typename decltype(token)::type>(p, p.mla.locs, check, int64_t(p.mla.R) * es, bytes);
  });
}

}  // namespace
}  // namespace kvwrite

TORCH_LIBRARY_FRAGMENT(kvwrite_ext, m) {
  m.def("copy_pages(Tensor src, Tensor(a!) dst, Tensor src_pages, Tensor dst_pages, Tensor(z!)? errors, int check, "
        "int op) -> ()");
  m.def("gather(Tensor cache, Tensor(a!) out, Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, "
        "int dcp_size, int check, int op, Tensor? batch_indices=None, Tensor? kv_indices=None, "
        "Tensor? kv_indptr=None) -> ()");
  m.def("slot_mapping(Tensor block_table, Tensor batch_indices, Tensor positions, Tensor(a!) out, int page_size, "
        "int num_pages, Tensor(z!)? errors, int check, int op) -> ()");
}

TORCH_LIBRARY_IMPL(kvwrite_ext, CPU, m) {
  m.impl("copy_pages", &kvwrite::copy_pages_cpu);
  m.impl("gather", &kvwrite::gather_cpu);
  m.impl("slot_mapping", &kvwrite::slot_mapping_cpu);
}

// Every op ends with the same tail: loc, loc_map, errors, dcp_rank, dcp_size, check, op.
// Page-table addressing (kvwrite.PageTable: loc = positions) adds the three optional tables.
#define KVW_TAIL "Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op, " \
                 "Tensor? batch_indices=None, Tensor? kv_indices=None, Tensor? kv_indptr=None"
// The DeepSeek V4 stores and store_rows take the same tail; their kernels have no page table, so
// their impls reject one (kvw_dsv4_table, params_dsv4.h).
#define KVW_TAIL_NO_TABLE "Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op"

TORCH_LIBRARY(kvwrite_ext, m) {
  m.def("store_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_scale, "
        "Tensor? v_scale, " KVW_TAIL ") -> ()");
  m.def("store_mla(Tensor kv_c, Tensor k_pe, Tensor(a!) kv_cache, Tensor? scale, Tensor(b!)? scale_cache, "
        "Tensor? global_scale, int mode, " KVW_TAIL ") -> ()");
  m.def("store_indexer_k(Tensor k, Tensor(a!) cache, int quant_block_size, bool ue8m0, " KVW_TAIL ") -> ()");
  m.def("store_kv_nvfp4(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale_cache, "
        "Tensor(d!) v_scale_cache, Tensor? k_global_scale, Tensor? v_global_scale, " KVW_TAIL ") -> ()");
  m.def("store_dsv4_kv(Tensor kv, Tensor(a!) cache, int pool_page_size, " KVW_TAIL ") -> ()");
  m.def("store_dsv4_indexer_k(Tensor k, Tensor(a!) cache, int pool_page_size, int fmt, bool ue8m0, " KVW_TAIL
        ") -> ()");
  m.def("store_rows(Tensor src, Tensor(a!) pool, " KVW_TAIL ") -> ()");
  m.def("rope_store_kv(Tensor positions, Tensor(c!) q, Tensor k, Tensor v, Tensor cos_sin, Tensor(a!) k_cache, "
        "Tensor(b!) v_cache, Tensor? k_scale, Tensor? v_scale, Tensor? q_norm_weight, Tensor? k_norm_weight, "
        "float eps, bool is_neox, " KVW_TAIL ") -> ()");
  m.def("rope_store_kv_quant(Tensor positions, Tensor(c!) q, Tensor k, Tensor v, Tensor cos_sin, "
        "Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_scale, Tensor? v_scale, Tensor(d!)? k_scale_cache, "
        "Tensor(e!)? v_scale_cache, int quant, int rule, Tensor? q_norm_weight, Tensor? k_norm_weight, float eps, "
        "bool is_neox, " KVW_TAIL ") -> ()");
  m.def("rope_store_mla(Tensor positions, Tensor(c!) q_pe, Tensor kv_c, Tensor k_pe, Tensor cos_sin, "
        "Tensor(a!) kv_cache, Tensor? scale, Tensor(b!)? scale_cache, Tensor? global_scale, int mode, bool is_neox, "
        KVW_TAIL ") -> ()");
}

TORCH_LIBRARY_FRAGMENT(kvwrite_ext, m) {
  m.def("bench_memcpy_scatter(Tensor[] src, Tensor(a!)[] dst, Tensor loc) -> ()");
  m.def("claim_rows(Tensor loc, Tensor? loc_map, Tensor(z!)? errors, int dcp_rank, int dcp_size, int check, int op, "
        "Tensor? batch_indices, Tensor? kv_indices, Tensor? kv_indptr, int capacity, int pool_page_size, "
        "bool dcp_page) -> Tensor");
  m.def("store_kv_quant(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor? k_scale, "
        "Tensor? v_scale, Tensor(c!)? k_scale_cache, Tensor(d!)? v_scale_cache, int quant, int rule, " KVW_TAIL
        ") -> ()");
  m.def("store_kv_int4(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale_cache, "
        "Tensor(d!) v_scale_cache, " KVW_TAIL ") -> ()");
}

TORCH_LIBRARY_IMPL(kvwrite_ext, CPU, m) {
  m.impl("store_kv_quant", &kvwrite::store_kv_quant_cpu);
  m.impl("store_kv_int4", &kvwrite::store_kv_int4_cpu);
  m.impl("claim_rows", &kvwrite::claim_rows_cpu);
}

// DeepSeek V4 FP4 records (kvwrite/store_dsv4_fp4.h): fmt 0 nvfp4, 1 nvfp4_v41, 2 mxfp4.
TORCH_LIBRARY_FRAGMENT(kvwrite_ext, m) {
  m.def("store_dsv4_kv_fp4(Tensor kv, Tensor(a!) cache, int pool_page_size, int fmt, " KVW_TAIL_NO_TABLE ") -> ()");
  m.def("rope_store_dsv4_kv_fp4(Tensor positions, Tensor kv, Tensor cos_sin, Tensor(b!)? q, Tensor(a!) cache, "
        "int pool_page_size, int fmt, " KVW_TAIL_NO_TABLE ") -> ()");
}
TORCH_LIBRARY_IMPL(kvwrite_ext, CPU, m) {
  m.impl("store_dsv4_kv_fp4", &kvwrite::store_dsv4_kv_fp4_cpu);
  m.impl("rope_store_dsv4_kv_fp4", &kvwrite::rope_store_dsv4_kv_fp4_cpu);
}

TORCH_LIBRARY_IMPL(kvwrite_ext, CPU, m) {
  m.impl("bench_memcpy_scatter", &kvwrite::bench_memcpy_scatter);
  m.impl("store_kv", &kvwrite::store_kv_cpu);
  m.impl("store_mla", &kvwrite::store_mla_cpu);
  m.impl("store_indexer_k", &kvwrite::store_indexer_k_cpu);
  m.impl("store_kv_nvfp4", &kvwrite::store_kv_nvfp4_cpu);
  m.impl("store_dsv4_kv", &kvwrite::store_dsv4_kv_cpu);
  m.impl("store_dsv4_indexer_k", &kvwrite::store_dsv4_indexer_k_cpu);
  m.impl("store_rows", &kvwrite::store_rows_cpu);
  m.impl("rope_store_kv", &kvwrite::rope_store_kv_cpu);
  m.impl("rope_store_kv_quant", &kvwrite::rope_store_kv_quant_cpu);
  m.impl("rope_store_mla", &kvwrite::rope_store_mla_cpu);
}

TORCH_LIBRARY_FRAGMENT(kvwrite_ext, m) {
  m.def("set_program(str name, str program) -> ()", &kvwrite::api::set_program);
  m.def("set_claims(bool on) -> ()", [](bool on) { kvwrite::api::claims_on() = on; });
  m.def("set_op_names(str[] names) -> ()", [](std::vector<std::string> names) { kvwrite::op_names() = std::move(names); });
  kvwrite::engines::define(m);
}

// The public ops torch.ops.kvwrite.* (schemas defined in Python): the spec-fed kernel of api.h,
// the kernels above for backend "cpu".
namespace kvwrite {
struct CpuRun {
  static constexpr const char* NAME = "cpu";
  static constexpr auto store_kv = &store_kv_cpu;
  static constexpr auto store_kv_quant = &store_kv_quant_cpu;
  static constexpr auto store_kv_int4 = &store_kv_int4_cpu;
  static constexpr auto store_mla = &store_mla_cpu;
  static constexpr auto store_indexer_k = &store_indexer_k_cpu;
  static constexpr auto store_kv_nvfp4 = &store_kv_nvfp4_cpu;
  static constexpr auto store_dsv4_kv = &store_dsv4_kv_cpu;
  static constexpr auto store_dsv4_indexer_k = &store_dsv4_indexer_k_cpu;
  static constexpr auto store_rows = &store_rows_cpu;
  static constexpr auto rope_store_kv = &rope_store_kv_cpu;
  static constexpr auto rope_store_kv_quant = &rope_store_kv_quant_cpu;
  static constexpr auto rope_store_mla = &rope_store_mla_cpu;
  static constexpr auto copy_pages = &copy_pages_cpu;
  static constexpr auto gather = &gather_cpu;
  static constexpr auto slot_mapping = &slot_mapping_cpu;
  static constexpr auto claim_rows = &claim_rows_cpu;
};
// the engines' operators (engines.h) on the CPU kernels
const bool ENGINES_CPU = [] {
  engines::runner(c10::DeviceType::CPU) = {[](const StoreKVParams& p, int64_t check, c10::Device) {
                                              KVW_RUN_CPU(dispatch_store_kv, p, check);
                                            },
                                            &claim_rows_cpu};
  return true;
}();
}  // namespace kvwrite

TORCH_LIBRARY_IMPL(kvwrite, CPU, m) { kvwrite::api::register_ops<kvwrite::CpuRun>(m); }

#ifdef KVWRITE_PYTHON_MODULE
// The ahead-of-time build (setup.py) is the importable module kvwrite._C: importing it runs the
// registrations above. The JIT build is loaded with torch.ops.load_library instead.
#include <Python.h>
PyMODINIT_FUNC PyInit__C(void) {
  static PyModuleDef def = {PyModuleDef_HEAD_INIT, "_C", "kvwrite C++/CUDA kernels (torch.ops.kvwrite_ext)", -1, nullptr};
  return PyModule_Create(&def);
}
#endif
