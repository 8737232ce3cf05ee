"""Reference DeepSeek V4 FP4 KV records (`store_dsv4_kv_fp4`) and their decoder.

Byte layouts, uint8 `[num_pages, pool_page_size * token_bytes]`, no page padding:
  - "nvfp4", 384 bytes a token (FlashInfer `nvfp4_quantize_append_sparse_mla_cache`, SGLang's
    NVFP4 V4 pool, vLLM `nvfp4_fi_ds_mla`): page p holds its pool_page_size data rows of 352
    bytes (row o at o*352: 224 bytes of packed e2m1 for the 448 NoPE values, then the 64 RoPE
    values as bf16), then its scale rows of 32 bytes (row o at pool_page_size*352 + o*32: 28
    e4m3 block scales, one per 16 NoPE values, then 4 pad bytes, never written).
  - "nvfp4_v41", 288 bytes (DeepSeek-V4.1, vLLM PR #57344): data rows of 256 bytes (all 512
    values packed e2m1), then scale rows of 32 e4m3 bytes (one per 16 values, scale floored at
    2**-9).
  - "mxfp4", 368 bytes (SGLang `--kv-cache-dtype fp4_e2m1`): one row per token at o*368: 224
    bytes of packed e2m1 NoPE, 14 ue8m0 scales (one per 32 values) + 2 pad bytes, 128 bytes of
    bf16 RoPE.
Packed e2m1: element 2j in the low nibble of byte j. DCP shards whole pages, as the other V4 stores.

Encodings (`kvwrite.facts.FP4_RECORDS`):
  - "nvfp4" (384 bytes, FlashInfer / SGLang / vLLM `nvfp4_fi_ds_mla`): the 448 NoPE values in
    NVFP4 blocks of 16 (`kvwrite.reference.nvfp4`, global scale 1: e4m3 scale = e4m3(amax / 6),
    code = e2m1(x / scale)), the 64 RoPE values as bf16.
  - "nvfp4_v41" (288 bytes, DeepSeek-V4.1): all 512 values in NVFP4 blocks of 16 with the block
    scale floored: e4m3(max(amax / 6, 2**-9)) (FlashMLA's V41_FP4), no bf16 part.
  - "mxfp4" (368 bytes, SGLang `fp4_e2m1`): the 448 NoPE values in blocks of 32 with a ue8m0
    scale 2**n, n = round(log2(amax / 6)) (nearest; amax / 6 = 2**(n + 1/2) never ties), byte n +
    127 clamped to [0, 255]; code = e2m1(x / 2**n); the 64 RoPE values as bf16. Computed
    exactly from amax's bits: byte = exponent(amax) - 3 + (mantissa(amax) >= 3/4 * sqrt(2)).
Special values: the policy of the other quantised stores (README): fp32-subnormal inputs read as
+-0, the scale from the finite values, +-inf -> +-6, a NaN stores code 0 and makes its block's
scale NaN (e4m3 0x7F, ue8m0 0xFF); the RoPE part as `store_dsv4_kv`'s (bf16, NaN 0x7FC0).
"""
from __future__ import annotations

import torch

from kvwrite.facts import FP4_RECORDS, KV_DIM, FP4Record, fp4_pool_page_size
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.nvfp4 import dequant_nvfp4, e2m1_codes, e2m1_values, quantize_nvfp4
from kvwrite.reference.quant import bf16_bits, daz, finite_amax

MX_MANT_HALF = 0x7C3B7   # the smallest fp32 mantissa m (bits) with (1 + m / 2**23)**2 >= 9 / 8


def mx_scale_byte(amax: torch.Tensor) -> torch.Tensor:
    """ue8m0 byte (int32) of round(log2(amax / 6)) + 127, clamped to [0, 255], by amax's bits."""
    bits = amax.float().contiguous().view(torch.int32)
    byte = ((bits >> 23) & 0xFF) - 3 + ((bits & 0x7FFFFF) >= MX_MANT_HALF).to(torch.int32)
    return byte.clamp(0, 255)


def byte_value(byte: torch.Tensor) -> torch.Tensor:
    """fp32 2**(byte - 127) of ue8m0 bytes 0..254 (byte 0: the subnormal 2**-127)."""
    b = byte.to(torch.int32)
    return torch.where(b == 0, 0x00400000, b << 23).view(torch.float32)


