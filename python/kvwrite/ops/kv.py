"""`store_kv`: the fused paged K+V store of MHA/GQA, one op for every cache format (copy, static,
dynamic per token / token-head, int4: `kvwrite.facts.QUANT_*`, picked from the cache dtype and the
scales). The formats and their formulas: `kvwrite.reference.kv_quant`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import (FMT_INT4, FMT_INT8, FMT_SAME, FORMAT_OF, INT4_MAX_DIM, KV_LAYOUTS as LAYOUTS,
                           QUANT_COPY, QUANT_DTYPES, QUANT_HEAD, QUANT_INT4, QUANT_STATIC, QUANT_TOKEN,
                           RULE_RNE, RULE_VLLM, RULES)
from kvwrite.geometry import PageGeometry
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs, impls

IMPLS = impls("kv:store_kv", "store_kv:launch", "store_kv")
# int8 caches and dynamic scales
QUANT_IMPLS = impls("kv_quant:store_kv_quant", "store_kv_quant:launch", "store_kv_quant")
INT4_IMPLS = impls("kv_int4:store_kv_int4", "store_kv_int4:launch", "store_kv_int4")


@dataclass(slots=True, eq=False)
class KVStore:
    """A validated K/V store (slotted, not frozen: built on every call). Caches are canonical [pages,
    pool_page_size, H, D] views; `k_scale_cache`/`v_scale_cache` [pages, pool_page_size, 1 or H] views."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    geometry: PageGeometry
    locs: Locs
    check: Check
    quant: int = QUANT_COPY
    fmt: int = FMT_SAME
    k_scale_cache: torch.Tensor | None = None
    v_scale_cache: torch.Tensor | None = None
    rule: int = RULE_RNE


_CPU_ATTN = LAYOUTS.index("cpu_attn")  # layouts below it are [pages, rows, heads, feat] views

