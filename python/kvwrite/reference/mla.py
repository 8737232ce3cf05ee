"""Reference MLA row store (concat, per-tensor fp8, DeepSeek fp8_ds_mla) and its reader."""
from __future__ import annotations

import torch

from kvwrite.facts import (DS_MLA_POW2, DS_MLA_POW2_FLOOR, DS_MLA_RAW_ROPE, DS_MLA_SCALE_FLOOR,
                           DS_MLA_TILE, MLA_FORMATS as FORMATS, MODE_DS_MLA, ds_mla_row_bytes)
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.indexer_k import ue8m0
from kvwrite.reference.quant import bf16_bits, finite_amax, quantize_fp8
from kvwrite.reference.nvfp4 import write_mla_nvfp4


def _concat(a, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    return torch.cat([kv_c, k_pe], dim=-1).to(a.kv_cache.dtype)


def _fp8(a, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
    return quantize_fp8(torch.cat([kv_c, k_pe], dim=-1), a.scale.float().reshape(()), a.kv_cache.dtype)


def ds_mla_rows(kv_c: torch.Tensor, k_pe: torch.Tensor, flags: int = 0) -> torch.Tensor:
    """uint8 fp8_ds_mla rows `[N, L + L/128*4 + 2R]` of `kv_c` `[N, L]` and `k_pe` `[N, R]`;
    `flags`: DS_MLA_POW2 (power-of-two tile scales), DS_MLA_RAW_ROPE (rope as its input bits)."""
    n, lora = kv_c.shape
    x = kv_c.float().reshape(n, lora // DS_MLA_TILE, DS_MLA_TILE)
    if flags & DS_MLA_POW2:
        scale = ue8m0(torch.clamp(finite_amax(x, keepdim=True) / 448.0, min=DS_MLA_POW2_FLOOR))
    else:
        scale = torch.clamp(finite_amax(x, keepdim=True) / 448.0, min=DS_MLA_SCALE_FLOOR)
    latent = quantize_fp8(x, scale, torch.float8_e4m3fn).view(torch.uint8).reshape(n, lora)
    scales = scale.reshape(n, -1).contiguous().view(torch.uint8)
    rope = (k_pe if flags & DS_MLA_RAW_ROPE else bf16_bits(k_pe)).contiguous().view(torch.uint8)
    return torch.cat([latent, scales, rope], dim=-1)


def _rows(make):
    """A writer storing `make(a, kv_c, k_pe)` as the tokens' kv_cache rows."""
    def write(a, idx, page, offset) -> None:
        a.kv_cache[page, offset] = make(a, a.kv_c[idx], a.k_pe[idx])
    return write


# kv_cache_dtype -> writer(a, token indices, pages, offsets); a format that also writes other
# buffers (block scales) registers its own writer here.
WRITERS = {"auto": _rows(_concat), "fp8_e4m3": _rows(_fp8), "fp8_e5m2": _rows(_fp8),
           "fp8_e4m3fnuz": _rows(_fp8), "nvfp4": write_mla_nvfp4,
           **{name: _rows(lambda a, kv_c, k_pe: ds_mla_rows(kv_c, k_pe, a.format.flags))
              for name in FORMATS if FORMATS[name].mode == MODE_DS_MLA}}


def store_mla(a) -> None:
    """`a`: kvwrite.ops.mla.StoreMLA."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if idx.numel():  # every token padding, out of range or another DCP rank's: nothing to write
        WRITERS[a.format.name](a, idx, page, offset)


def dequant_ds_mla(rows: torch.Tensor, kv_lora_rank: int = 512,
                   rope_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """float32 `[..., L + R]` (latent dequantised as e4m3 * tile scale, then the rope, read as
    `rope_dtype`: bf16, or fp16 for rows written from fp16 with ds_mla_rope="input") of uint8
    fp8_ds_mla rows `[..., L + L/128*4 + 2R]`."""
    if rope_dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"rope_dtype must be torch.bfloat16 or torch.float16, got {rope_dtype}")
    if not isinstance(rows, torch.Tensor) or rows.dtype != torch.uint8:
        raise TypeError(f"rows must be a uint8 tensor of fp8_ds_mla rows, got {getattr(rows, 'dtype', type(rows))}")
    lora, tiles = kv_lora_rank, kv_lora_rank // DS_MLA_TILE
    rope2 = rows.shape[-1] - lora - 4 * tiles
    if lora % DS_MLA_TILE or rope2 < 0 or rope2 % 2 or ds_mla_row_bytes(lora, rope2 // 2) != rows.shape[-1]:
        raise ValueError(f"rows of {rows.shape[-1]} bytes are not fp8_ds_mla rows with "
                         f"kv_lora_rank={kv_lora_rank}")
    lead = rows.shape[:-1]
    rows = rows.reshape(-1, rows.shape[-1]).contiguous()
    latent = rows[:, :lora].contiguous().view(torch.float8_e4m3fn).float()
    scale = rows[:, lora:lora + 4 * tiles].contiguous().view(torch.float32)
    latent = (latent.reshape(-1, tiles, DS_MLA_TILE) * scale[..., None]).reshape(-1, lora)
    rope = rows[:, lora + 4 * tiles:].contiguous().view(rope_dtype).float()
    return torch.cat([latent, rope], dim=-1).reshape(*lead, -1)