def _quantize_mxfp4(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    n = x.shape[0]
    blocks = daz(x).reshape(n, -1, block)
    byte = mx_scale_byte(finite_amax(blocks))
    nan = torch.isnan(blocks)
    codes = torch.where(nan, 0, e2m1_codes(blocks / byte_value(byte)[..., None])).reshape(n, -1, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, torch.where(nan.any(-1), 0xFF, byte).to(torch.uint8)


def quantize_fp4(kv: torch.Tensor, rec: FP4Record) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(packed e2m1 uint8 `[N, quant/2]`, scale bytes uint8 `[N, blocks]`, rope bytes uint8
    `[N, 2 * rope]`) of `kv` `[N, 512]`."""
    x = kv[:, :rec.quant].float()
    if rec.scale == "ue8m0":
        packed, scales = _quantize_mxfp4(x, rec.block)
    else:
        floor = torch.tensor(rec.floor) if rec.floor else None
        packed, scales = quantize_nvfp4(x, floor=floor)
        scales = scales.view(torch.uint8)
    rope = bf16_bits(kv[:, rec.quant:]).contiguous().view(torch.uint8).reshape(kv.shape[0], 2 * rec.rope)
    return packed, scales, rope


def regions(cache: torch.Tensor, pps: int, rec: FP4Record) -> tuple[torch.Tensor, ...]:
    """Views `[pages, pps, bytes]` of a cache's packed values, scale slots and rope bytes."""
    pages = cache.shape[0]
    data = cache[:, :pps * rec.data_row].view(pages, pps, rec.data_row)
    q = rec.quant // 2
    if rec.inline:
        scales = data[..., q:q + rec.scale_row]
    else:
        scales = cache[:, pps * rec.data_row:pps * rec.token_bytes].view(pages, pps, rec.scale_row)
    return data[..., :q], scales, data[..., rec.rope_at:rec.rope_at + 2 * rec.rope]


def _write(a, kv: torch.Tensor, page: torch.Tensor, offset: torch.Tensor) -> None:
    """Store rows `kv` `[M, 512]` of the validated store `a` at (page, offset)."""
    rec = a.record
    packed, scales, rope = quantize_fp4(kv, rec)
    data, scale_slots, rope_slots = regions(a.cache, a.geometry.pool_page_size, rec)
    data[page, offset] = packed
    scale_slots[page, offset, :rec.blocks] = scales    # the pad bytes are never written
    if rec.rope:
        rope_slots[page, offset] = rope


def store_dsv4_kv_fp4(a) -> None:
    """`a`: kvwrite.ops.dsv4_fp4.StoreDSV4KVFP4."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if idx.numel():
        _write(a, a.kv[idx], page, offset)


def rope_store_dsv4_kv_fp4(a) -> None:
    """`a`: kvwrite.ops.dsv4_fp4.RopeStoreDSV4KVFP4: the RoPE part rotated as
    `kvwrite.reference.rope.rope` does (GPT-J pairs, one rounding to kv's dtype), q in place, then
    the rows stored as `store_dsv4_kv_fp4` stores them."""
    from kvwrite.reference import _locs
    from kvwrite.reference.rope import _rotate_q_in_place, resolve_with_positions, rope

    s = a.store
    r, ok = resolve_with_positions(a)
    _locs.check(r, s.geometry, s.check)
    idx = torch.nonzero(r.write).flatten()
    q0 = s.record.quant
    kv = s.kv[idx].clone()
    if idx.numel():
        kv[:, q0:] = rope(kv[:, None, q0:], a.positions[idx], a.cos_sin, a.rotary_dim, a.is_neox)[:, 0]
    if a.q is not None:
        _rotate_q_in_place(a, ok, None)
    if idx.numel():
        page, offset = s.geometry.locate(r.row[idx])
        _write(s, kv, page, offset)


def dequant_dsv4_kv_fp4(cache: torch.Tensor, loc: torch.Tensor, *, fmt: str = "nvfp4",
                        page_size: int | None = None) -> torch.Tensor:
    """float32 `[N, 512]`: the tokens at `loc` (into this cache, no loc map) of an FP4 record
    cache `fmt`: e2m1 value * block scale, RoPE from bf16; rows of loc -1 are zeros."""
    from kvwrite.reference.dsv4 import _read_locs

    if not isinstance(cache, torch.Tensor) or cache.dtype != torch.uint8 or cache.dim() != 2:
        raise TypeError("cache must be a 2-D uint8 DeepSeek V4 FP4 KV cache [num_pages, page bytes]")
    if fmt not in FP4_RECORDS:
        raise ValueError(f"fmt must be one of {tuple(FP4_RECORDS)}, got {fmt!r}")
    rec = FP4_RECORDS[fmt]
    pps = fp4_pool_page_size("cache", cache.shape[1], fmt, page_size)
    live, page, offset = _read_locs(cache, loc, pps)
    data, scale_slots, rope_slots = regions(cache, pps, rec)
    packed, scales = data[page, offset], scale_slots[page, offset, :rec.blocks]
    if rec.scale == "e4m3":
        nope = dequant_nvfp4(packed, scales.contiguous().view(torch.float8_e4m3fn))
    else:
        p = packed.to(torch.int32)
        codes = torch.stack((p & 0xF, p >> 4), -1).reshape(-1, rec.blocks, rec.block)
        s = torch.where(scales == 0xFF, float("nan"), byte_value(scales))
        nope = (e2m1_values(codes) * s[..., None]).reshape(-1, rec.quant)
    rope = rope_slots[page, offset]
    rope = rope.contiguous().view(torch.bfloat16).float() if rec.rope else rope.float()
    out = torch.cat([nope, rope], dim=-1)
    return torch.where(live[:, None], out, torch.zeros_like(out)).reshape(-1, KV_DIM)
