"""Quantised K/V stores beyond `store_kv`'s copy/fp8 kernel: static per-tensor int8 and per-token /
per-token-head *dynamic* int8 / fp8 caches with fp32 side scale caches (vLLM's
`reshape_and_cache_flash` per-token-quant caches). `store_kv(..., k_scale_cache=, v_scale_cache=)`
and int8 caches dispatch here; `rope_store_kv` uses the same validated description of its K/V store.

Per token (or token-head) over the values x (fp32 of the input dtype):
    scale  = max(amax(|x|) / QMAX, 1e-6)       fp32 division; QMAX 127 (int8), 448 (e4m3fn), 57344 (e5m2)
    stored = saturate(RNE(x / scale))          fp32 division (not a multiply by 1/scale), then
                                               round to nearest even: int8 clamped to [-128, 127],
                                               fp8 by the shared fp8 rounding (saturating at its max)
Static int8: the same with the given fp32 scale ([], [1] or [H]). dequant: code * scale.
Amax is taken over the finite values (NaN / +-inf do not count; they are then coded as the
special-value policy says: NaN -> int8 0 / the fp8 NaN code, +-inf -> +-max).

`quant_rule="vllm"` (dynamic modes only) is vLLM's per-token-head store instead:
    stored = saturate(x * (1 / scale))         1 / scale rounded to fp32 first; int8: the fp32
                                               sum x * (1 / scale) +- 0.5 (half away from zero)
                                               clamped to [-128, 127], then truncated
Kernels: `kvwrite.kernels.store_kv_quant` (device functions `kvwrite.kernels._quant`), the C++ /
CUDA `csrc/kvwrite/store_kv_quant.h` (`kv_quant.h`).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.facts import (  # noqa: F401  (the formats' facts, re-exported)
    FMT_E4M3, FMT_E5M2, FMT_INT8, FMT_SAME, FORMAT_OF, QMAX, QUANT_COPY, QUANT_DTYPES, QUANT_HEAD,
    QUANT_STATIC, QUANT_TOKEN, RULE_RNE, RULE_VLLM, RULES, SCALE_FLOOR)
from kvwrite.geometry import PageGeometry
from kvwrite.ops._common import Check, Locs, cache_geometry, dispatch, prepare

OP = "store_kv"
IMPLS = (
    ("torch", "kvwrite.reference.kv_quant:store_kv_quant"),
    ("triton", "kvwrite.kernels.store_kv_quant:launch"),
    ("cpu", "kvwrite._ext:store_kv_quant"),
    ("cuda", "kvwrite._ext:store_kv_quant"),
)

LAYOUTS = ("NHD", "HND")


@dataclass(frozen=True)
class KVStore:
    """A validated K/V store: canonical [pages, pool_page_size, H, D] cache views, the quant mode
    and its scales (`k_scale_cache`/`v_scale_cache`: [pages, pool_page_size, 1 or H] views)."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    quant: int
    fmt: int
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    k_scale_cache: torch.Tensor | None
    v_scale_cache: torch.Tensor | None
    geometry: PageGeometry
    locs: Locs
    check: Check
    rule: int = RULE_RNE


def canonical(cache: torch.Tensor, layout: str) -> torch.Tensor:
    return cache if layout == "NHD" else cache.transpose(1, 2)


