// Every op's per-token body by its params type, for both devices (no torch, no CUDA headers):
// `dispatch(p, check, f)` calls f(TypeTag<Token>, work items per token) for the call's runtime
// check mode and formats; the CPU policy (ops.cpp) runs the Token on the host, the CUDA launcher
// template (tokens.cuh) in a kernel. A body taking a `live` flag (the fused RoPE stores) has a
// block barrier: every thread of a block runs it, through scratch rows of the rotated k.
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

// rope_store_dsv4_kv_fp4: the V4 FP4 store's params with its rotation (ROPED bodies).
struct RopeStoreDSV4FP4Params : StoreDSV4FP4Params {};

// A call's locs (overloaded where the params nest them: the fused RoPE stores).
template <class P>
KVW_HD const LocArgs& locs_of(const P& p) {
  return p.locs;
}

// A body with a block barrier: it takes `live` (false past the last token) before its lane.
template <class Token, class P>
constexpr bool BARRIER = std::is_invocable_v<Token, const P&, i64, bool, int, int>;

#define KVW_BODY(P, fn) \
  template <class F>    \
  void dispatch(const P& p, int check, F&& f) { fn(p, check, f); }
KVW_BODY(StoreKVParams, dispatch_store_kv)
KVW_BODY(StoreKVQuantParams, dispatch_store_kv_quant)
KVW_BODY(StoreKVInt4Params, dispatch_store_kv_int4)
KVW_BODY(StoreMLAParams, dispatch_store_mla)
KVW_BODY(StoreIndexerKParams, dispatch_store_indexer_k)
KVW_BODY(StoreKVNVFP4Params, dispatch_store_kv_nvfp4)
KVW_BODY(StoreDSV4KVParams, dispatch_store_dsv4_kv)
KVW_BODY(StoreMXFP4Params, dispatch_store_mxfp4)
KVW_BODY(StoreRowsParams, dispatch_store_rows)
KVW_BODY(StoreDSV4FP4Params, dispatch_store_dsv4_fp4<false>)
KVW_BODY(RopeStoreDSV4FP4Params, dispatch_store_dsv4_fp4<true>)
KVW_BODY(RopeStoreKVParams, dispatch_rope_store_kv)
KVW_BODY(RopeStoreKVQuantParams, dispatch_rope_store_kv_quant)
KVW_BODY(RopeStoreMLAParams, dispatch_rope_store_mla)
KVW_BODY(GatherParams, dispatch_gather)
#undef KVW_BODY

}  // namespace kvwrite
