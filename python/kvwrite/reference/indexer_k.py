"""Reference DSA indexer-K store and its reader.

Cache: uint8 `[num_pages, pool_page_size * (D + D/qbs * 4)]`, page-major. Page p holds
`pool_page_size * D` e4m3 bytes (token-major: row o at byte o*D), then `pool_page_size * D/qbs`
fp32 scales (row o's block b at byte pool_page_size*D + (o*D/qbs + b)*4). Each block of qbs
values has scale = max(amax, 1e-4) / 448 (`scale_fmt="ue8m0"`: rounded up to a power of two)
and is stored as fp8(x / scale).
"""
from __future__ import annotations

import torch

from kvwrite.facts import AMAX_FLOOR, indexer_k_pool_page_size as pool_page_size
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.quant import finite_amax, quantize_fp8


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """Round positive normal fp32 scales up to a power of two (exactly, on the exponent bits)."""
    bits = scale.float().contiguous().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def quantize_blocks(k: torch.Tensor, qbs: int, use_ue8m0: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes `[N, D]`, fp32 scales `[N, D/qbs]`) of `k` `[N, D]`."""
    n, d = k.shape
    x = k.float().reshape(n, d // qbs, qbs)
    scale = torch.clamp(finite_amax(x), min=AMAX_FLOOR) / 448.0
    if use_ue8m0:
        scale = ue8m0(scale)
    q = quantize_fp8(x, scale[..., None], torch.float8_e4m3fn).view(torch.uint8).reshape(n, d)
    return q, scale


def _regions(cache: torch.Tensor, pps: int, d: int, qbs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the cache: e4m3 `[pages, pps, D]` bytes and scale bytes `[pages, pps, D/qbs*4]`."""
    pages = cache.shape[0]
    data = cache[:, :pps * d].view(pages, pps, d)
    scales = cache[:, pps * d:].view(pages, pps, (d // qbs) * 4)
    return data, scales


def store_indexer_k(a) -> None:
    """`a`: kvwrite.ops.indexer_k.StoreIndexerK."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if not idx.numel():  # every token padding or out of range: nothing to write
        return
    d = a.k.shape[1]
    q, scale = quantize_blocks(a.k[idx], a.quant_block_size, a.ue8m0)
    data, scales = _regions(a.cache, a.geometry.pool_page_size, d, a.quant_block_size)
    data[page, offset] = q
    scales[page, offset] = scale.contiguous().view(torch.uint8)


def read_indexer_k(cache: torch.Tensor, loc: torch.Tensor, head_dim: int,
                   quant_block_size: int = 128) -> torch.Tensor:
    """float32 `[N, D]`: the dequantised keys (e4m3 * block scale) stored at `loc` (rows of
    `loc == -1` are zeros). No loc map: `loc` is the index into this cache."""
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 2:
        raise TypeError("cache must be a 2-D uint8 indexer cache [num_pages, page bytes]")
    qbs = quant_block_size
    pps = pool_page_size("cache", cache.shape[1], head_dim, qbs)
    data, scales = _regions(cache, pps, head_dim, qbs)
    loc = loc.to(torch.int64)
    live = loc != -1
    if bool(((loc < -1) | (loc >= cache.shape[0] * pps)).any()):
        raise IndexError(f"loc outside the cache's {cache.shape[0] * pps} rows")
    page, offset = torch.div(loc.clamp(min=0), pps, rounding_mode="floor"), loc.clamp(min=0) % pps
    x = data[page, offset].view(torch.float8_e4m3fn).float().reshape(-1, head_dim // qbs, qbs)
    s = scales[page, offset].contiguous().view(torch.float32)
    out = (x * s[..., None]).reshape(-1, head_dim)
    return torch.where(live[:, None], out, torch.zeros_like(out))
