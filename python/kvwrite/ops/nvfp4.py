"""`store_kv_nvfp4`: the fused paged K+V store of MHA/GQA in NVFP4 (e2m1 values, e4m3 block
scales per 16 elements, optional fp32 global scales). Format: `kvwrite.reference.nvfp4`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import _ext, validate
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.ops import _library
from kvwrite.ops._common import NATIVE, Check, Locs, cache_geometry, dispatch, prepare, record
from kvwrite.ops.kv import LAYOUTS, canonical

OP = "store_kv_nvfp4"
BLOCK = 16  # elements per e4m3 block scale
IMPLS = (
    ("torch", "kvwrite.reference.nvfp4:store_kv_nvfp4"),
    ("triton", "kvwrite.kernels.store_kv_nvfp4:launch"),
    ("cpu", "kvwrite._ext:store_kv_nvfp4"),
    ("cuda", "kvwrite._ext:store_kv_nvfp4"),
)


@dataclass(frozen=True)
class StoreKVNVFP4:
    """A validated store_kv_nvfp4 call. Caches are canonical [pages, pool_page_size, H, *]
    views (HND caches are permuted views): values uint8 [.., D/2], scales e4m3 [.., D/16]."""

    k: torch.Tensor
    v: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k_scale_cache: torch.Tensor
    v_scale_cache: torch.Tensor
    k_global_scale: torch.Tensor | None
    v_global_scale: torch.Tensor | None
    geometry: PageGeometry
    locs: Locs
    check: Check


def head_dim(name: str, d: int) -> None:
    if d % BLOCK:
        raise ValueError(f"{name} head_dim must be a multiple of {BLOCK} for NVFP4 (one e4m3 scale "
                         f"per {BLOCK} elements), got {d}")


def global_scale(name: str, t: object, device: torch.device) -> torch.Tensor | None:
    """An optional fp32 global scale `[]` or `[1]` (positive; not checked: no host sync)."""
    return None if t is None else validate.scale(name, t, None, device)


def prepare_store_kv_nvfp4(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc,
                           k_global_scale, v_global_scale, layout, check, errors, loc_map,
                           dcp_rank, dcp_size) -> StoreKVNVFP4:
    k = validate.tensor("k", k, ndim=3, dtypes=validate.FLOAT_INPUTS)
    n, h, dk = k.shape
    device = k.device
    v = validate.tensor("v", v, ndim=3, dtypes=(k.dtype,), device=device)
    validate.shape("v", v, (n, h, None), "tokens, heads as k, head_dim_v")
    dv = v.shape[2]
    head_dim("k", dk)
    head_dim("v", dv)
    layout = validate.choice("layout", layout, LAYOUTS[:2])  # NHD, HND (no cpu_attn)
    dims = "num_pages, pool_page_size, H, " if layout == "NHD" else "num_pages, H, pool_page_size, "
    caches = {}
    first = None
    for name, c, dtype, width, what in (
            ("k_cache", k_cache, torch.uint8, dk // 2, "D/2"),
            ("v_cache", v_cache, torch.uint8, dv // 2, "Dv/2"),
            ("k_scale_cache", k_scale_cache, torch.float8_e4m3fn, dk // BLOCK, f"D/{BLOCK}"),
            ("v_scale_cache", v_scale_cache, torch.float8_e4m3fn, dv // BLOCK, f"Dv/{BLOCK}")):
        c = validate.tensor(name, c, ndim=4, dtypes=(dtype,), device=device)
        if first is None:
            first = canonical(c, layout).shape[:2]
        pages, pps = first
        expect = (pages, pps, h, width) if layout == "NHD" else (pages, h, pps, width)
        validate.shape(name, c, expect, f"{layout}: {dims}{what}")
        caches[name] = canonical(c, layout)
    geometry = cache_geometry("k_cache", *first)
    kg = global_scale("k_global_scale", k_global_scale, device)
    vg = global_scale("v_global_scale", v_global_scale, device)
    locs, chk = prepare(OP, device, n, loc, loc_map, dcp_rank, dcp_size, check, errors)
    return StoreKVNVFP4(k, v, caches["k_cache"], caches["v_cache"], caches["k_scale_cache"],
                        caches["v_scale_cache"], kg, vg, geometry, locs, chk)


def _store_kv_nvfp4_py(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, k_global_scale,
                       v_global_scale, layout, check, errors, loc_map, dcp_rank, dcp_size,
                       backend) -> None:
    """The Python implementation of torch.ops.kvwrite.store_kv_nvfp4 (see ops._library)."""
    a = prepare_store_kv_nvfp4(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc,
                               k_global_scale, v_global_scale, layout, check, errors, loc_map,
                               dcp_rank, dcp_size)
    if a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)


def _fake(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, k_global_scale,
          v_global_scale, layout, check, errors, loc_map, dcp_rank, dcp_size, backend) -> None:
    """Validation only: the same errors while tracing and for meta tensors."""
    prepare_store_kv_nvfp4(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, k_global_scale,
                           v_global_scale, layout, _library.fake_check(check, errors), errors, loc_map,
                           dcp_rank, dcp_size)


_OP = _library.define(
    OP, "(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor(c!) k_scale_cache, "
        "Tensor(d!) v_scale_cache, Tensor loc, Tensor? k_global_scale, Tensor? v_global_scale, "
        "str layout, str check, Tensor(e!)? errors, Tensor? loc_map, int dcp_rank, int dcp_size, "
        "str backend) -> ()", _store_kv_nvfp4_py, _fake)
_CALL = _OP._op


def store_kv_nvfp4(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   k_scale_cache: torch.Tensor, v_scale_cache: torch.Tensor, loc: torch.Tensor, *,
                   k_global_scale: torch.Tensor | None = None,
                   v_global_scale: torch.Tensor | None = None, layout: str = "NHD",
                   check: str | None = None, errors: ErrorBuffer | None = None,
                   loc_map: torch.Tensor | None = None, dcp_rank: int = 0, dcp_size: int = 1,
                   backend: str = "auto") -> None:
    """Quantise token i's K/V rows to NVFP4 and write them to the paged caches at `loc[i]`
    (-1 = padding, skipped).

    `k`/`v`: [N, H, D] / [N, H, Dv] fp32/fp16/bf16, D and Dv multiples of 16.
    `k_cache`/`v_cache`: uint8 [pages, pool_page_size, H, D/2] (two e2m1 codes a byte, even
    element in the low nibble); `k_scale_cache`/`v_scale_cache`: float8_e4m3fn
    [pages, pool_page_size, H, D/16] (one block scale per 16 consecutive elements of a head).
    `layout="HND"`: the same four caches as [pages, H, pool_page_size, *].
    `k_global_scale`/`v_global_scale`: optional positive fp32 `[]`/`[1]` (None = 1): block scale
    = e4m3(amax / 6 / global), values = e2m1(x / (block scale * global)). Read rows back with
    `kvwrite.dequant_nvfp4`; the error bound is documented in `kvwrite.reference.nvfp4`.
    `check`, `errors`, `loc_map`, `dcp_rank`, `dcp_size`: as `kvwrite.store_kv`.
    """
    if (_ext.LOADED and backend in NATIVE and type(dcp_rank) is int and type(dcp_size) is int
            and isinstance(loc, torch.Tensor) and not torch.compiler.is_compiling()):
        mode = validate.DEFAULT_CHECK if check is None else check
        try:  # the C++ op: validation (same errors) + kernel
            return _CALL(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc,
                         k_global_scale, v_global_scale, layout, mode, record(errors, mode, k),
                         loc_map, dcp_rank, dcp_size, backend)
        except Exception:  # arguments the schema refused: Python's error names them
            prepare_store_kv_nvfp4(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc,
                                   k_global_scale, v_global_scale, layout, check, errors, loc_map,
                                   dcp_rank, dcp_size)
            raise
    a = prepare_store_kv_nvfp4(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc,
                               k_global_scale, v_global_scale, layout, check, errors, loc_map,
                               dcp_rank, dcp_size)
    if torch.compiler.is_compiling():
        torch.ops.kvwrite.store_kv_nvfp4(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc,
                                         k_global_scale, v_global_scale, layout, a.check.mode,
                                         a.check.errors, loc_map, dcp_rank, dcp_size, backend)
    elif a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)
