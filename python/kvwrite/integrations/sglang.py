"""SGLang on kvwrite's bounds-checked stores, without changing SGLang's code.

`python -m kvwrite.integrations.sglang <sglang launch_server args>` runs `sglang.launch_server`
with the hook installed in the launcher and in every process SGLang spawns (a `sitecustomize` on
their PYTHONPATH). `install()` patches SGLang's pool classes at their physical-write methods,
after SGLang's own dtype handling (the table in `install`: MHA / MLA rows, DSA and DeepSeek V4
index-K, V4 KV pages and fused stores, V4 compress state), onto `kvwrite.compat.sglang`'s
adapters and kvwrite's stores; what stays SGLang's, and why, is NOT_ROUTED. Guard mode as in the
vLLM plugin (`KVWRITE_SGLANG_GUARD=raise | log`, records read once per `ModelRunner.forward`);
`KVWRITE_SGLANG=0` leaves SGLang untouched. Routes, formats and differences: docs/engines.md.
"""
from __future__ import annotations

import importlib
import logging
import os
import sys
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvwrite.integrations.guard import Route, StepGuard

ENABLE_ENV = "KVWRITE_SGLANG"
BACKEND_ENV = "KVWRITE_SGLANG_BACKEND"
POLICY_ENV = "KVWRITE_SGLANG_GUARD"
LOG = logging.getLogger("kvwrite.sglang")
POOLS = "sglang.srt.mem_cache.memory_pool"
RUNNER = "sglang.srt.model_executor.model_runner"
MHA_ROUTE = Route(POOLS, "MHATokenToKVPool._store_kv_layer", "set_kv_buffer", None, 0)
MLA_ROUTE = Route(POOLS, "MLATokenToKVPool._scatter_mla_rows", "set_mla_kv_buffer", None, 0)
INDEX_K = "sglang.kernels.ops.kvcache.dsa_index_k_cache"
DSV4_KV = "sglang.kernels.ops.kvcache.dsv4_main_kv_store"
DSV4_POOLS = "sglang.srt.mem_cache.deepseek_v4_memory_pool"
DSV4_STATE = "sglang.srt.mem_cache.deepseek_v4_compress_state"
DSV4_FP4_INDEX = "sglang.kernels.ops.kvcache.dsv4_fp4_index_k_cache"
INDEX_K_ROUTE = Route(INDEX_K, "SetKAndS.execute", "set_index_k_scale_buffer", None, 0)
DSV4_KV_ROUTE = Route(DSV4_KV, "SetKAndS.execute", "set_dsv4_key_buffer", None, 0)
STATE_ROUTE = Route(DSV4_STATE, "CompressStatePool.set_state_by_state_loc", "store_rows", None, 0)
NOT_ROUTED = {
    "MHATokenToKVPool (kv_cache_layout='vectorized_5d')": "SGLang's shuffled 5-D layout: no kvwrite layout",
    "MLATokenToKVPool, DCP-sharded writes without rope (qk_rope_head_dim 0)": "SGLang's no-rope kernel "
        "ignores DCP (writes the widened loc unsharded); kvwrite's sharded store would write other rows",
    "MLATokenToKVPool.set_kv_buffer": "an indexed assignment (bounds-checked by torch itself)",
    "Page-major 4-D strided views (PageMajorMHATokenToKVPool, not constructible in SGLang 0.5.23)":
        "kvwrite routes per-layer buffers of dense rows (contiguous, or a unified pool's token-major view)",
    "dsa_index_k_cache.SetKAndS (ROCm preshuffled index-K)": "tiled key layout: no kvwrite layout",
    "DeepSeekV4SingleKVPool.set_key_buffer_fused of a V4.1 fp4 pool with padded pages (page_size * 288 "
    "not a multiple of 256)": "kvwrite's FP4 records have no page padding",
    "DeepSeekV4IndexerPool.set_index_fp4 on HIP (aiter's split payload / scale buffers, page8)":
        "a transposed layout: no kvwrite layout",
    "DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused(_norm_rope) into a uniform-FP8 SWA pool, or a "
    "buffer whose pages are not swa_page_size": "no kvwrite record for it",
    "DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope with q (HIP: the query RoPE fused "
    "into the K store)": "kvwrite's store does not rotate the query heads",
    "DeepSeekV4TokenToKVPool.set_unified_key_buffer_radix_fused_norm_rope": "a unified pool (see above)",
    "DeepSeekV4UniformFP8KVPool.set_key_buffer_fused": "an indexed assignment (bounds-checked by torch itself)",
}


