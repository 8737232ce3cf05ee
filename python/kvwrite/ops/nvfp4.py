"""`store_kv_nvfp4`: the fused paged K+V store of MHA/GQA in NVFP4 (e2m1 values, e4m3 block
scales per 16 elements, optional fp32 global scales). Format: `kvwrite.reference.nvfp4`."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry
from kvwrite.ops import kv, spec
from kvwrite.ops._common import Check, Locs, impls
from kvwrite.ops.kv import LAYOUTS, canonical

BLOCK = 16  # elements per e4m3 block scale
IMPLS = impls("nvfp4:store_kv_nvfp4", "store_kv_nvfp4:launch", "store_kv_nvfp4")


@dataclass(frozen=True)
class StoreKVNVFP4:
    """A validated store_kv_nvfp4 call: canonical [pages, pool_page_size, H, *] cache views."""

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


@spec.rule(expr=f"D % {BLOCK} == 0 && Dv % {BLOCK} == 0")
def _head_dims(env: dict, v: dict) -> None:
    for name, d in (("k", env["D"]), ("v", env["Dv"])):
        if d % BLOCK:
            raise ValueError(f"{name} head_dim must be a multiple of {BLOCK} for NVFP4 (one e4m3 scale "
                             f"per {BLOCK} elements), got {d}")


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> StoreKVNVFP4:
    caches = (canonical(v[n], env["layout"]) for n in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"))
    return StoreKVNVFP4(v["k"], v["v"], *caches, v["k_global_scale"], v["v_global_scale"], env["geometry"], locs, chk)


_DIMS = "num_pages, pool_page_size, H, "
SPEC = spec.Op(
    "store_kv_nvfp4",
    args=(*kv.SPEC.args[:2],   # store_kv's k and v
          spec.cache("k_cache", "P S H D/2", (torch.uint8,), binds="P S", layout=True, what=_DIMS + "D/2"),
          spec.cache("v_cache", "P S H Dv/2", (torch.uint8,), layout=True, what=_DIMS + "Dv/2"),
          spec.cache("k_scale_cache", f"P S H D/{BLOCK}", (torch.float8_e4m3fn,), layout=True,
                     what=_DIMS + f"D/{BLOCK}"),
          spec.cache("v_scale_cache", f"P S H Dv/{BLOCK}", (torch.float8_e4m3fn,), layout=True,
                     what=_DIMS + f"Dv/{BLOCK}"),
          spec.LOC, spec.opt("k_global_scale", "scale", role="scale"),
          spec.opt("v_global_scale", "scale", role="scale"), spec.option("layout"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND),
    checks=("k", "v", _head_dims, spec.choice("layout", LAYOUTS[:2]), "k_cache", "v_cache", "k_scale_cache",
            "v_scale_cache", spec.geometry("k_cache"), "k_global_scale", "v_global_scale"),
    build=_build, impls=IMPLS)


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
    return SPEC.entry(k, v, k_cache, v_cache, k_scale_cache, v_scale_cache, loc, k_global_scale,
                      v_global_scale, layout, check, errors, loc_map, dcp_rank, dcp_size, backend)
