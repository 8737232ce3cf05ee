"""`store_kv`: the fused paged K+V store of MHA/GQA (bf16/fp16/fp32, fp8 with scales)."""
from __future__ import annotations

from dataclasses import dataclass
import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.ops import kv_quant, spec
from kvwrite.ops._common import Check, Locs

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


@spec.rule("native_layout")  # C++: NHD / HND only; cpu_attn calls take the Python path
def _cpu_attn_key(env: dict, v: dict) -> None:
    """layout "cpu_attn": each (page, head) key tile is one contiguous run (read column-major)."""
    kc = v["k_cache"]
    if env["layout"] == "cpu_attn" and kc.shape[2] > 1 and kc.shape[3] > 1 and kc.stride(2) != kc.shape[3]:
        raise ValueError(f"k_cache (layout 'cpu_attn') must hold each (page, head) tile of "
                         f"pool_page_size * D = {kc.shape[2]} * {kc.shape[3]} elements contiguously "
                         f"(stored column-major), got strides {kc.stride()}")


@spec.rule("kv_scales")
def _scales(env: dict, v: dict) -> None:
    """fp8 caches take both scales; other caches none."""
    dtype = env["k_cache"]
    if dtype in validate.FP8_MAX:
        if v["k_scale"] is None or v["v_scale"] is None:
            raise ValueError(f"k_scale and v_scale are required for a {dtype} cache")
    elif v["k_scale"] is not None or v["v_scale"] is not None:
        raise ValueError(f"k_scale/v_scale apply only to fp8 caches; the caches are {dtype}")


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> StoreKV:
    layout = env["layout"]
    return StoreKV(v["k"], v["v"], canonical_key(v["k_cache"], layout), canonical(v["v_cache"], layout),
                   v["k_scale"], v["v_scale"], env["geometry"], locs, chk)


CACHE_DIMS = "num_pages, pool_page_size, H, D"
SPEC = spec.Op(
    OP,
    args=(spec.T("k", "N H D", validate.FLOAT_INPUTS),
          spec.T("v", "N H Dv", ("=k",), what="tokens, heads as k, head_dim_v"),
          spec.cache("k_cache", "P S H D", ("=k", *spec.FP8), binds="P S", layout=True, what=CACHE_DIMS),
          spec.cache("v_cache", "P S H Dv", ("=k_cache",), layout=True, what=CACHE_DIMS),
          spec.LOC, spec.option("layout"),
          spec.opt("k_scale", "scale H", role="scale"), spec.opt("v_scale", "scale H", role="scale"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND),
    checks=("k", "v", spec.choice("layout", LAYOUTS), "k_cache", "v_cache", spec.geometry("k_cache"),
            _cpu_attn_key, _scales, "k_scale", "v_scale"),
    build=_build, impls=IMPLS)
_OP = SPEC.overload
_CALL = _OP._op  # the C++ builtin behind the OpOverload (pool.store binds it)


def prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                     loc_map, dcp_rank, dcp_size) -> StoreKV:
    """A validated store_kv call (the spec's checks)."""
    return SPEC.prepare((k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                         loc_map, dcp_rank, dcp_size, "auto", None, None, None))


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             loc: torch.Tensor, *, layout: str = "NHD", k_scale: torch.Tensor | None = None,
             v_scale: torch.Tensor | None = None, check: str | None = None,
             errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
             dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto",
             k_scale_cache: torch.Tensor | None = None,
             v_scale_cache: torch.Tensor | None = None, quant_rule: str = "rne") -> None:
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
    `[pages, pool_page_size, H]`) are stored by their own kernel family, `kvwrite.ops.kv_quant`;
    `quant_rule` ("rne" | "vllm") picks how their dynamic codes round (see there).
    """
    if quant_rule != "rne" or kv_quant.routes_here(k_cache, k_scale_cache, v_scale_cache):
        return kv_quant.store_kv_quant(k, v, k_cache, v_cache, loc, layout=layout, k_scale=k_scale,
                                       v_scale=v_scale, k_scale_cache=k_scale_cache,
                                       v_scale_cache=v_scale_cache, check=check, errors=errors,
                                       loc_map=loc_map, dcp_rank=dcp_rank, dcp_size=dcp_size,
                                       backend=backend, quant_rule=quant_rule)
    return SPEC.entry(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors, loc_map,
                      dcp_rank, dcp_size, backend)