@dataclass
class Installed:
    originals: dict[str, tuple[Any, str, Callable]] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    fallbacks: dict[str, int] = field(default_factory=dict)


STATE = Installed()
GUARD: StepGuard | None = None


def guard() -> StepGuard:
    """The process's StepGuard for SGLang."""
    global GUARD
    if GUARD is None:
        GUARD = StepGuard("SGLang", POLICY_ENV, "kvwrite.sglang", policies=("raise", "log"))
    return GUARD


def _store(state: Installed, key: str, buf: torch.Tensor, route: Route, write: Callable, *args, **kwargs) -> None:
    """Count call `key` and run `write(*args, **kwargs)` in the check mode, guard mode recording into
    `buf`'s layer row (read right after the store when no step hook reads it: pool code on its own)."""
    from kvwrite import validate

    _count(state, key)
    mode = validate.DEFAULT_CHECK
    errors = guard().errors_for(buf, route) if mode == "guard" else None
    write(*args, check=mode, errors=errors, **kwargs)
    if errors is not None and not guard().stepped:
        guard().raise_now(errors, buf)


def _store_kv_layer(original: Callable, backend: str, state: Installed) -> Callable:
    from kvwrite.compat import sglang as adapters

    def store(self, layer_idx, loc, cache_k, cache_v):
        if getattr(self, "kv_cache_layout", None) == "vectorized_5d":
            return _fallback(state, "vectorized_5d", original, self, layer_idx, loc, cache_k, cache_v)
        if not (_row_layout(self.k_buffer[layer_idx], 3, True) and _row_layout(self.v_buffer[layer_idx], 3, True)):
            return _fallback(state, "mha_page_major_views", original, self, layer_idx, loc, cache_k, cache_v)
        kb, vb = self.k_buffer[layer_idx], self.v_buffer[layer_idx]
        fp8 = self.store_dtype != self.dtype
        if fp8:    # cache_k / cache_v arrive viewed as store_dtype (uint8): the fp8 bytes
            cache_k, cache_v = cache_k.view(self.dtype), cache_v.view(self.dtype)
        _store(state, "set_kv_buffer", kb, MHA_ROUTE, adapters.set_kv_buffer, kb.view(kb.shape[0], -1,
               cache_k.shape[-1]), vb.view(vb.shape[0], -1, cache_v.shape[-1]), loc, cache_k, cache_v, self.page_size,
               dtype=self.dtype if fp8 else None, backend=backend)
    return _routed(store, original)


def _routed(fn: Callable, original: Any) -> Callable:
    """A routed write as installed: outside any torch.compile graph (the record row comes from a
    real tensor's data_ptr), remembering SGLang's original for `uninstall`."""
    fn = torch.compiler.disable(fn)
    fn.__wrapped_sglang__ = original
    return fn


def _row_layout(t: Any, ndim: int, strided_rows: bool = False) -> bool:
    """A buffer in SGLang's standard per-layer layout: contiguous `ndim`-D rows; `strided_rows`: or
    dense rows at any row stride (the unified pools' token-major views of one shared buffer, a
    layer's rows one whole entry apart). Other strided views (page-major 4-D) are not."""
    if not isinstance(t, torch.Tensor) or t.dim() != ndim:
        return False
    if not strided_rows or t.is_contiguous():
        return t.is_contiguous()
    row = t[0]
    return row.is_contiguous() and t.stride(0) >= row.numel()


def _fallback(state: Installed, why: str, original: Callable, *args, **kwargs):
    state.fallbacks[why] = state.fallbacks.get(why, 0) + 1
    return original(*args, **kwargs)


def _half_words(t: torch.Tensor) -> torch.Tensor:
    """A uint8 row tensor as 16-bit words (kvwrite copies bytes as 16/32-bit elements)."""
    return t.view(torch.float16) if t.dtype == torch.uint8 else t


