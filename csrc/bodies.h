// Every op's per-token body, for both devices: the body headers of the generated kvw_ops.h.
#pragma once

#include <type_traits>

#include "kvw_ops.h"

namespace kvwrite {

// A call's locs (overloaded where the params nest them: the fused RoPE stores).
template <class P>
KVW_HD const LocArgs& locs_of(const P& p) {
  return p.locs;
}

// A body with a block barrier: it takes `live` (false past the last token) before its lane.
template <class Token, class P>
constexpr bool BARRIER = std::is_invocable_v<Token, const P&, i64, bool, int, int>;

}  // namespace kvwrite
