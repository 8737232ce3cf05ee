// Guard-mode error record and assert-mode failure: the ErrorBuffer layout of kvwrite/errors.py.
//
// int64[16]: slot COUNT counts bad tokens (atomic add); every field slot holds a packed key
// `token << 32 | uint32 chunk` updated with an atomic min, so the lowest bad token's fields win
// and stay mutually consistent without a lock (the Triton kernels write the same keys). Only
// one call writes the fields: OWNER is claimed with the call's EPOCH (compare-and-swap from
// EMPTY); EPOCH advances once per call (the CUDA kernels' last block, see end_call; the CPU op
// after its loop), DONE counts a running call's finished blocks.
#pragma once

#include <assert.h>  // __assert_fail: nvcc's device-side assert (what assert() expands to)
#include <cstdio>
#include <type_traits>

#include "common.h"

namespace kvwrite {

namespace slot {
constexpr int COUNT = 0, LOC_LO = 1, LOC_HI = 2, TARGET_LO = 3, TARGET_HI = 4, LIMIT_LO = 5,
              LIMIT_HI = 6, POOL_PAGE_SIZE = 7, META = 8, NUM_SLOTS = 16;
// Page-table context (table kinds only), low 32 bits each: batch, position, slot, page.
constexpr int BATCH = 9, POSITION = 10, TABLE_SLOT = 11, TABLE_PAGE = 12;
// The record's owner (the epoch of the call whose fields it holds), the call counter, and the
// running call's finished blocks.
constexpr int OWNER = 13, EPOCH = 14, DONE = 15;
}
constexpr i64 EMPTY = INT64_MAX;
enum Kind : int { KIND_POOL = 0, KIND_LOC_MAP = 1, KIND_BATCH = 2, KIND_TABLE_SLOT = 3, KIND_TABLE_PAGE = 4,
                  KIND_POSITION = 5,    // rope_store_*: position outside the cos/sin cache
                  KIND_DUPLICATE = 6 }; // a row an earlier token of the call writes (claims.h)

// Op codes: the index of an op in kvwrite.facts.OPS, passed in by Python with each call.

KVW_HD void atomic_min_i64(i64* p, i64 v) {
#if defined(__CUDA_ARCH__)
  atomicMin(reinterpret_cast<long long*>(p), static_cast<long long>(v));
#else
  i64 cur = __atomic_load_n(p, __ATOMIC_RELAXED);
  while (v < cur && !__atomic_compare_exchange_n(p, &cur, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
#endif
}

KVW_HD void atomic_add_i64(i64* p, i64 v) {
#if defined(__CUDA_ARCH__)
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#else
  __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
#endif
}

KVW_HD i64 atomic_load_i64(const i64* p) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const volatile long long*>(p);
#else
  return __atomic_load_n(p, __ATOMIC_ACQUIRE);
#endif
}

// Compare-and-swap; returns the value found.
KVW_HD i64 atomic_cas_i64(i64* p, i64 expected, i64 v) {
#if defined(__CUDA_ARCH__)
  return static_cast<i64>(atomicCAS(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(expected),
                                    static_cast<unsigned long long>(v)));
#else
  __atomic_compare_exchange_n(p, &expected, v, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE);
  return expected;
#endif
}

// Whether this call may write the fields: OWNER claimed with (or already holding) its epoch.
KVW_HD bool owns_record(i64* err) {
  const i64 epoch = atomic_load_i64(err + slot::EPOCH);
  const i64 owner = atomic_cas_i64(err + slot::OWNER, EMPTY, epoch);
  return owner == EMPTY || owner == epoch;
}

// One out-of-range token, as resolve() describes it.
struct Violation {
  i64 token, loc, target, limit, pool_page_size;
  int kind, op;
  bool table = false;  // page-table addressing: the context below is recorded too
  i64 batch = -1, position = -1, table_slot = -1, table_page = -1;
};

KVW_HD i64 packed(i64 token, i64 value) { return (token << 32) | (value & 0xFFFFFFFFll); }

// Fold one bad token into the record (guard mode; the CPU assert pre-scan too).
KVW_HD void record(i64* err, const Violation& v) {
  if (!owns_record(err)) {  // another call's record: count the token only
    atomic_add_i64(err + slot::COUNT, 1);
    return;
  }
  atomic_min_i64(err + slot::LOC_LO, packed(v.token, v.loc));
  atomic_min_i64(err + slot::LOC_HI, packed(v.token, v.loc >> 32));
  atomic_min_i64(err + slot::TARGET_LO, packed(v.token, v.target));
  atomic_min_i64(err + slot::TARGET_HI, packed(v.token, v.target >> 32));
  atomic_min_i64(err + slot::LIMIT_LO, packed(v.token, v.limit));
  atomic_min_i64(err + slot::LIMIT_HI, packed(v.token, v.limit >> 32));
  atomic_min_i64(err + slot::POOL_PAGE_SIZE, packed(v.token, v.pool_page_size));
  atomic_min_i64(err + slot::META, packed(v.token, v.op | (v.kind << 8)));
  if (v.table) {
    atomic_min_i64(err + slot::BATCH, packed(v.token, v.batch));
    atomic_min_i64(err + slot::POSITION, packed(v.token, v.position));
    atomic_min_i64(err + slot::TABLE_SLOT, packed(v.token, v.table_slot));
    atomic_min_i64(err + slot::TABLE_PAGE, packed(v.token, v.table_page));
  }
  atomic_add_i64(err + slot::COUNT, 1);
}

#if defined(__CUDACC__)
// Guard mode, at the end of every block (all threads): count the block in DONE; the call's last
// block resets DONE and advances EPOCH, so the next call on the buffer has its own epoch.
__device__ inline void end_call(i64* err) {
  __syncthreads();  // every thread of the block has recorded (and read EPOCH)
  if (threadIdx.x == 0 && threadIdx.y == 0 && threadIdx.z == 0) {
    __threadfence();
    const unsigned long long total = 1ull * gridDim.x * gridDim.y * gridDim.z;
    auto* done = reinterpret_cast<unsigned long long*>(err + slot::DONE);
    if (atomicAdd(done, 1ull) == total - 1) {
      atomicExch(done, 0ull);
      atomicAdd(reinterpret_cast<unsigned long long*>(err + slot::EPOCH), 1ull);
    }
  }
}

// The end of a kernel's block: end_call in guard mode (compiled out of off / assert kernels; every
// Token states its mode as `check`, which the launcher also picks its unit by: tokens.cuh).
template <class Token>
__device__ inline void end_block(i64* err) {
  if constexpr (Token::check == CHECK_GUARD) {
    if (err != nullptr) end_call(err);
  }
}
#endif

// Assert mode on a GPU: print the token, loc, page and capacity, then a device-side assert
// (fatal for the CUDA context, like torch's index asserts). The CPU kernels throw instead
// (see csrc/ops.cpp), after a pre-scan, before any write.
KVW_HD void device_assert(const Violation& v) {
#if defined(__CUDA_ARCH__)
  if (v.kind == KIND_DUPLICATE) {
    printf("kvwrite: check=assert: op %d token %lld loc %lld writes row %lld, which token %lld of the same "
           "call writes\n",
           v.op, (long long)v.token, (long long)v.loc, (long long)v.target, (long long)v.limit);
  } else if (v.table) {
    printf("kvwrite: check=assert: op %d token %lld page table: batch %lld position %lld slot %lld page %lld: "
           "kind %d index %lld outside its bound %lld\n",
           v.op, (long long)v.token, (long long)v.batch, (long long)v.position, (long long)v.table_slot,
           (long long)v.table_page, v.kind, (long long)v.target, (long long)v.limit);
  } else if (v.kind == KIND_LOC_MAP) {
    printf("kvwrite: check=assert: op %d token %lld loc %lld is outside loc_map (length %lld)\n",
           v.op, (long long)v.token, (long long)v.loc, (long long)v.limit);
  } else {
    printf("kvwrite: check=assert: op %d token %lld loc %lld (local %lld) page %lld, pool has %lld "
           "pages of %lld rows (capacity %lld)\n",
           v.op, (long long)v.token, (long long)v.loc, (long long)v.target,
           (long long)(v.target >= 0 ? v.target / v.pool_page_size : -1),
           (long long)(v.limit / v.pool_page_size), (long long)v.pool_page_size, (long long)v.limit);
  }
  // Called directly, not through assert(): NDEBUG builds keep it.
  __assert_fail("kvwrite: store loc outside the pool (check=assert)", __FILE__, __LINE__, __func__);
#else
  (void)v;
#endif
}

// What a kernel does with a bad token in mode CHECK (it never writes it).
template <int CHECK>
KVW_HD void on_bad(i64* err, const Violation& v) {
  if constexpr (CHECK == CHECK_GUARD) {
    record(err, v);
  } else if constexpr (CHECK == CHECK_ASSERT) {
    device_assert(v);
  }
}

}  // namespace kvwrite
