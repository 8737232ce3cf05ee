// Page-move CUDA kernels (copy_pages, slot_mapping; their per-item bodies: kvwrite/pages.h).
#include "launch.h"

namespace kvwrite {

// Block (i, c): pair i, items [c * chunk, (c + 1) * chunk) of its unit (VEC bytes each).
template <int CHECK, int VEC>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) copy_pages_kernel(const CopyPagesParams p,
                                                                                       i64 chunk) {
  const i64 i = blockIdx.x;
  const PairResolved r = resolve_pair_checked<CHECK>(p, i, blockIdx.y == 0 && threadIdx.x == 0);
  if constexpr (CHECK == CHECK_GUARD) {  // every thread, before the early return
    if (p.errors != nullptr) end_call(p.errors);
  }
  if (!r.write) return;
  const i64 items = p.unit_bytes() / VEC, begin = i64(blockIdx.y) * chunk;
  const i64 end = begin + chunk < items ? begin + chunk : items;
  copy_unit_items<VEC>(p, p.src.unit_ptr(r.s, p.unit_rows), p.dst.unit_ptr(r.d, p.unit_rows), begin, end,
                       int(threadIdx.x), int(blockDim.x));
}

cudaError_t launch(const CopyPagesParams& p, int check, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  with_check(check, [&](auto c) {
    with_vec(p.vec, [&](auto v) {
      const i64 items = p.unit_bytes() / v.value;
      i64 chunk = i64(KVW_BLOCK_THREADS) * 8;
      if (ceil_div(items, chunk) > 65535) chunk = ceil_div(items, 65535);
      const dim3 grid(unsigned(p.n), unsigned(ceil_div(items, chunk) > 0 ? ceil_div(items, chunk) : 1));
      copy_pages_kernel<c.value, v.value><<<grid, KVW_BLOCK_THREADS, 0, stream>>>(p, chunk);
    });
  });
  return cudaGetLastError();
}

template <int CHECK>
__global__ void __launch_bounds__(KVW_BLOCK_THREADS, KVW_MIN_BLOCKS) slot_mapping_kernel(const SlotMappingParams p) {
  const i64 i = i64(blockIdx.x) * blockDim.x + threadIdx.x;
  if (i < p.n) slot_token<CHECK>(p, i);
  if constexpr (CHECK == CHECK_GUARD) {
    if (p.errors != nullptr) end_call(p.errors);  // the record's call epoch
  }
}

cudaError_t launch(const SlotMappingParams& p, int check, cudaStream_t stream) {
  if (p.n == 0) return cudaSuccess;
  with_check(check, [&](auto c) {
    slot_mapping_kernel<c.value><<<ceil_div(p.n, KVW_BLOCK_THREADS), KVW_BLOCK_THREADS, 0, stream>>>(p);
  });
  return cudaGetLastError();
}

}  // namespace kvwrite