def _dcp_span(pool: Any) -> int:
    """The pool's DCP width (its loc space is that many times the rows); 1 without DCP."""
    try:
        return int(pool._write_loc_dcp_span)
    except Exception:  # noqa: BLE001 - no parallel context published: no DCP
        return 1


def _dcp_rank() -> int:
    """This process's DCP rank (SGLang's `get_parallel().attn_dcp_rank`)."""
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().attn_dcp_rank)


def _scatter_mla_rows(original: Callable, backend: str, state: Installed) -> Callable:
    from kvwrite.compat import sglang as adapters

    def scatter(self, dst_buffer, loc, cache_k_nope, cache_k_rope):
        if not _row_layout(dst_buffer, 3, True):
            return _fallback(state, "mla_page_major_views", original, self, dst_buffer, loc, cache_k_nope, cache_k_rope)
        rope = cache_k_rope if cache_k_rope is not None and cache_k_rope.numel() > 0 else \
            cache_k_nope.reshape(cache_k_nope.shape[0], -1)[:, :0]
        dcp_size, dcp_rank, key = 1, 0, "set_mla_kv_buffer"
        if not (getattr(self, "write_loc_is_dcp_resolved", True) or getattr(self, "dcp_replicated", False)
                or _dcp_span(self) == 1):
            if rope.shape[-1] == 0:    # SGLang's no-rope kernel ignores DCP: kvwrite would not write the same rows
                return _fallback(state, "mla_dcp_sharded_norope", original, self, dst_buffer, loc, cache_k_nope,
                                 cache_k_rope)
            dcp_size, dcp_rank, key = _dcp_span(self), _dcp_rank(), key + " (DCP-sharded)"
        _store(state, key, dst_buffer, MLA_ROUTE, adapters.set_mla_kv_buffer, _half_words(dst_buffer), loc,
               _half_words(cache_k_nope), _half_words(rope), self.page_size, dcp_rank=dcp_rank, dcp_size=dcp_size,
               backend=backend)
    return _routed(scatter, original)


def _count(state: Installed, key: str) -> None:
    state.calls[key] = state.calls.get(key, 0) + 1


def _index_k_execute(original: Any, backend: str, state: Installed) -> classmethod:
    """`SetKAndS.execute(pool=, buf=, loc=, index_k=, index_k_scale=)` of the DSA index-K cache."""
    from kvwrite.compat import sglang as adapters

    def execute(cls, *args, buf, **kwargs):
        module = sys.modules.get(INDEX_K)
        if getattr(module, "_use_aiter_preshuffle", False):
            return _fallback(state, "index_k_preshuffle", original.__get__(None, cls), *args, buf=buf, **kwargs)
        a = dict(zip(("pool", "loc", "index_k", "index_k_scale"), args), **kwargs)
        if not _row_layout(buf, 2):
            return _fallback(state, "index_k_not_contiguous", original.__get__(None, cls), *args, buf=buf, **kwargs)
        _store(state, "set_index_k_scale_buffer", buf, INDEX_K_ROUTE, adapters.set_index_k_scale_buffer, buf,
               a["loc"], a["index_k"], a["index_k_scale"], a["pool"].index_page_size, backend=backend)
    return classmethod(_routed(execute, original))


def _dsv4_kv_execute(original: Any, backend: str, state: Installed) -> classmethod:
    """`SetKAndS.execute(pool, buf, loc, nope_fp8_rope_bf16_pack)` of DeepSeek V4's KV pages."""
    from kvwrite.compat import sglang as adapters

    def execute(cls, *args, **kwargs):
        a = dict(zip(("pool", "buf", "loc", "nope_fp8_rope_bf16_pack"), args), **kwargs)
        pack, buf = a["nope_fp8_rope_bf16_pack"], a["buf"]
        if not _row_layout(buf, 2):
            return _fallback(state, "dsv4_kv_not_contiguous", original.__get__(None, cls), *args, **kwargs)
        _store(state, "set_dsv4_key_buffer", buf, DSV4_KV_ROUTE, adapters.set_dsv4_key_buffer, buf, a["loc"],
               pack.k_nope_fp8, pack.k_rope_bf16, pack.scale_k_nope_ue8m0, a["pool"].page_size, backend=backend)
    return classmethod(_routed(execute, original))


