"""`store_kv_head_major`: store_kv into vLLM's legacy head-major paged layout.

key_cache `[num_pages, H, D / x, page_size, x]` (x = 16 bytes / cache element size: one 16-byte
vector of a head's features per token), value_cache `[num_pages, H, D, page_size]`. Both are
the canonical store_kv cache `[pages, rows, H, D]` with a split head-dim stride: feature d at
`(d // X) * stride_x + d % X`, viewed as `[pages, rows, H, D / X, X]` (X = x for the key, 1 for
the value). Every backend's store_kv kernel takes that view (Triton KX/VX, csrc
`PagedCache::split`, the torch reference by indexing), so this is the same kernel as store_kv.
"""
from __future__ import annotations

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.ops._common import cache_geometry, dispatch, prepare
from kvwrite.ops.kv import IMPLS, OP, StoreKV


def split_x(dtype: torch.dtype) -> int:
    """Elements of the key cache's innermost dim: 16 bytes of `dtype`."""
    return 16 // torch.empty((), dtype=dtype).element_size()


def canonical_head_major(key_cache: torch.Tensor, value_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[pages, rows, H, D / x, x]` and `[pages, rows, H, D, 1]` views of the legacy caches."""
    return key_cache.permute(0, 3, 1, 2, 4), value_cache.permute(0, 3, 1, 2).unsqueeze(-1)


def prepare_store_kv_head_major(k, v, key_cache, value_cache, loc, k_scale, v_scale, check,
                                errors) -> StoreKV:
    k = validate.tensor("key", k, ndim=3, dtypes=validate.FLOAT_INPUTS)
    n, h, d = k.shape
    device = k.device
    v = validate.tensor("value", v, ndim=3, dtypes=(k.dtype,), device=device)
    validate.shape("value", v, (n, h, d), "tokens, heads, head_dim as key")
    cache_dtypes = (k.dtype, *validate.FP8_MAX)
    key_cache = validate.tensor("key_cache", key_cache, ndim=5, dtypes=cache_dtypes, device=device)
    value_cache = validate.tensor("value_cache", value_cache, ndim=4, dtypes=(key_cache.dtype,),
                                  device=device, last_contiguous=False)
    x = split_x(key_cache.dtype)
    if d % x:
        raise ValueError(f"head_dim ({d}) must be a multiple of x = 16 // element size = {x}")
    pages, page_size = key_cache.shape[0], key_cache.shape[3]
    validate.shape("key_cache", key_cache, (pages, h, d // x, page_size, x),
                   f"num_blocks, H, head_dim / x, block_size, x = {x}")
    validate.shape("value_cache", value_cache, (pages, h, d, page_size), "num_blocks, H, head_dim, block_size")
    geometry = cache_geometry("key_cache", pages, page_size)
    if key_cache.dtype in validate.FP8_MAX:
        if k_scale is None or v_scale is None:
            raise ValueError(f"k_scale and v_scale are required for a {key_cache.dtype} cache")
        k_scale = validate.scale("k_scale", k_scale, h, device)
        v_scale = validate.scale("v_scale", v_scale, h, device)
    elif k_scale is not None or v_scale is not None:
        raise ValueError(f"k_scale/v_scale apply only to fp8 caches; the caches are {key_cache.dtype}")
    locs, chk = prepare(OP, device, n, loc, None, 0, 1, check, errors)
    kc, vc = canonical_head_major(key_cache, value_cache)
    return StoreKV(k, v, kc, vc, k_scale, v_scale, geometry, locs, chk)


def store_kv_head_major(k: torch.Tensor, v: torch.Tensor, key_cache: torch.Tensor,
                        value_cache: torch.Tensor, loc: torch.Tensor, *,
                        k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                        check: str | None = None, errors: ErrorBuffer | None = None,
                        backend: str = "auto") -> None:
    """`kvwrite.store_kv` into the legacy head-major caches (module doc): token i's K/V rows at
    `loc[i]` (-1 padding skipped; check modes as store_kv). fp8 caches take fp32 scales
    (`[]`, `[1]`, `[H]`): stored = saturate(x / scale). No loc_map / DCP / page table: vLLM's
    legacy layout has none (they would be one more argument to `prepare`)."""
    a = prepare_store_kv_head_major(k, v, key_cache, value_cache, loc, k_scale, v_scale, check, errors)
    if a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)
