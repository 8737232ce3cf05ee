"""The reference quantisers every quantising op shares, and with them the special-value policy
(README "Special values"; twins: `kernels/_common.py` daz / finite_abs / fp8_bits and
`csrc/kvwrite/fp8.h`, `quant.h`, `nvfp4.h`):

- inputs whose magnitude is an fp32 subnormal (< 2**-126, reachable from fp32 and bf16) are read
  as a zero of the same sign (`daz`);
- NaN -> the format's one NaN code, whatever its sign (e4m3fn / e5m2 0x7F, e4m3fnuz 0x80);
- +-inf and finite overflow saturate to +-max (448, 57344, 240);
- -0 (and a negative value that rounds to zero) -> -0, 0x80; e4m3fnuz has no -0: 0x00;
- block scales (DS-MLA tiles, indexer blocks, NVFP4 blocks) are computed from the finite values
  of the block only (`finite_amax`): NaN / +-inf elements then follow the rules above against
  that scale, and every other element is quantised as if they were not there.

Finite values are rounded by torch's own CPU/CUDA cast (round to nearest even after the clamp),
an implementation independent of the kernels' bit arithmetic; NaN is then set explicitly (the
cast would keep its sign).
"""
from __future__ import annotations

import torch

from kvwrite.validate import FP8_MAX

FLT_TINY = torch.finfo(torch.float32).tiny       # 2**-126
FP8_NAN = {torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F, torch.float8_e4m3fnuz: 0x80}


def daz(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` with fp32-subnormal magnitudes replaced by a zero of the same sign."""
    x = x.float()
    return torch.where(x.abs() < FLT_TINY, x * 0.0, x)


def finite_amax(x: torch.Tensor, dim: int = -1, keepdim: bool = False) -> torch.Tensor:
    """max |x| over the finite elements along `dim` (0 where there are none)."""
    a = x.float().abs()
    return torch.where(torch.isfinite(a), a, torch.zeros_like(a)).amax(dim=dim, keepdim=keepdim)


def fp8_codes(y: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The fp8 `dtype` tensor of saturate(y) (fp32 `y`, already divided by its scale)."""
    fmax = FP8_MAX[dtype]
    q = y.clamp(-fmax, fmax).to(dtype).view(torch.uint8)
    q = torch.where(torch.isnan(y), torch.full_like(q, FP8_NAN[dtype]), q)
    return q.view(dtype)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float, dtype: torch.dtype) -> torch.Tensor:
    """saturate(daz(x) / scale) in `dtype`: divide (not multiply by a reciprocal), clamp, round."""
    return fp8_codes(daz(x) / scale, dtype)


def bf16_bits(x: torch.Tensor) -> torch.Tensor:
    """`x` as bf16 (uint8 view of its bytes is the caller's): bf16 input unchanged (a copy, NaN
    payloads kept); fp32/fp16 rounded to nearest even, NaN -> 0x7FC0."""
    if x.dtype == torch.bfloat16:
        return x
    b = x.to(torch.bfloat16)
    nan = torch.full_like(b.view(torch.int16), 0x7FC0).view(torch.bfloat16)
    return torch.where(torch.isnan(x), nan, b)
