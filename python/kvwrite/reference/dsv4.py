"""Reference DeepSeek V4 stores (KV pages, MXFP4 indexer rows, state rows) and their readers.

KV pages (SWA, c4 and c128 caches alike), uint8 `[num_pages, kv_page_bytes(pool_page_size)]`.
Page p holds its pool_page_size *data rows* of 576 bytes first (row o at byte o*576: 448 NoPE
values in e4m3, then 64 RoPE values in bf16), then its pool_page_size *scale rows* of 8 bytes
(row o at byte pool_page_size*576 + o*8: 7 ue8m0 bytes, one per 64 NoPE values, and 1 pad byte),
then padding up to a multiple of 576 bytes. The pad scale byte and the page padding are never
written. Per 64-value tile: scale = max(amax, 1e-4) / 448 rounded up to a power of two (ue8m0:
the fp32 exponent, +1 when the mantissa is non-zero), value = saturate(x / scale) in e4m3, the
stored byte is the scale's biased exponent. RoPE is cast to bf16 (nearest even).

Indexer cache (c4 layers), uint8 `[num_pages, pool_page_size * indexer_row_bytes(D, fmt)]`,
page-major like `kvwrite.store_indexer_k`:
  - "fp8": D e4m3 bytes per row for the whole page, then one fp32 scale per 128 values and row;
    scale = max(amax, 1e-4) / 448 stored as it is (SGLang), `scale_fmt="ue8m0"` rounds it up to
    a power of two (vLLM). 132 bytes a row for D = 128.
  - "mxfp4": D/2 bytes of packed e2m1 per row for the whole page (even element in the low
    nibble), then D/32 ue8m0 bytes per row; per 32 values scale = max(amax, 1e-4) / 6 rounded up
    to a power of two, value = e2m1(x / scale) (nearest, ties to the even code). 68 bytes a row
    for D = 128.

DCP: these stores shard by page (SGLang's sharded V4 pools): virtual page p = loc //
pool_page_size lives on rank p % dcp_size as local page p // dcp_size (the resolver's page mode,
`Locs.dcp_page`); other ranks' tokens are skipped.

Error bounds of the readers, for an input x of a tile whose scale is s (a power of two,
s >= max(amax, 1e-4) / 448, s < 2 * max(amax, 1e-4) / 448):
  - KV NoPE (e4m3, 3 mantissa bits): |x - x'| <= max(|x| * 2**-4, s * 2**-10) (half an ulp at
    x's binade; e4m3 subnormal step 2**-9 s). Since x / s <= 448 no value saturates.
  - KV RoPE (bf16): |x - x'| <= |x| * 2**-8.
  - MXFP4 indexer (e2m1): s >= max(amax, 1e-4) / 6 so |x / s| <= 6: |x - x'| <= s * h(|x'|/s),
    h = 1/4 below 2, 1/2 below 4, 1 otherwise (half the e2m1 spacing).
"""
from __future__ import annotations

import torch

from kvwrite.facts import (AMAX_FLOOR, DATA_ROW, KV_DIM, MXFP4_BLOCK, NOPE, SCALE_ROW, TILE, V41_FP8_GROUP,
                              TILES, indexer_pool_page_size, kv_pool_page_size)
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.indexer_k import read_indexer_k, ue8m0
from kvwrite.reference.quant import bf16_bits, daz, finite_amax, quantize_fp8
from kvwrite.reference.nvfp4 import e2m1_codes, e2m1_values