def _set_state(original: Callable, backend: str, state: Installed) -> Callable:
    """`CompressStatePool.set_state_by_state_loc(state_loc, value)`: rows of the kv+score buffer (a -1
    state loc skipped; SGLang writes it into its sentinel row, then clears that row)."""
    from kvwrite.ops.dsv4 import store_rows

    def set_state(self, state_loc, value):
        buf = self.kv_score_buffer.kv_score
        if not _row_layout(buf, 2):
            return _fallback(state, "state_not_contiguous", original, self, state_loc, value)
        src = value.kv_score if hasattr(value, "kv_score") else value
        def write(*args, **kwargs):
            store_rows(*args, **kwargs)
            self.kv_score_buffer[-1].clear()     # SGLang's sentinel row, as its own store leaves it
        _store(state, "set_state_by_state_loc", buf, STATE_ROUTE, write, src.reshape(-1, buf.shape[-1]), buf,
               state_loc.reshape(-1), backend=backend)
    return _routed(set_state, original)


DSV4_FUSED_ROUTE = Route(DSV4_POOLS, "DeepSeekV4SingleKVPool.set_key_buffer_fused", "store_dsv4_kv", None, 0)
INDEX_FUSED_ROUTE = Route(DSV4_POOLS, "DeepSeekV4IndexerPool.set_index_fused", "store_dsv4_indexer_k", None, 0)


def _dsv4_target(buf: Any, page_size: int, layout: str) -> bool:
    """A V4 buffer kvwrite's records fill: contiguous pages of the V4 layout (FlashMLA's padded
    584-byte rows), of an unpadded V4.1 fp4 layout, or of a V4.1 fp8 layout."""
    from kvwrite.compat.sglang import V41_LAYOUTS
    from kvwrite.facts import FP4_RECORDS, kv_page_bytes, v41_fp8_page_bytes

    if not _row_layout(buf, 2):
        return False
    if layout == "v4":
        return buf.shape[1] == kv_page_bytes(page_size)
    if layout in ("v41", "v41_new"):
        return buf.shape[1] == v41_fp8_page_bytes(page_size, V41_LAYOUTS[layout][1])
    return layout in V41_LAYOUTS and buf.shape[1] == page_size * FP4_RECORDS["nvfp4_v41"].token_bytes


def _store_dsv4(state: Installed, key: str, buf, loc, cache_k, page_size: int, layout: str, freqs_cis,
                backend: str) -> None:
    """SGLang's JIT `fused_store_cache(type="flashmla")` into a `_dsv4_target` buffer: the V4 layout
    -> `store_dsv4_kv`; the V4.1 layouts (fp4 and fp8, with or without in-kernel RoPE) -> their
    `compat.sglang.V41_LAYOUTS` writer."""
    from kvwrite.compat.sglang import V41_LAYOUTS
    from kvwrite.ops.dsv4 import store_dsv4_kv

    if layout == "v4":
        _store(state, key, buf, DSV4_FUSED_ROUTE, store_dsv4_kv, cache_k, buf, loc, page_size=page_size,
               backend=backend)
    else:
        write, interleaved = V41_LAYOUTS[layout]
        _store(state, key, buf, DSV4_FUSED_ROUTE, write, buf, loc, cache_k, page_size, freqs_cis,
               interleaved=interleaved, backend=backend)


def _layout(pool: Any) -> str:
    return str(getattr(pool.kv_layout, "value", pool.kv_layout))


