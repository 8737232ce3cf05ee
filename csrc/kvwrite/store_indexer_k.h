// store_indexer_k: the DSA indexer key cache (kvwrite/ops/indexer_k.py). uint8 pages of
// pool_page_size * D e4m3 bytes (token-major), then pool_page_size * D/qbs fp32 scales; each
// qbs-block scale = max(amax, 1e-4) / 448 (ue8m0: rounded up to a power of two).
#pragma once

#include "dispatch.h"
#include "locs.h"
#include "quant.h"

namespace kvwrite {

// The page-major indexer cache: its one address function per region.
struct IndexerCache {
  char* base = nullptr;
  i64 stride_page = 0;  // bytes
  i64 pool_page_size = 1;
  int D = 0, blocks = 0;

  KVW_HD char* data_at(i64 row, int d) const {
    const i64 page = row / pool_page_size, o = row - page * pool_page_size;
    return base + page * stride_page + o * D + d;
  }
  KVW_HD char* scale_at(i64 row, int b) const {
    const i64 page = row / pool_page_size, o = row - page * pool_page_size;
    return base + page * stride_page + pool_page_size * D + (o * blocks + b) * 4;
  }
};

struct StoreIndexerKParams {
  const char* k = nullptr;
  i64 k_sn = 0;  // token stride in elements
  int qbs = 128;
  bool ue8m0 = false;
  IndexerCache cache;
  DType in_dtype = DType::F32;
  LocArgs locs;
};

// Token i: lanes stride over its quant blocks.
template <int CHECK, DType IN>
KVW_HD void store_indexer_k_token(const StoreIndexerKParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  for (int b = lane; b < p.cache.blocks; b += nlanes) {
    const i64 start = i * p.k_sn + i64(b) * p.qbs;
    const float scale = indexer_scale(block_amax<IN>(p.k, start, p.qbs), p.ue8m0);
    quant_block_e4m3<IN>(p.k, start, p.qbs, scale, p.cache.data_at(r.row, b * p.qbs));
    store_le(p.cache.scale_at(r.row, b), float_to_bits(scale), 4);
  }
}

template <int CHECK, DType IN>
struct StoreIndexerKToken {
  KVW_HD void operator()(const StoreIndexerKParams& p, i64 i, int lane, int nlanes) const {
    store_indexer_k_token<CHECK, IN>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_indexer_k(const StoreIndexerKParams& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) { f(TypeTag<StoreIndexerKToken<c.value, in.value>>{}, p.cache.blocks); });
  });
}

}  // namespace kvwrite