def _exponent_byte(scale: torch.Tensor) -> torch.Tensor:
    """The ue8m0 byte (biased fp32 exponent) of power-of-two fp32 scales."""
    return ((scale.float().contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _byte_scale(byte: torch.Tensor) -> torch.Tensor:
    """fp32 power of two of ue8m0 bytes (1..254)."""
    return (byte.to(torch.int32) << 23).view(torch.float32)


def quantize_kv(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(data rows uint8 `[N, 576]`, scale bytes uint8 `[N, 7]`) of `kv` `[N, 512]`."""
    n = kv.shape[0]
    x = kv[:, :NOPE].float().reshape(n, TILES, TILE)
    scale = ue8m0(torch.clamp(finite_amax(x), min=AMAX_FLOOR) / 448.0)   # special values: README
    nope = quantize_fp8(x, scale[..., None], torch.float8_e4m3fn).view(torch.uint8).reshape(n, NOPE)
    rope = bf16_bits(kv[:, NOPE:]).contiguous().view(torch.uint8)
    return torch.cat([nope, rope], dim=-1), _exponent_byte(scale)


def page_regions(cache: torch.Tensor, pps: int, data: int, scale: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a page-split cache: each page's `pps` data rows of `data` bytes `[pages, pps, data]`,
    then its `pps` scale rows of `scale` bytes `[pages, pps, scale]` (any page padding after)."""
    pages = cache.shape[0]
    return (cache[:, :pps * data].view(pages, pps, data),
            cache[:, pps * data:pps * (data + scale)].view(pages, pps, scale))


def quantize_v41_fp8(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 bytes `[N, 512]`, ue8m0 bytes `[N, 16]`) of DeepSeek-V4.1's fp8 record: one scale per
    32 values, 2^ceil(log2(max(amax / 448, 1e-4))) (the floor after the division, unlike the V4
    record's); special values as the other quantised stores (finite amax, NaN -> 0x7F)."""
    n = kv.shape[0]
    x = kv.float().reshape(n, KV_DIM // V41_FP8_GROUP, V41_FP8_GROUP)
    scale = ue8m0(torch.clamp(finite_amax(x) / 448.0, min=AMAX_FLOOR))
    data = quantize_fp8(x, scale[..., None], torch.float8_e4m3fn).view(torch.uint8).reshape(n, KV_DIM)
    return data, _exponent_byte(scale)


def kv_regions(cache: torch.Tensor, pps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of a KV cache: data rows `[pages, pps, 576]`, scale rows `[pages, pps, 8]`."""
    return page_regions(cache, pps, DATA_ROW, SCALE_ROW)


def _store(a, x: torch.Tensor, quantize, data: int, scale: int) -> None:
    """Quantise the rows of `x` that `a` writes and put them (and their scales) at their locs."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if not idx.numel():
        return
    rows, scales = quantize(x[idx])
    data_rows, scale_rows = page_regions(a.cache, a.geometry.pool_page_size, data, scale)
    data_rows[page, offset] = rows
    scale_rows[page, offset, :scales.shape[-1]] = scales   # a pad byte is never written


def store_dsv4_kv(a) -> None:
    """`a`: kvwrite.ops.dsv4.StoreDSV4KV."""
    _store(a, a.kv, quantize_kv, DATA_ROW, SCALE_ROW)


def _read_locs(cache: torch.Tensor, loc: torch.Tensor, pps: int) -> tuple[torch.Tensor, ...]:
    if not isinstance(loc, torch.Tensor) or loc.dim() != 1:
        raise TypeError("loc must be a 1-D integer tensor")
    loc = loc.to(torch.int64)
    capacity = cache.shape[0] * pps
    if bool(((loc < -1) | (loc >= capacity)).any()):
        raise IndexError(f"loc outside the cache's {capacity} rows")
    live = loc != -1
    safe = loc.clamp(min=0)
    return live, torch.div(safe, pps, rounding_mode="floor"), safe % pps


def dequant_dsv4_kv(cache: torch.Tensor, loc: torch.Tensor, *, page_size: int | None = None) -> torch.Tensor:
    """float32 `[N, 512]`: the tokens at `loc` (into this cache, no loc map), NoPE as e4m3 *
    2**(scale byte - 127), RoPE from bf16; rows of loc -1 are zeros."""
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 2:
        raise TypeError("cache must be a 2-D uint8 DeepSeek V4 KV cache [num_pages, page bytes]")
    pps = kv_pool_page_size("cache", cache.shape[1], page_size)
    live, page, offset = _read_locs(cache, loc, pps)
    data, scales = kv_regions(cache, pps)
    rows = data[page, offset]
    nope = rows[:, :NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, TILES, TILE)
    s = _byte_scale(scales[page, offset, :TILES])
    rope = rows[:, NOPE:].contiguous().view(torch.bfloat16).float()
    out = torch.cat([(nope * s[..., None]).reshape(-1, NOPE), rope], dim=-1)
    return torch.where(live[:, None], out, torch.zeros_like(out)).reshape(-1, KV_DIM)


def quantize_mxfp4(k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed e2m1 uint8 `[N, D/2]`, ue8m0 bytes `[N, D/32]`) of `k` `[N, D]`."""
    n, d = k.shape
    x = daz(k).reshape(n, d // MXFP4_BLOCK, MXFP4_BLOCK)
    scale = ue8m0(torch.clamp(finite_amax(x), min=AMAX_FLOOR) / 6.0)
    nan = torch.isnan(x)   # special values (README): NaN -> code 0, the block's scale byte 0xFF
    codes = torch.where(nan, 0, e2m1_codes(x / scale[..., None])).reshape(n, d // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    byte = torch.where(nan.any(-1), torch.full_like(scale, 0xFF, dtype=torch.uint8), _exponent_byte(scale))
    return packed, byte


def mxfp4_regions(cache: torch.Tensor, pps: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    return page_regions(cache, pps, d // 2, d // MXFP4_BLOCK)


def store_dsv4_indexer_k(a) -> None:
    """`a`: kvwrite.ops.dsv4.StoreDSV4IndexerK with fmt "mxfp4" (fp8 runs reference.indexer_k)."""
    d = a.k.shape[1]
    _store(a, a.k, quantize_mxfp4, d // 2, d // MXFP4_BLOCK)


def read_dsv4_indexer_k(cache: torch.Tensor, loc: torch.Tensor, *, head_dim: int = 128,
                        page_size: int | None = None, fmt: str = "fp8") -> torch.Tensor:
    """float32 `[N, D]`: the indexer keys stored at `loc` (a c4 loc into this cache); rows of
    loc -1 are zeros."""
    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 2:
        raise TypeError("cache must be a 2-D uint8 indexer cache [num_pages, page bytes]")
    if fmt not in ("fp8", "mxfp4"):
        raise ValueError(f"fmt must be 'fp8' or 'mxfp4', got {fmt!r}")
    pps = indexer_pool_page_size("cache", cache.shape[1], head_dim, fmt, page_size)
    if fmt == "fp8":
        return read_indexer_k(cache, loc, head_dim, 128)
    live, page, offset = _read_locs(cache, loc, pps)
    data, scales = mxfp4_regions(cache, pps, head_dim)
    p = data[page, offset].to(torch.int32)
    codes = torch.stack((p & 0xF, p >> 4), -1).reshape(-1, head_dim // MXFP4_BLOCK, MXFP4_BLOCK)
    out = (e2m1_values(codes) * _byte_scale(scales[page, offset])[..., None]).reshape(-1, head_dim)
    return torch.where(live[:, None], out, torch.zeros_like(out))


def store_rows(a) -> None:
    """`a`: kvwrite.ops.dsv4.StoreRows (pages of one row: page == row)."""
    idx, page, _ = resolve_and_check(a.locs, a.geometry, a.check)
    if idx.numel():
        a.pool[page] = a.src[idx]