def canonical(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """[pages, rows, H, D] view of an NHD or HND paged cache (and of a "cpu_attn" value cache)."""
    return cache if layout == "NHD" else cache.transpose(1, 2)


def canonical_key(cache: torch.Tensor, layout: str) -> torch.Tensor:
    """The key cache's canonical view; "cpu_attn" (each (page, head) tile column-major, (t, d) at
    d * rows + t): a split head dim `[pages, rows, H, D, 1]` with feature stride `rows`."""
    if layout != "cpu_attn":
        return canonical(cache, layout)
    pages, h, rows, d = cache.shape
    return cache.as_strided((pages, rows, h, d, 1), (cache.stride(0), 1, cache.stride(1), rows, 1))


# C++: the same test, plus cpu_attn's plain / fp8-only rule (quant_rule says why)
@spec.rule(expr=f"layout < {_CPU_ATTN} || ((size($k_cache, 2) <= 1 || size($k_cache, 3) <= 1 || "
                "stride($k_cache, 2) == size($k_cache, 3)) && none($k_scale_cache) && k_cache != int8)")
def _cpu_attn_key(env: dict, v: dict) -> None:
    """layout "cpu_attn": each (page, head) key tile is one contiguous run (read column-major)."""
    kc = v["k_cache"]
    if env["layout"] == "cpu_attn" and kc.shape[2] > 1 and kc.shape[3] > 1 and kc.stride(2) != kc.shape[3]:
        raise ValueError(f"k_cache (layout 'cpu_attn') must hold each (page, head) tile of "
                         f"pool_page_size * D = {kc.shape[2]} * {kc.shape[3]} elements contiguously "
                         f"(stored column-major), got strides {kc.stride()}")


def _dynamic(env: dict, v: dict) -> int:
    """The dynamic mode of a call with scale caches (QUANT_TOKEN / QUANT_HEAD), checked."""
    ksc, vsc = v["k_scale_cache"], v["v_scale_cache"]
    if ksc is None or vsc is None:
        raise ValueError("k_scale_cache and v_scale_cache go together (dynamic per-token quantisation)")
    if v["k_scale"] is not None or v["v_scale"] is not None:
        raise ValueError("k_scale/v_scale (static) and k_scale_cache/v_scale_cache (dynamic) exclude each other")
    if env["k_cache"] not in QUANT_DTYPES:
        raise TypeError(f"k_scale_cache/v_scale_cache need an int8 or fp8 cache, got {env['k_cache']}")
    for name, t in (("k_scale_cache", ksc), ("v_scale_cache", vsc)):
        validate.scale_cache(name, t, env["P"], env["S"], env["H"], env["device"])
    if ksc.shape != vsc.shape:
        raise ValueError(f"k_scale_cache and v_scale_cache must have the same shape, got "
                         f"{list(ksc.shape)} and {list(vsc.shape)}")
    return QUANT_HEAD if ksc.dim() == 3 else QUANT_TOKEN


@spec.rule(expr=f"i4 = dtype($k_cache) == uint8; !i4 || (D % 2 == 0 && Dv % 2 == 0 && D <= {INT4_MAX_DIM} && "
                f"Dv <= {INT4_MAX_DIM}); Dk = i4 ? D / 2 : D; Dvk = i4 ? Dv / 2 : Dv")
def _widths(env: dict, v: dict) -> None:
    """The caches' last dims Dk / Dvk: D and Dv, halved for a uint8 (int4) cache."""
    d, dv = env["D"], env["Dv"]
    if isinstance(v["k_cache"], torch.Tensor) and v["k_cache"].dtype == torch.uint8:
        if d % 2 or dv % 2 or max(d, dv) > INT4_MAX_DIM:
            raise ValueError(f"an int4 (uint8) cache needs even head dims of at most {INT4_MAX_DIM}, "
                             f"got D={d}, Dv={dv}")
        env.update(Dk=d // 2, Dvk=dv // 2, kdim="D / 2 (two int4 codes a byte)",
                   vdim="Dv / 2 (two int4 codes a byte)")
    else:
        env.update(Dk=d, Dvk=dv, kdim="D", vdim="Dv")


def _int4(env: dict, v: dict) -> None:
    """QUANT_INT4 (a uint8 cache): scale caches [P, S, H] only, vLLM's rule, NHD / HND caches."""
    ksc, vsc = v["k_scale_cache"], v["v_scale_cache"]
    if v["k_scale"] is not None or v["v_scale"] is not None:
        raise ValueError("k_scale/v_scale do not apply to an int4 (uint8) cache: its scales are "
                         "per token-head, in k_scale_cache/v_scale_cache")
    if ksc is None or vsc is None:
        raise ValueError("an int4 (uint8) cache needs k_scale_cache and v_scale_cache, fp32 "
                         "[num_pages, pool_page_size, H]")
    if v["quant_rule"] not in (None, "vllm"):
        raise ValueError(f"quant_rule={v['quant_rule']!r} does not apply to an int4 (uint8) cache: "
                         f"the format has one rounding rule (vLLM's; kvwrite.reference.kv_int4)")
    if env["layout"] == "cpu_attn":
        raise ValueError("layout 'cpu_attn' stores plain and fp8 caches only (no int4)")
    for name, t in (("k_scale_cache", ksc), ("v_scale_cache", vsc)):
        t = validate.tensor(name, t, dtypes=(torch.float32,), device=env["device"], last_contiguous=False)
        if t.dim() != 3:
            raise ValueError(f"{name} of an int4 (uint8) cache must be [num_pages, pool_page_size, H] "
                             f"(one scale per token-head), got shape {tuple(t.shape)}")
        validate.shape(name, t, (env["P"], env["S"], env["H"]),
                       "num_pages, pool_page_size, H: one scale per token-head (int4)")
    env.update(quant=QUANT_INT4, rule=RULE_VLLM, fmt=FMT_INT4)


@spec.rule(expr=(  # the same decisions, for the C++ matcher (int4's shapes: `_int4`, `_widths`)
    "i4 = k_cache == uint8; dyn = !none($k_scale_cache) || !none($v_scale_cache); "
    "static = !none($k_scale) || !none($v_scale); both = !none($k_scale_cache) && !none($v_scale_cache); "
    "q8 = k_cache == int8 || k_cache == float8_e4m3fn || k_cache == float8_e5m2; "
    f"rule = $quant_rule == None ? (i4 ? {RULE_VLLM} : {RULE_RNE}) : i4 && $quant_rule != 'vllm' ? -1 : "
    + spec.switch("quant_rule", RULES) + "; rule >= 0; "
    f"quant = i4 ? {QUANT_INT4} : dyn ? (dim($k_scale_cache) == 3 ? {QUANT_HEAD} : {QUANT_TOKEN}) : "
    f"q8 || k_cache == float8_e4m3fnuz ? {QUANT_STATIC} : {QUANT_COPY}; "
    f"!i4 || (!static && both && dim($k_scale_cache) == 3 && dim($v_scale_cache) == 3 && layout < {_CPU_ATTN}); "
    "i4 || !dyn || (!static && both && q8 && dim($k_scale_cache) >= 2 && "
    "same_sizes($k_scale_cache, 0, $v_scale_cache, 0)); "
    f"i4 || dyn || (rule == {RULE_RNE} && (quant ? !none($k_scale) && !none($v_scale) : !static)); "
    f"layout < {_CPU_ATTN} || (quant <= {QUANT_STATIC} && k_cache != int8)"))
def _quant(env: dict, v: dict) -> None:
    """The format: copy, static (both scales), dynamic (both scale caches) or int4 (`_int4`);
    `quant_rule` only for dynamic scales; "cpu_attn" caches copy or fp8 only."""
    dtype, name = env["k_cache"], v["quant_rule"]
    if dtype == torch.uint8:
        return _int4(env, v)
    rule = RULES[validate.choice("quant_rule", "rne" if name is None else name, tuple(RULES))]
    if v["k_scale_cache"] is not None or v["v_scale_cache"] is not None:
        quant = _dynamic(env, v)
    elif dtype in validate.FP8_MAX or dtype == torch.int8:
        if v["k_scale"] is None or v["v_scale"] is None:
            raise ValueError(f"k_scale and v_scale are required for a {dtype} cache (static; dynamic: "
                             f"k_scale_cache and v_scale_cache)")
        quant = QUANT_STATIC
    elif v["k_scale"] is not None or v["v_scale"] is not None:
        raise ValueError(f"k_scale/v_scale apply only to fp8 / int8 caches; the caches are {dtype}")
    else:
        quant = QUANT_COPY
    if rule != RULE_RNE and quant not in (QUANT_TOKEN, QUANT_HEAD):
        raise ValueError(f"quant_rule={name!r} applies only to dynamic scales (k_scale_cache/v_scale_cache)")
    fmt = FORMAT_OF.get(dtype, FMT_SAME)
    if env["layout"] == "cpu_attn" and (quant > QUANT_STATIC or fmt == FMT_INT8):
        raise ValueError("layout 'cpu_attn' stores plain and fp8 caches only (no int8, no scale caches)")
    env.update(quant=quant, rule=rule, fmt=fmt)


def _scale_view(t: torch.Tensor | None) -> torch.Tensor | None:
    return t.unsqueeze(-1) if t is not None and t.dim() == 2 else t


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> KVStore:
    layout, quant = env["layout"], env["quant"]
    return KVStore(v["k"], v["v"], canonical_key(v["k_cache"], layout), canonical(v["v_cache"], layout),
                   v["k_scale"], v["v_scale"], env["geometry"], locs, chk, quant, env["fmt"],
                   _scale_view(v["k_scale_cache"]), _scale_view(v["v_scale_cache"]), env["rule"])


@spec.when(f"quant == {QUANT_INT4}")
def int4(env: dict) -> bool:
    """An int4 (uint8) cache: store_kv_int4's kernels."""
    return env["quant"] == QUANT_INT4


@spec.when(f"quant == {QUANT_COPY} || (quant == {QUANT_STATIC} && k_cache != int8)")
def plain(env: dict) -> bool:
    """Copy and static fp8: the plain kernels; int8 and dynamic scales run the _quant kernels."""
    return env["quant"] == QUANT_COPY or (env["quant"] == QUANT_STATIC and env["k_cache"] != torch.int8)


# The formats, the first whose condition holds: int4, plain (the key cache in its own view:
# cpu_attn's column-major tiles), else store_kv_quant's (scale caches [P, S] or [P, S, H]).
FORMATS = (spec.Format(INT4_IMPLS, int4), spec.Format(IMPLS, plain, raw_args={"k_cache": "k:k_cache"}),
           spec.Format(QUANT_IMPLS))
CACHE_DIMS = "num_pages, pool_page_size, H, "
SPEC = spec.Op(
    "store_kv",
    args=(spec.T("k", "N H D", validate.FLOAT_INPUTS),
          spec.T("v", "N H Dv", ("=k",), what="tokens, heads as k, head_dim_v"),
          spec.cache("k_cache", "P S H Dk", ("=k", *spec.FP8, torch.int8, torch.uint8), binds="P S",
                     layout=True, what=CACHE_DIMS + "{kdim}"),
          spec.cache("v_cache", "P S H Dvk", ("=k_cache",), layout=True, what=CACHE_DIMS + "{vdim}"),
          spec.LOC, spec.option("layout"),
          spec.opt("k_scale", "scale H", role="scale"), spec.opt("v_scale", "scale H", role="scale"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND,
          spec.opt("k_scale_cache", mutable=True, role="cache", default=None),
          spec.opt("v_scale_cache", mutable=True, role="cache", default=None),
          spec.option("quant_rule", "str?", default=None)),
    checks=("k", "v", spec.choice("layout", LAYOUTS), _widths, "k_cache", "v_cache", spec.geometry("k_cache"),
            _cpu_attn_key, _quant, "k_scale", "v_scale"),
    build=_build, impls=FORMATS)
_CALL = SPEC.overload._op  # the C++ builtin behind the OpOverload (pool.store binds it)


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
    fp8 and int8 caches take fp32 `k_scale`/`v_scale` (`[]`, `[1]` or `[H]`): stored =
    saturate(x / scale). Dynamic per-token / per-token-head int8 / fp8 caches take
    `k_scale_cache`/`v_scale_cache` fp32 `[pages, pool_page_size]` or `[pages, pool_page_size, H]`
    instead; `quant_rule` ("rne" | "vllm") picks how their codes round (`kvwrite.reference.kv_quant`).
    int4 (vLLM's INT4_PER_TOKEN_HEAD): uint8 caches `[pages, pool_page_size, H, D / 2]` with fp32
    `k_scale_cache`/`v_scale_cache` `[pages, pool_page_size, H]` (rotated, asymmetric 4-bit codes,
    the zero point in the scale's low mantissa bits: `kvwrite.reference.kv_int4`;
    `kvwrite.dequant_kv_int4` reads them back).
    `check`: "off" | "assert" | "guard" (skip + record into `errors`, default per-device buffer).
    `loc_map` (hybrid SWA, int32/int64 full->SWA map): write at `loc_map[loc[i]]`; a mapped -1
    is skipped. `dcp_rank`/`dcp_size`: store only this rank's tokens at their local rows.
    Composition order, per token (`kvwrite.kernels._common.resolve_locs`):
    `loc` (-1: skip) -> `loc_map[loc]` (loc outside [0, len(loc_map)): KIND_LOC_MAP error, skipped
    in off mode; mapped -1: skip) -> DCP (`row % dcp_size == dcp_rank` else skip; local row
    `row // dcp_size`) -> bounds of the local row against the pool (KIND_POOL). The error record
    keeps the caller's virtual loc and names the index that was out of range.
    """
    return SPEC.entry(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors, loc_map,
                      dcp_rank, dcp_size, backend, k_scale_cache, v_scale_cache,
                      None if quant_rule == "rne" else quant_rule)
