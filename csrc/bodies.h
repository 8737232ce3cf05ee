// Every op's per-token body, for both devices (no torch, no CUDA headers): the body headers,
// each ending with its `KVW_BODY(Params, dispatch_<op>)` lines (the macro: kvwrite/dispatch.h).
// `dispatch(p, check, f)` calls f(TypeTag<Token>, work items per token) for the call's runtime
// check mode and formats; the CPU policy (ops.cpp) runs the Token on the host, the CUDA launcher
// template (tokens.cuh) in a kernel, one generated unit per KVW_BODY (kvwrite._ext.launch_units).
// A body taking a `live` flag (the fused RoPE stores) has a block barrier: every thread of a block
// runs it, through scratch rows of the rotated k.
#pragma once

#include <type_traits>

#include "kvwrite/claims.h"
#include "kvwrite/kv_int4.h"
#include "kvwrite/pages.h"
#include "kvwrite/rope_store.h"
#include "kvwrite/store_dsv4.h"
#include "kvwrite/store_dsv4_fp4.h"
#include "kvwrite/store_indexer_k.h"
#include "kvwrite/store_kv.h"
#include "kvwrite/store_kv_nvfp4.h"
#include "kvwrite/store_kv_quant.h"
#include "kvwrite/store_mla.h"

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