def _dsv4_fused(original: Callable, backend: str, state: Installed) -> Callable:
    """`DeepSeekV4SingleKVPool.set_key_buffer_fused(layer_id, loc, cache_k, freqs_cis=None)`: the V4
    and V4.1 layouts (`_store_dsv4`)."""
    def fused(self, layer_id, loc, cache_k, freqs_cis=None):
        buf, layout = self.kv_buffer[layer_id], _layout(self)
        if not _dsv4_target(buf, self.page_size, layout) or (layout == "v4" and freqs_cis is not None):
            # a padded V4.1 fp4 page, uniform fp8, V4 with RoPE (SGLang refuses it)
            why = f"dsv4_fused_{layout}{'_rope' if freqs_cis is not None else ''}"
            return _fallback(state, why, original, self, layer_id, loc, cache_k, freqs_cis)
        key = "set_key_buffer_fused" + (f" ({layout}{', RoPE' if freqs_cis is not None else ''})"
                                        if layout != "v4" else "")
        _store_dsv4(state, key, buf, loc, cache_k, self.page_size, layout, freqs_cis, backend)
    return _routed(fused, original)


def _swa_buffer(pool: Any, layer_id: int):
    """(buffer, layout) of V4's SWA cache for `layer_id` as SGLang's SWA stores write it (its SWA
    pool's buffer, or a request window's ring buffer: `get_swa_raw_buffer`, pages of
    `swa_page_size`), or None where kvwrite has no record for it (a uniform-FP8 pool)."""
    if getattr(pool, "uniform_fp8", False):
        return None
    buf, layout = pool.get_swa_raw_buffer(layer_id), _layout(pool)
    return (buf, layout) if _dsv4_target(buf, pool.swa_page_size, layout) else None


def _swa_radix_fused(original: Callable, backend: str, state: Installed) -> Callable:
    """`DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused(layer_id, swa_loc, cache_k)` (V4's
    SWA cache: SGLang's fused_store_cache on `get_swa_raw_buffer`) -> `_store_dsv4`."""
    def fused(self, layer_id, swa_loc, cache_k):
        target = _swa_buffer(self, layer_id)
        if target is None:
            return _fallback(state, f"swa_radix_fused_{_layout(self)}", original, self, layer_id, swa_loc, cache_k)
        _store_dsv4(state, "set_swa_key_buffer_radix_fused", target[0], swa_loc, cache_k, self.swa_page_size,
                    target[1], None, backend)
    return _routed(fused, original)


def _swa_norm_rope(original: Callable, backend: str, state: Installed) -> Callable:
    """`DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope(layer_id, swa_loc, kv,
    kv_weight, eps, freqs_cis, positions, q=None)` (the SWA store of SGLang's DeepSeek V4 attention:
    RMSNorm + RoPE + store in one kernel) -> `compat.sglang.set_dsv4_norm_rope_key_buffer`; the
    query RoPE fused into it (HIP only) stays SGLang's."""
    from kvwrite.compat import sglang as adapters

    def fused(self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis, positions, q=None):
        target = None if q is not None else _swa_buffer(self, layer_id)
        if target is None:
            why = "swa_norm_rope_q" if q is not None else f"swa_norm_rope_{_layout(self)}"
            return _fallback(state, why, original, self, layer_id, swa_loc, kv, kv_weight, eps, freqs_cis,
                             positions, **({} if q is None else {"q": q}))
        buf, layout = target
        _store(state, "set_swa_key_buffer_radix_fused_norm_rope", buf, DSV4_FUSED_ROUTE,
               adapters.set_dsv4_norm_rope_key_buffer, buf, swa_loc, kv, kv_weight, eps, freqs_cis, positions,
               self.swa_page_size, layout=layout, backend=backend)
    return _routed(fused, original)


def _index_buffer(pool: Any, layer_id: int):
    bufs = getattr(pool, "index_k_with_scale_buffer", None)
    return bufs[layer_id - pool.start_layer] if bufs is not None else None


def _index_fused(original: Callable, backend: str, state: Installed) -> Callable:
    """`DeepSeekV4IndexerPool.set_index_fused(layer_id, loc, cache_k)` (fp8 indexer)."""
    from kvwrite.ops.dsv4 import store_dsv4_indexer_k

    def fused(self, layer_id, loc, cache_k):
        buf = _index_buffer(self, layer_id)
        if getattr(self, "use_fp4_indexer", False) or not _row_layout(buf, 2):
            return _fallback(state, "index_fused_not_fp8", original, self, layer_id, loc, cache_k)
        _store(state, "set_index_fused", buf, INDEX_FUSED_ROUTE, store_dsv4_indexer_k, cache_k, buf, loc,
               page_size=self.page_size, fmt="fp8", backend=backend)
    return _routed(fused, original)


