// The CPU per-token loop, the host twin of tokens.cuh, instantiated by the generated units
// (csrc/README.md). No torch: threads, assert pre-scan and guard epoch are ops.cpp's.
#pragma once

#include <cstdint>
#include <vector>

#include "bodies.h"
#include "kvwrite/stream.h"

namespace kvwrite {

// The Token that dispatch(p, C, ...) picks (of mode C only) over tokens [begin, end); the fused
// RoPE stores rotate each token's k (k_pe) into one reused, cache-hot scratch row, then store it.
template <class P, int C>
void run_range(const P& p, i64 begin, i64 end) {
  dispatch(p, C, [&](auto token, i64) {
    using Token = typename decltype(token)::type;
    if constexpr (Token::check != C) {
    } else if constexpr (HAS_SCRATCH<P>) {
      const ScratchRow r = scratch_row(p);
      std::vector<uint64_t> row(size_t(r.elems * r.elem_bytes + 7) / 8);
      P q = p;
      q.scratch = reinterpret_cast<char*>(row.data());
      q.scratch_sn = 0;
      for (i64 i = begin; i < end; ++i) Token{}(q, i, true, 0, 1);
    } else {
      for (i64 i = begin; i < end; ++i) Token{}(p, i, 0, 1);
    }
  });
  stream_fence();  // the streamed rows before the chunk ends
}

}  // namespace kvwrite

// The CPU loop of one params type in one check mode (an explicit instantiation, generated units only).
#define KVW_CPU_RUN(P, C) \
  template void kvwrite::run_range<kvwrite::P, kvwrite::C>(const kvwrite::P&, kvwrite::i64, kvwrite::i64);
