"""`store_kv`: the fused paged K+V store of MHA/GQA (bf16/fp16/fp32, fp8 with scales)."""
from __future__ import annotations

from dataclasses import dataclass
import torch

from kvwrite import _ext, validate
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.ops import _library, kv_quant
from kvwrite.ops._common import NATIVE, Check, Locs, cache_geometry, dispatch, prepare, record

OP = "store_kv"
LAYOUTS = ("NHD", "HND", "cpu_attn")
IMPLS = (
    ("torch", "kvwrite.reference.kv:store_kv"),
    ("triton", "kvwrite.kernels.store_kv:launch"),
    ("cpu", "kvwrite._ext:store_kv"),
    ("cuda", "kvwrite._ext:store_kv"),
)


@dataclass(slots=True, eq=False)
class StoreKV:
    """A validated store_kv call (read-only by convention; slotted, not frozen: built on every
    call). Caches are canonical [pages, pool_page_size, H, D] views (HND caches are permuted
    views: one shape, other strides)."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    geometry: PageGeometry
    locs: Locs
    check: Check


def canonical(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """[pages, rows, H, D] view of an NHD or HND paged cache (and of a "cpu_attn" value cache)."""
    return cache if layout == "NHD" else cache.transpose(1, 2)


def canonical_key(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The key cache's canonical view: as `canonical`, except for "cpu_attn" (vLLM's CPU attention
    key cache: each (page, head) tile of `[rows, D]` elements stored column-major, element (t, d)
    at d * rows + t), a split head dim `[pages, rows, H, D, 1]` with feature stride `rows`."""
    if layout != "cpu_attn":
        return canonical(cache, layout)
    pages, h, rows, d = cache.shape
    return cache.as_strided((pages, rows, h, d, 1), (cache.stride(0), 1, cache.stride(1), rows, 1))


def _check_tensors(k, v, k_cache, v_cache, layout) -> tuple[int, int, PageGeometry]:
    """(tokens, heads, geometry) after checking k, v, the caches and the layout."""
    k = validate.tensor("k", k, ndim=3, dtypes=validate.FLOAT_INPUTS)
    n, h, dk = k.shape
    device = k.device
    v = validate.tensor("v", v, ndim=3, dtypes=(k.dtype,), device=device)
    validate.shape("v", v, (n, h, None), "tokens, heads as k, head_dim_v")
    layout = validate.choice("layout", layout, LAYOUTS)
    cache_dtypes = (k.dtype, *validate.FP8_MAX)
    k_cache = validate.tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=device)
    v_cache = validate.tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    kc = canonical(k_cache, layout)
    dims = "num_pages, pool_page_size, H, D" if layout == "NHD" else "num_pages, H, pool_page_size, D"
    num_pages, pps = kc.shape[0], kc.shape[1]
    for name, c, d in (("k_cache", k_cache, dk), ("v_cache", v_cache, v.shape[2])):
        expect = (num_pages, pps, h, d) if layout == "NHD" else (num_pages, h, pps, d)
        validate.shape(name, c, expect, f"{layout}: {dims}")
    if layout == "cpu_attn" and pps > 1 and dk > 1 and k_cache.stride(2) != dk:
        raise ValueError(f"k_cache (layout 'cpu_attn') must hold each (page, head) tile of "
                         f"pool_page_size * D = {pps} * {dk} elements contiguously (stored column-"
                         f"major), got strides {k_cache.stride()}")
    return n, h, cache_geometry("k_cache", num_pages, pps)


def prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                     loc_map, dcp_rank, dcp_size) -> StoreKV:
    # The tensor checks depend only on the facts in the key: run once per distinct key.
    key = validate.facts(k, v, k_cache, v_cache)
    if key is not None and layout in LAYOUTS:
        key = (OP, layout, key)
    else:
        key = None
    n, h, geometry = validate.memo(key, lambda: _check_tensors(k, v, k_cache, v_cache, layout))
    device = k.device
    kc, vc = canonical_key(k_cache, layout), canonical(v_cache, layout)
    if k_cache.dtype in validate.FP8_MAX:
        if k_scale is None or v_scale is None:
            raise ValueError(f"k_scale and v_scale are required for a {k_cache.dtype} cache")
        k_scale = validate.scale("k_scale", k_scale, h, device)
        v_scale = validate.scale("v_scale", v_scale, h, device)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale apply only to fp8 caches; the caches are {k_cache.dtype}")
    locs, chk = prepare(OP, device, n, loc, loc_map, dcp_rank, dcp_size, check, errors)
    return StoreKV(k, v, kc, vc, k_scale, v_scale, geometry, locs, chk)


