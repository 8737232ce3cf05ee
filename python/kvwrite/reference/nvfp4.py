"""Reference NVFP4 quantiser, its inverse, and the paged NVFP4 stores (MHA K+V, MLA rows).

NVFP4 (the format `kernels/_nvfp4.py` implements bit-exactly): a row is cut into blocks of
BLOCK = 16 consecutive elements. Per block, with an optional fp32 global scale `g` (1 if None):

    s  = amax(|x|) / 6 / g                  block scale, fp32 divisions
    sd = e4m3(saturate(s, 448))             stored byte (round to nearest even); its value
    d  = sd * g                             the block's decoded step (fp32)
    q  = e2m1(x / d)                        RNE to the nearest of 0, .5, 1, 1.5, 2, 3, 4, 6 (ties
                                            to the even code), saturating at 6; sign kept
                                            (a small negative value gives -0); d == 0: each
                                            element's sign alone (+-0)
    specials (README "Special values"): amax over the finite values; +-inf -> +-6; NaN -> code 0
    and the block's scale byte 0x7F (NaN: the whole block reads back NaN); fp32-subnormal
    inputs read as +-0
    byte j of the row = code[2j] | code[2j + 1] << 4   (even element in the low nibble)

Dequantised: x' = e2m1_value(q) * d.

Error bound. Wherever `s` lies in e4m3's normal range [2**-6, 448] (so that sd is within a
relative 2**-4 of s and amax <= 7 d), every element satisfies

    |x - x'| <= d * h(|x'| / d),   h(m) = 1/4 for m < 2, 1/2 for m < 4, 1 otherwise

(half the e2m1 spacing around the chosen value; 6 covers (5, 7] d), up to fp32 rounding of
x / d and of the product. Since sd <= s (1 + 2**-4), relative to the block's amax the error is at
most d / amax <= (1 + 2**-4) / 6 ≈ 0.1771 (measured: 0.1751 on 1M random blocks, with
`python bench/nvfp4_check.py --device cpu --tokens 16384`). Outside that range the
block scale saturates (s > 448: values clip at 6 d) or underflows into e4m3 subnormals (coarser
steps, larger relative error).
"""
from __future__ import annotations

import torch

from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.quant import daz, finite_amax, fp8_codes

BLOCK = 16
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
# Rounding boundaries between consecutive e2m1 magnitudes, and whether a tie goes up (to the
# even code): 0.25->0, 0.75->1, 1.25->1, 1.75->2, 2.5->2, 3.5->4, 5->4.
_BOUNDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True),
           (5.0, False))


def e2m1_codes(y: torch.Tensor) -> torch.Tensor:
    """4-bit e2m1 codes (int32) of fp32 `y`: RNE, ties to the even code, saturating at 6."""
    a = y.abs()
    code = torch.zeros_like(y, dtype=torch.int32)
    for bound, tie_up in _BOUNDS:
        code += (a >= bound if tie_up else a > bound).to(torch.int32)
    return code | (torch.signbit(y).to(torch.int32) << 3)


def e2m1_values(code: torch.Tensor) -> torch.Tensor:
    """fp32 values of 4-bit e2m1 codes."""
    mag = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=code.device)[(code & 7).long()]
    return torch.where((code & 8) != 0, -mag, mag)


def _global(global_scale: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    if global_scale is None:
        return torch.ones((), dtype=torch.float32, device=device)
    return global_scale.float().reshape(())


def quantize_nvfp4(x: torch.Tensor, global_scale: torch.Tensor | None = None,
                   floor: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] (D % 16 == 0) -> (packed uint8 [..., D/2], block scales e4m3 [..., D/16]).
    `floor`: s = max(amax / 6, floor) before the global scale (DeepSeek-V4.1's 2**-9)."""
    g = _global(global_scale, x.device)
    blocks = daz(x).reshape(*x.shape[:-1], x.shape[-1] // BLOCK, BLOCK)
    s = finite_amax(blocks) / 6
    if floor is not None:
        s = torch.maximum(s, floor.float().to(s.device))
    s = s / g
    scale = fp8_codes(s, torch.float8_e4m3fn)
    d = (scale.float() * g)[..., None]
    # d == 0 (all-zero block, or a global scale that underflows it): each element its sign alone;
    # NaN -> 0 (e2m1 has no NaN) and the block's scale becomes NaN.
    sign = torch.signbit(blocks).to(torch.int32) << 3
    codes = torch.where(d == 0, sign, e2m1_codes(blocks / torch.where(d == 0, 1.0, d)))
    nan = torch.isnan(blocks)
    codes = torch.where(nan, torch.zeros_like(codes), codes)
    scale = torch.where(nan.any(-1), torch.full_like(scale.view(torch.uint8), 0x7F),
                        scale.view(torch.uint8)).view(torch.float8_e4m3fn)
    codes = codes.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).to(torch.uint8)
    return packed, scale


def dequant_nvfp4(packed: torch.Tensor, scales: torch.Tensor,
                  global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Rows back from NVFP4: packed uint8 [..., D/2] and e4m3 scales [..., D/16] (e.g. cache
    rows `k_cache[page, offset]` and `k_scale_cache[page, offset]`) -> fp32 [..., D]."""
    if packed.dtype != torch.uint8 or scales.dtype != torch.float8_e4m3fn:
        raise TypeError(f"dequant_nvfp4 takes uint8 packed values and float8_e4m3fn scales, got "
                        f"{packed.dtype} and {scales.dtype}")
    if packed.shape[:-1] != scales.shape[:-1] or packed.shape[-1] * 2 != scales.shape[-1] * BLOCK:
        raise ValueError(f"packed [..., D/2] and scales [..., D/16] disagree: {list(packed.shape)} "
                         f"vs {list(scales.shape)}")
    p = packed.to(torch.int32)
    codes = torch.stack((p & 0xF, p >> 4), -1).reshape(*packed.shape[:-1], -1, BLOCK)
    d = scales.float() * _global(global_scale, packed.device)
    return (e2m1_values(codes) * d[..., None]).reshape(*packed.shape[:-1], -1)


def error_bound(x: torch.Tensor, deq: torch.Tensor, scales: torch.Tensor,
                global_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Per element bound d * h(|x'| / d) of the documented format error (see module doc)."""
    d = (scales.float() * _global(global_scale, x.device)).repeat_interleave(BLOCK, -1)
    m = torch.where(d > 0, deq.abs() / d, torch.zeros_like(d))
    h = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0))
    return d * h


def store_kv_nvfp4(a) -> None:
    """`a`: kvwrite.ops.nvfp4.StoreKVNVFP4 with canonical [pages, rows, H, ...] caches."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    for x, cache, scales, g in ((a.k, a.k_cache, a.k_scale_cache, a.k_global_scale),
                                (a.v, a.v_cache, a.v_scale_cache, a.v_global_scale)):
        packed, scale = quantize_nvfp4(x[idx], g)
        cache[page, offset] = packed
        scales[page, offset] = scale


def write_mla_nvfp4(a, idx: torch.Tensor, page: torch.Tensor, offset: torch.Tensor) -> None:
    """`kvwrite.reference.mla` writer of kv_cache_dtype "nvfp4": the row concat(kv_c, k_pe)
    quantised into `a.kv_cache` and its block scales into `a.scale_cache`."""
    packed, scale = quantize_nvfp4(torch.cat([a.kv_c[idx], a.k_pe[idx]], dim=-1), a.global_scale)
    a.kv_cache[page, offset] = packed
    a.scale_cache[page, offset] = scale