def prepare_kv_store(op: str, k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, k_scale_cache,
                     v_scale_cache, check, errors, loc_map, dcp_rank, dcp_size,
                     allowed=(QUANT_COPY, QUANT_STATIC, QUANT_TOKEN, QUANT_HEAD),
                     quant_rule: str = "rne") -> KVStore:
    k = validate.tensor("k", k, ndim=3, dtypes=validate.FLOAT_INPUTS)
    n, h, dk = k.shape
    device = k.device
    v = validate.tensor("v", v, ndim=3, dtypes=(k.dtype,), device=device)
    validate.shape("v", v, (n, h, None), "tokens, heads as k, head_dim_v")
    layout = validate.choice("layout", layout, LAYOUTS)
    cache_dtypes = (k.dtype, *QUANT_DTYPES)
    k_cache = validate.tensor("k_cache", k_cache, ndim=4, dtypes=cache_dtypes, device=device)
    v_cache = validate.tensor("v_cache", v_cache, ndim=4, dtypes=(k_cache.dtype,), device=device)
    kc, vc = canonical(k_cache, layout), canonical(v_cache, layout)
    num_pages, pps = kc.shape[0], kc.shape[1]
    dims = "num_pages, pool_page_size, H, D" if layout == "NHD" else "num_pages, H, pool_page_size, D"
    for name, c, d in (("k_cache", k_cache, dk), ("v_cache", v_cache, v.shape[2])):
        expect = (num_pages, pps, h, d) if layout == "NHD" else (num_pages, h, pps, d)
        validate.shape(name, c, expect, f"{layout}: {dims}")
    geometry = cache_geometry("k_cache", num_pages, pps)
    dyn = k_scale_cache is not None or v_scale_cache is not None
    if dyn:
        if k_scale_cache is None or v_scale_cache is None:
            raise ValueError("k_scale_cache and v_scale_cache go together (dynamic per-token quantisation)")
        if k_scale is not None or v_scale is not None:
            raise ValueError("k_scale/v_scale (static) and k_scale_cache/v_scale_cache (dynamic) exclude each other")
        if k_cache.dtype not in QUANT_DTYPES:
            raise TypeError(f"k_scale_cache/v_scale_cache need an int8 or fp8 cache, got {k_cache.dtype}")
        ksc = validate.scale_cache("k_scale_cache", k_scale_cache, num_pages, pps, h, device)
        vsc = validate.scale_cache("v_scale_cache", v_scale_cache, num_pages, pps, h, device)
        if ksc.shape != vsc.shape:
            raise ValueError(f"k_scale_cache and v_scale_cache must have the same shape, got "
                             f"{list(k_scale_cache.shape)} and {list(v_scale_cache.shape)}")
        quant = QUANT_HEAD if k_scale_cache.dim() == 3 else QUANT_TOKEN
        k_scale = v_scale = None
    elif k_cache.dtype in QUANT_DTYPES:
        if k_scale is None or v_scale is None:
            raise ValueError(f"a {k_cache.dtype} cache needs k_scale and v_scale (static) or "
                             f"k_scale_cache and v_scale_cache (dynamic)")
        k_scale = validate.scale("k_scale", k_scale, h, device)
        v_scale = validate.scale("v_scale", v_scale, h, device)
        quant, ksc, vsc = QUANT_STATIC, None, None
    else:
        if k_scale is not None or v_scale is not None:
            raise ValueError(f"k_scale/v_scale apply only to int8/fp8 caches; the caches are {k_cache.dtype}")
        quant, ksc, vsc = QUANT_COPY, None, None
    rule = RULES[validate.choice("quant_rule", quant_rule, tuple(RULES))]
    if rule != RULE_RNE and quant not in (QUANT_TOKEN, QUANT_HEAD):
        raise ValueError(f"quant_rule={quant_rule!r} applies only to dynamic scales "
                         f"(k_scale_cache/v_scale_cache)")
    if quant not in allowed:
        raise ValueError(f"{op}: this store has no quant mode {quant}")
    locs, chk = prepare(op, device, n, loc, loc_map, dcp_rank, dcp_size, check, errors)
    return KVStore(k, v, kc, vc, quant, FORMAT_OF.get(k_cache.dtype, FMT_SAME), k_scale, v_scale,
                   ksc, vsc, geometry, locs, chk, rule)


def routes_here(k_cache: object, k_scale_cache: object, v_scale_cache: object) -> bool:
    """Whether a store_kv call belongs to this kernel family (int8 cache or dynamic scales)."""
    return (k_scale_cache is not None or v_scale_cache is not None
            or (isinstance(k_cache, torch.Tensor) and k_cache.dtype == torch.int8))


@torch.library.custom_op("kvwrite::store_kv_quant",
                         mutates_args=("k_cache", "v_cache", "k_scale_cache", "v_scale_cache", "errors"))
def _store_kv_quant_op(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       loc: torch.Tensor, layout: str, k_scale: torch.Tensor | None,
                       v_scale: torch.Tensor | None, k_scale_cache: torch.Tensor | None,
                       v_scale_cache: torch.Tensor | None, check: str | None,
                       errors: torch.Tensor | None, loc_map: torch.Tensor | None, dcp_rank: int,
                       dcp_size: int, backend: str, quant_rule: str) -> None:
    store_kv_quant(k, v, k_cache, v_cache, loc, layout=layout, k_scale=k_scale, v_scale=v_scale,
                   k_scale_cache=k_scale_cache, v_scale_cache=v_scale_cache, check=check,
                   errors=errors, loc_map=loc_map, dcp_rank=dcp_rank, dcp_size=dcp_size,
                   backend=backend, quant_rule=quant_rule)


@_store_kv_quant_op.register_fake
def _(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, k_scale_cache, v_scale_cache, check,
      errors, loc_map, dcp_rank, dcp_size, backend, quant_rule) -> None:
    return None


def store_kv_quant(k, v, k_cache, v_cache, loc, *, layout="NHD", k_scale=None, v_scale=None,
                   k_scale_cache=None, v_scale_cache=None, check=None, errors=None, loc_map=None,
                   dcp_rank=0, dcp_size=1, backend="auto", quant_rule="rne") -> None:
    """The int8 / dynamic-scale branch of `kvwrite.store_kv` (see the module doc)."""
    a = prepare_kv_store(OP, k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, k_scale_cache,
                         v_scale_cache, check, errors, loc_map, dcp_rank, dcp_size,
                         allowed=(QUANT_STATIC, QUANT_TOKEN, QUANT_HEAD), quant_rule=quant_rule)
    if torch.compiler.is_compiling():
        torch.ops.kvwrite.store_kv_quant(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale,
                                         k_scale_cache, v_scale_cache, check, a.check.errors,
                                         loc_map, dcp_rank, dcp_size, backend, quant_rule)
    elif a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)