def _store_kv_py(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors, loc_map,
                 dcp_rank, dcp_size, backend) -> None:
    """The Python implementation of torch.ops.kvwrite.store_kv (see ops._library)."""
    a = prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                         loc_map, dcp_rank, dcp_size)
    if a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)


def _fake(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors, loc_map, dcp_rank,
          dcp_size, backend) -> None:
    """Validation only: the same errors while tracing and for meta tensors."""
    prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, _library.fake_check(check, errors),
                     errors, loc_map, dcp_rank, dcp_size)


_OP = _library.define(
    OP, "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor loc, str layout, "
        "Tensor? k_scale, Tensor? v_scale, str check, Tensor(c!)? errors, Tensor? loc_map, "
        "int dcp_rank, int dcp_size, str backend) -> ()", _store_kv_py, _fake)
_CALL = _OP._op  # the C++ builtin behind the OpOverload (one Python frame less per call)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor, *, layout: str = "NHD", k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, check: str | None = None,
             errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
             dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto",
             k_scale_cache: torch.Tensor | None = None,
             v_scale_cache: torch.Tensor | None = None) -> None:
    """Write token i's K/V rows to the paged caches at `loc[i]` (-1 = padding, skipped).

    `layout`: "NHD" caches `[pages, pool_page_size, H, D]` or "HND" `[pages, H, pool_page_size, D]`;
    "cpu_attn" (vLLM's CPU attention backend): both `[pages, H, pool_page_size, D]` as HND, the
    value tile of each (page, head) row-major, the key tile column-major (element (t, d) at
    d * pool_page_size + t of the tile; vLLM's `kv.chunk(2, dim=2)` halves of a
    `[pages, H, 2 * pool_page_size, D]` buffer).
    fp8 caches take fp32 `k_scale`/`v_scale` (`[]`, `[1]` or `[H]`): stored = saturate(x / scale).
    `check`: "off" | "assert" | "guard" (skip + record into `errors`, default per-device buffer).
    `loc_map` (hybrid SWA, int32/int64 full->SWA map): write at `loc_map[loc[i]]`; a mapped -1
    is skipped. `dcp_rank`/`dcp_size`: store only this rank's tokens at their local rows.
    Composition order, per token (`kvwrite.kernels._common.resolve_locs`):
    `loc` (-1: skip) -> `loc_map[loc]` (loc outside [0, len(loc_map)): KIND_LOC_MAP error, skipped
    in off mode; mapped -1: skip) -> DCP (`row % dcp_size == dcp_rank` else skip; local row
    `row // dcp_size`) -> bounds of the local row against the pool (KIND_POOL). The error record
    keeps the caller's virtual loc and names the index that was out of range.
    int8 caches (static `k_scale`/`v_scale`) and dynamic per-token / per-token-head int8 / fp8
    caches (`k_scale_cache`/`v_scale_cache` fp32 `[pages, pool_page_size]` or
    `[pages, pool_page_size, H]`) are stored by their own kernel family, `kvwrite.ops.kv_quant`.
    """
    if kv_quant.routes_here(k_cache, k_scale_cache, v_scale_cache):
        return kv_quant.store_kv_quant(k, v, k_cache, v_cache, loc, layout=layout, k_scale=k_scale,
                                       v_scale=v_scale, k_scale_cache=k_scale_cache,
                                       v_scale_cache=v_scale_cache, check=check, errors=errors,
                                       loc_map=loc_map, dcp_rank=dcp_rank, dcp_size=dcp_size,
                                       backend=backend)
    if (_ext.LOADED and backend in NATIVE and type(dcp_rank) is int and type(dcp_size) is int
            and isinstance(loc, torch.Tensor) and not torch.compiler.is_compiling()):
        mode = validate.DEFAULT_CHECK if check is None else check
        # The C++ op validates (same errors) and runs the kernel; what it leaves to Python
        # comes back through kvwrite::store_kv_py.
        try:
            return _CALL(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, mode,
                         record(errors, mode, k), loc_map, dcp_rank, dcp_size, backend)
        except Exception:  # arguments the schema refused: Python's error names them
            prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                             loc_map, dcp_rank, dcp_size)
            raise
    a = prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                         loc_map, dcp_rank, dcp_size)
    if torch.compiler.is_compiling():
        torch.ops.kvwrite.store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, a.check.mode,
                                   a.check.errors, loc_map, dcp_rank, dcp_size, backend)
    elif a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)
