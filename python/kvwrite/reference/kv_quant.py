"""Reference int8 / fp8 K/V stores with static or dynamic (per-token, per-token-head) scales, and
`dequant_kv`, their reader. The formulas are on `kvwrite.ops.kv_quant`."""
from __future__ import annotations

import torch

from kvwrite.ops import kv_quant as _q
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.kv import quantize_fp8

_FLOOR = torch.tensor(_q.SCALE_FLOOR, dtype=torch.float32)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """RNE(x / scale) saturated to [-128, 127] (fp32 division; NaN -> 0)."""
    y = x.float() / scale
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    return y.clamp(-128.0, 127.0).round().to(torch.int8)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """int8 or fp8 codes of x / scale (fp8 through the shared `quantize_fp8`)."""
    return quantize_int8(x, scale) if dtype == torch.int8 else quantize_fp8(x, scale, dtype)


def dynamic_scale(x: torch.Tensor, dtype: torch.dtype, per_head: bool) -> torch.Tensor:
    """max(amax(|x|) / QMAX, 1e-6) of rows x [M, H, D]: [M, H] per head, else [M, 1]."""
    a = x.float().abs()
    amax = a.amax(-1) if per_head else a.amax(dim=(-2, -1)).unsqueeze(-1)
    return torch.maximum(amax / _q.QMAX[dtype], _FLOOR.to(x.device))


def write_rows(x: torch.Tensor, cache: torch.Tensor, quant: int, scale: torch.Tensor | None,
               scale_cache: torch.Tensor | None, page: torch.Tensor, offset: torch.Tensor) -> None:
    """Store rows x [M, H, D] (already the tokens to write) at (page, offset) in `quant` mode."""
    if quant == _q.QUANT_COPY:
        cache[page, offset] = x.to(cache.dtype)
    elif quant == _q.QUANT_STATIC:
        s = scale.float().reshape(-1)[None, :, None] if scale.dim() else scale.float()
        cache[page, offset] = quantize(x, s, cache.dtype)
    else:
        s = dynamic_scale(x, cache.dtype, quant == _q.QUANT_HEAD)  # [M, 1 or H]
        cache[page, offset] = quantize(x, s[..., None], cache.dtype)
        scale_cache[page, offset] = s


def store_kv_quant(a) -> None:
    """`a`: kvwrite.ops.kv_quant.KVStore."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if idx.numel():
        write_rows(a.k[idx], a.k_cache, a.quant, a.k_scale, a.k_scale_cache, page, offset)
        write_rows(a.v[idx], a.v_cache, a.quant, a.v_scale, a.v_scale_cache, page, offset)


def dequant_kv(k_cache: torch.Tensor, loc: torch.Tensor, *, scale: torch.Tensor | None = None,
               scale_cache: torch.Tensor | None = None, layout: str = "NHD") -> torch.Tensor:
    """The rows at `loc` (int32/int64 [N], in [0, capacity)) of a paged K or V cache as fp32
    `[N, H, D]`: code * scale for int8/fp8 caches with a static `scale` ([], [1] or [H]) or a
    dynamic `scale_cache` ([pages, pool_page_size] or [pages, pool_page_size, H]); plain caches
    (and fp8 without a scale) are converted as they are."""
    from kvwrite import validate

    k_cache = validate.tensor("k_cache", k_cache, ndim=4, last_contiguous=False)
    layout = validate.choice("layout", layout, _q.LAYOUTS)
    kc = _q.canonical(k_cache, layout)
    num_pages, pps, h = kc.shape[0], kc.shape[1], kc.shape[2]
    loc = validate.tensor("loc", loc, ndim=1, dtypes=validate.LOC_DTYPES, device=k_cache.device).long()
    if loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= num_pages * pps):
        raise ValueError(f"loc must lie in [0, {num_pages * pps}) (the cache's capacity)")
    if scale is not None and scale_cache is not None:
        raise ValueError("pass scale (static) or scale_cache (dynamic), not both")
    if k_cache.dtype == torch.int8 and scale is None and scale_cache is None:
        raise ValueError("an int8 cache needs scale or scale_cache")
    page, offset = loc // pps, loc % pps
    rows = kc[page, offset].float()
    if scale is not None:
        scale = validate.scale("scale", scale, h, k_cache.device)
        rows = rows * (scale.float().reshape(-1)[None, :, None] if scale.dim() else scale.float())
    elif scale_cache is not None:
        sc = _q._scale_cache("scale_cache", scale_cache, num_pages, pps, h, k_cache.device)
        rows = rows * sc[page, offset][..., None]
    return rows