INDEX_FP4_ROUTE = Route(DSV4_POOLS, "DeepSeekV4IndexerPool.set_index_fp4", "set_fp4_index_k_buffer", None, 0)


def _index_fp4(original: Callable, backend: str, state: Installed, import_module: Callable) -> Callable:
    """`DeepSeekV4IndexerPool.set_index_fp4(layer_id, loc, cache_k)` (the CUDA / Triton layout):
    SGLang's own quantiser (`quantize_fp4_indexer_tensor`, the pool's `index_k_rne`), then its bytes
    through `compat.sglang.set_fp4_index_k_buffer`; the HIP split layout stays SGLang's."""
    from kvwrite.compat import sglang as adapters

    def fp4(self, layer_id, loc, cache_k):
        buf = _index_buffer(self, layer_id)
        if getattr(self, "uses_aiter_fp4_layout", False) or not _row_layout(buf, 2):
            return _fallback(state, "index_fp4_hip_split_layout", original, self, layer_id, loc, cache_k)
        k_fp4, k_sf = import_module(DSV4_FP4_INDEX).quantize_fp4_indexer_tensor(
            cache_k.contiguous(), rne=bool(getattr(self, "index_k_rne", False)))
        _store(state, "set_index_fp4", buf, INDEX_FP4_ROUTE, adapters.set_fp4_index_k_buffer, buf, loc, k_fp4, k_sf,
               self.page_size, backend=backend)
    return _routed(fp4, original)


def register_pool(pool: Any) -> None:
    """Name a pool's per-layer buffers after their layer ids (guard records, error messages)."""
    start = getattr(pool, "start_layer", 0) or 0
    label = getattr(pool, "allocation_label", None)      # "Full" / "SWA": a hybrid pool's sub-pools
    kind = type(pool).__name__ + (f" ({label} sub-pool)" if label else "")
    caches = {}
    for attr, what in (("k_buffer", "K"), ("v_buffer", "V"), ("kv_buffer", "KV"),
                       ("index_k_with_scale_buffer", "index-K")):
        try:
            bufs = getattr(pool, attr, None) or []
        except Exception:  # noqa: BLE001 - a property over storage not built yet
            bufs = []
        for i, t in enumerate(bufs):
            if isinstance(t, torch.Tensor) and t.numel():
                caches[f"{kind} layer {start + i} {what}"] = t
    state = getattr(pool, "kv_score_buffer", None)
    if isinstance(getattr(state, "kv_score", None), torch.Tensor):
        caches[f"{kind} c{getattr(pool, 'ratio', '?')} compress state"] = state.kv_score
    if caches:
        guard().register(caches)


def _init(original: Callable) -> Callable:
    def init(self, *args, **kwargs):
        original(self, *args, **kwargs)
        register_pool(self)
    init.__wrapped_sglang__ = original
    return init


def _forward(original: Callable) -> Callable:
    def forward(self, *args, **kwargs):
        from kvwrite import validate

        g = guard()
        g.stepped = True
        out = original(self, *args, **kwargs)
        if validate.DEFAULT_CHECK == "guard":
            g.check()
        return out
    forward.__wrapped_sglang__ = original
    return forward


def _patch(state: Installed, module: Any, cls_name: str, attr: str, make: Callable) -> bool:
    cls = getattr(module, cls_name, None)
    key = f"{module.__name__}.{cls_name}.{attr}"
    if cls is None or key in state.originals or attr not in vars(cls):
        return False
    state.originals[key] = (cls, attr, vars(cls)[attr])
    setattr(cls, attr, make(vars(cls)[attr]))
    return True


