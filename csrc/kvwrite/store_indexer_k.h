// store_indexer_k: the DSA indexer key cache (kvwrite/ops/indexer_k.py). uint8 pages of
// pool_page_size * D e4m3 bytes (token-major), then pool_page_size * D/qbs fp32 scales; each
// qbs-block scale = max(amax, 1e-4) / 448 (ue8m0: rounded up to a power of two).
#pragma once

#include "dispatch.h"
#include "locs.h"
#include "paged.h"
#include "quant.h"

namespace kvwrite {

// The page-major indexer cache: its one address function per region.
struct IndexerCache {
  char* base = nullptr;
  i64 stride_page = 0;  // bytes
  i64 pool_page_size = 1;
  int D = 0, blocks = 0;

  KVW_HD char* data_at(i64 row, int d) const {
    const i64 page = page_of(row, pool_page_size), o = row - page * pool_page_size;
    return base + page * stride_page + o * D + d;
  }
  KVW_HD char* scale_at(i64 row, int b) const {
    const i64 page = page_of(row, pool_page_size), o = row - page * pool_page_size;
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

// Lanes of one quant block in the warp-cooperative path (CHUNK elements each), or 0 when the
// block size does not split into a power-of-two number of chunks (<= 32).
KVW_HD int indexer_block_lanes(int qbs) {
  const int l = qbs / CHUNK;
  return qbs % CHUNK == 0 && l <= 32 && (l & (l - 1)) == 0 ? l : 0;
}

// Token i. Warp-cooperative where the launch gives enough lanes: a lane group per quant block,
// CHUNK elements a lane, the block amax by xor shuffles, 16-byte loads and stores. Otherwise
// (the host: one lane) a block is two vectorisable loops. Same codes and scales either way.
template <int CHECK, DType IN>
KVW_HD void store_indexer_k_token(const StoreIndexerKParams& p, i64 i, int lane, int nlanes) {
  const Resolved r = resolve_checked<CHECK>(p.locs, i, lane == 0);
  if (!r.write) return;
  const int bl = indexer_block_lanes(p.qbs);
  if (bl > 0 && nlanes >= bl) {
    // nlanes and the chunk count are multiples of bl: a block's lanes share every iteration
    for (int c = lane; c < p.cache.blocks * bl; c += nlanes) {
      float x[CHUNK];
      load_chunk<IN>(p.k, i * p.k_sn + i64(c) * CHUNK, x);
      const float scale = indexer_scale(group_max(chunk_amax(x), bl), p.ue8m0);
      quant_chunk(x, scale, p.cache.data_at(r.row, c * CHUNK));
      if (c % bl == 0) store_le(p.cache.scale_at(r.row, c / bl), float_to_bits(scale), 4);
    }
    return;
  }
#if KVW_SIMD_X86
  if constexpr (IN == DType::BF16) {  // host: ue8m0 scales by integer lanes, plain ones by the tile lanes
    const uint16_t* x = reinterpret_cast<const uint16_t*>(p.k) + i * p.k_sn;
    char* dst = p.cache.data_at(r.row, 0);
    const auto put = [&](int b, float s) { store_le(p.cache.scale_at(r.row, b), float_to_bits(s), 4); };
    if (nlanes == 1 && p.ue8m0 && e4m3_pow2_tiles(x, p.cache.blocks, p.qbs, [](float a) { return indexer_scale(a, true); }, dst, put))
      return;
    // plain: RN(amax / 448) for every amax >= 1e-4 (bf16 0x38D2 up), fp8_ds_mla's scale rule and table
    float sc[16];
    if (nlanes == 1 && !p.ue8m0 &&
        e4m3_tiles_bf16<true>(p.k, i * p.k_sn, p.cache.blocks, p.qbs, [](float a) { return indexer_scale(a, false); }, dst,
                              sc, 0x38D2u)) {
      for (int b = 0; b < p.cache.blocks; ++b) put(b, sc[b]);
      return;
    }
  }
#endif
  for (int b = lane; b < p.cache.blocks; b += nlanes) {
    const i64 start = i * p.k_sn + i64(b) * p.qbs;
    const float scale = indexer_scale(block_amax<IN>(p.k, start, p.qbs), p.ue8m0);
    quant_block_e4m3<IN>(p.k, start, p.qbs, scale, p.cache.data_at(r.row, b * p.qbs));
    store_le(p.cache.scale_at(r.row, b), float_to_bits(scale), 4);
  }
}

template <int CHECK, DType IN>
struct StoreIndexerKToken {
  static constexpr int check = CHECK;
  KVW_HD void operator()(const StoreIndexerKParams& p, i64 i, int lane, int nlanes) const {
    store_indexer_k_token<CHECK, IN>(p, i, lane, nlanes);
  }
};

template <class F>
void dispatch_store_indexer_k(const StoreIndexerKParams& p, int check, F&& f) {
  with_check(check, [&](auto c) {
    with_float_dtype(p.in_dtype, [&](auto in) { 
      const int bl = indexer_block_lanes(p.qbs);
      f(TypeTag<StoreIndexerKToken<c.value, in.value>>{}, bl > 0 ? i64(p.cache.blocks) * bl : p.cache.blocks);
    });
  });
}

// The bytes a token moves (the CPU runner's grain, ops.cpp) and the body by params type (KVW_BODY,
// dispatch.h: the build derives its units from each line).
inline i64 token_bytes(const StoreIndexerKParams& p) {
  return i64(p.cache.D) * (dtype_size(p.in_dtype) + 1) * QUANT_WEIGHT;
}
KVW_BODY(StoreIndexerKParams, dispatch_store_indexer_k)

}  // namespace kvwrite

// The host side (KVW_HOST: ops.cpp, cuda_ops.cpp; never a CUDA unit): tensors ->
// StoreIndexerKParams and its op table row (registry.h).
#ifdef KVW_HOST
#include "../host.h"

#define KVW_OPS_STORE_INDEXER_K(X) \
  X(store_indexer_k, reg::Bind<&store_indexer_k_params>::table, \
    "(Tensor k, Tensor(a!) cache, int quant_block_size, bool ue8m0, " KVW_TAIL ") -> ()")

namespace kvwrite {

inline StoreIndexerKParams store_indexer_k_params(const Tensor& k, const Tensor& cache, int64_t qbs, bool ue8m0,
                                                  const Tensor& loc, const OptTensor& loc_map,
                                                  const OptTensor& errors, int64_t dcp_rank, int64_t dcp_size,
                                                  int64_t check, int64_t op) {
  TORCH_CHECK(k.dim() == 2 && (k.size(1) <= 1 || k.stride(1) == 1), "kvwrite: k must be [N, D], contiguous in D");
  TORCH_CHECK(qbs > 0 && k.size(1) % qbs == 0, "kvwrite: D must be a multiple of quant_block_size");
  TORCH_CHECK(cache.dim() == 2 && cache.scalar_type() == at::kByte && (cache.size(1) <= 1 || cache.stride(1) == 1),
              "kvwrite: the indexer cache must be a uint8 [pages, page bytes] tensor");
  check_same_device(k, cache, "cache");
  const int64_t d = k.size(1), per_token = d + (d / qbs) * 4;
  TORCH_CHECK(cache.size(1) % per_token == 0 && cache.size(1) > 0,
              "kvwrite: the indexer cache page is not a whole number of tokens");
  StoreIndexerKParams p;
  p.k = static_cast<const char*>(k.data_ptr());
  p.k_sn = k.stride(0);
  p.qbs = int(qbs);
  p.ue8m0 = ue8m0;
  p.in_dtype = dtype_of(k);
  p.cache.base = static_cast<char*>(cache.data_ptr());
  p.cache.stride_page = cache.stride(0);
  p.cache.pool_page_size = cache.size(1) / per_token;
  p.cache.D = int(d);
  p.cache.blocks = int(d / qbs);
  p.locs = loc_args(loc, loc_map, errors, dcp_rank, dcp_size, check, op, cache.size(0) * p.cache.pool_page_size,
                    p.cache.pool_page_size, k);
  TORCH_CHECK(p.locs.n == k.size(0), "kvwrite: loc must have one entry per token");
  return p;
}

}  // namespace kvwrite
#endif  // KVW_HOST
