"""`store_kv_head_major`: store_kv into vLLM's legacy head-major paged layout.

The caches (docs/formats.md) are views of store_kv's canonical cache with a split head dim
(`[pages, rows, H, D / X, X]`, X = x for the key, 1 for the value): store_kv's kernels run them.
"""
from __future__ import annotations

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs
from kvwrite.ops.kv import IMPLS, KVStore


@spec.rule(expr="x = 16 / itemsize($key_cache); D % x == 0 && size($key_cache, 2) == D / x && "
                "size($key_cache, 4) == x")
def _split_x(env: dict, v: dict) -> None:
    """The key cache's innermost dim is x = 16 bytes of its dtype, and D a multiple of it."""
    x, d = 16 // env["key_cache"].itemsize, env["D"]
    if d % x:
        raise ValueError(f"head_dim ({d}) must be a multiple of x = 16 // element size = {x}")
    validate.shape("key_cache", v["key_cache"], (env["P"], env["H"], d // x, env["S"], x),
                   f"num_blocks, H, head_dim / x, block_size, x = {x}")


@spec.rule(expr="fp8 = key_cache == float8_e4m3fn || key_cache == float8_e5m2 || key_cache == float8_e4m3fnuz; "
                "fp8 ? !none($k_scale) && !none($v_scale) : none($k_scale) && none($v_scale)")
def _scales(env: dict, v: dict) -> None:
    """fp8 caches take both scales; other caches none."""
    dtype = env["key_cache"]
    if dtype in validate.FP8_MAX:
        if v["k_scale"] is None or v["v_scale"] is None:
            raise ValueError(f"k_scale and v_scale are required for a {dtype} cache")
    elif v["k_scale"] is not None or v["v_scale"] is not None:
        raise ValueError(f"k_scale/v_scale apply only to fp8 caches; the caches are {dtype}")


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> KVStore:
    # `[pages, rows, H, D / x, x]` and `[pages, rows, H, D, 1]` views of the legacy caches
    kc, vc = v["key_cache"].permute(0, 3, 1, 2, 4), v["value_cache"].permute(0, 3, 1, 2).unsqueeze(-1)
    return KVStore(v["key"], v["value"], kc, vc, v["k_scale"], v["v_scale"], env["geometry"], locs, chk)


SPEC = spec.Op(
    "store_kv_head_major",
    args=(spec.T("key", "N H D", validate.FLOAT_INPUTS),
          spec.T("value", "N H D", ("=key",), what="tokens, heads, head_dim as key"),
          spec.cache("key_cache", "P H * S *", ("=key", *spec.FP8), binds="P S",
                     what="num_blocks, H, head_dim / x, block_size, x"),
          spec.cache("value_cache", "P H D S", ("=key_cache",), last_contiguous=False,
                     what="num_blocks, H, head_dim, block_size"),
          spec.LOC, spec.opt("k_scale", "scale H", role="scale"), spec.opt("v_scale", "scale H", role="scale"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND),
    checks=("key", "value", "key_cache", _split_x, "value_cache", spec.geometry("key_cache"), _scales,
            "k_scale", "v_scale"),
    build=_build, impls=IMPLS,
    raw_args={"k": "a:key", "v": "a:value", "k_cache": "h:key_cache", "v_cache": "h:value_cache"})


def store_kv_head_major(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, loc: torch.Tensor, *,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        check: str | None = None, errors: ErrorBuffer | None = None,
                        loc_map: torch.Tensor | None = None, dcp_rank: int = 0, dcp_size: int = 1,
                        backend: str = "auto") -> None:
    """`kvwrite.store_kv` into the legacy head-major caches (module doc): token i's K/V rows at
    `loc[i]` (-1 padding skipped; check modes, `loc_map`, DCP and page tables as store_kv). fp8
    caches take fp32 scales (`[]`, `[1]`, `[H]`): stored = saturate(x / scale)."""
    SPEC.entry(k, v, key_cache, value_cache, loc, k_scale, v_scale, check, errors, loc_map, dcp_rank,
               dcp_size, backend)
