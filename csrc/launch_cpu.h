// The CPU per-token runner's entry (ops.cpp's policy calls it; no torch here): run_range<P, C>,
// declared here and instantiated per params type and check mode by the units the build generates
// from each KVW_BODY line (tokens_cpu.h: `KVW_CPU_RUN(P, C)`), so no host unit compiles every
// op's kernels.
#pragma once

#include "bodies.h"

namespace kvwrite {

// Runs tokens [begin, end) of `p` in check mode C on this thread (tokens_cpu.h).
template <class P, int C>
void run_range(const P& p, i64 begin, i64 end);

// run_range for the call's runtime check mode.
template <class P>
void run_range(const P& p, int check, i64 begin, i64 end) {
  with_check(check, [&](auto c) { run_range<P, c.value>(p, begin, end); });
}

}  // namespace kvwrite