def install(import_module: Callable[[str], Any] = importlib.import_module, backend: str | None = None,
            state: Installed | None = None) -> Installed:
    """Patch SGLang's pool classes (and its ModelRunner.forward when importable); idempotent."""
    state = STATE if state is None else state
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    pools = import_module(POOLS)
    _patch(state, pools, "MHATokenToKVPool", "_store_kv_layer", lambda f: _store_kv_layer(f, backend, state))
    _patch(state, pools, "MLATokenToKVPool", "_scatter_mla_rows", lambda f: _scatter_mla_rows(f, backend, state))
    for cls_name in ("MHATokenToKVPool", "MLATokenToKVPool", "DSATokenToKVPool"):
        _patch(state, pools, cls_name, "__init__", _init)
    for name, cls_name, attr, make in (
            (INDEX_K, "SetKAndS", "execute", lambda f: _index_k_execute(f, backend, state)),
            (DSV4_KV, "SetKAndS", "execute", lambda f: _dsv4_kv_execute(f, backend, state)),
            (DSV4_STATE, "CompressStatePool", "set_state_by_state_loc", lambda f: _set_state(f, backend, state)),
            (DSV4_STATE, "CompressStatePool", "__init__", _init),
            (DSV4_POOLS, "DeepSeekV4SingleKVPool", "__init__", _init),
            (DSV4_POOLS, "DeepSeekV4SingleKVPool", "set_key_buffer_fused", lambda f: _dsv4_fused(f, backend, state)),
            (DSV4_POOLS, "DeepSeekV4TokenToKVPool", "set_swa_key_buffer_radix_fused",
             lambda f: _swa_radix_fused(f, backend, state)),
            (DSV4_POOLS, "DeepSeekV4TokenToKVPool", "set_swa_key_buffer_radix_fused_norm_rope",
             lambda f: _swa_norm_rope(f, backend, state)),
            (DSV4_POOLS, "DeepSeekV4IndexerPool", "set_index_fused", lambda f: _index_fused(f, backend, state)),
            (DSV4_POOLS, "DeepSeekV4IndexerPool", "set_index_fp4",
             lambda f: _index_fp4(f, backend, state, import_module)),
            (DSV4_POOLS, "DeepSeekV4IndexerPool", "__init__", _init)):
        try:
            module = import_module(name)
        except Exception as exc:  # noqa: BLE001 - an SGLang without this pool (or its kernels)
            LOG.info("kvwrite: %s not importable (%s): not routed", name, exc)
            continue
        _patch(state, module, cls_name, attr, make)
    try:
        runner = import_module(RUNNER)
    except Exception as exc:  # noqa: BLE001 - pool code used on its own (no model runner)
        LOG.info("kvwrite: SGLang's model runner not importable (%s): guard records are read after "
                 "each store", exc)
    else:
        _patch(state, runner, "ModelRunner", "forward", _forward)
    return state


def uninstall(state: Installed | None = None) -> None:
    state = STATE if state is None else state
    for cls, attr, original in state.originals.values():
        setattr(cls, attr, original)
    state.originals.clear()


def report(state: Installed | None = None) -> str:
    state = STATE if state is None else state
    return (f"kvwrite: routed SGLang pool writes: {', '.join(sorted(state.originals)) or 'none'}; "
            f"not routed: " + "; ".join(f"{k} ({v})" for k, v in NOT_ROUTED.items()))


SITE = '''import os
if os.environ.get("KVWRITE_SGLANG", "1") != "0":
    try:
        from kvwrite.integrations import sglang as _kvw
        _kvw.install_when_imported()
    except Exception as _exc:  # never stop SGLang from starting; say why
        import sys
        print(f"kvwrite: SGLang hook not installed: {_exc}", file=sys.stderr)
'''


def install_when_imported() -> None:
    """Install as soon as SGLang's pool module is imported (or now, if it is)."""
    from kvwrite.integrations.imports import when_imported

    when_imported(POOLS, lambda module: install())


def main(argv: list[str] | None = None) -> None:
    """`python -m kvwrite.integrations.sglang <launch_server args>`."""
    import runpy

    argv = sys.argv[1:] if argv is None else argv
    site = tempfile.mkdtemp(prefix="kvwrite-sglang-")
    with open(os.path.join(site, "sitecustomize.py"), "w") as f:
        f.write(SITE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)
    if os.environ.get(ENABLE_ENV, "1") != "0":
        install_when_imported()
    sys.argv = ["sglang.launch_server", *argv]
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
