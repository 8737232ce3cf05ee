"""Reference int4 K/V store (store_kv's QUANT_INT4 format, vLLM's INT4_PER_TOKEN_HEAD) and
`dequant_kv_int4`, its reader. The torch oracle of `kernels/store_kv_int4.py` and
`csrc/kvwrite/kv_int4.h`.

Format (read from vLLM 0.32's `vllm/v1/attention/ops/int4_per_token_head.py`, write path):
caches uint8 `[pages, pool_page_size, H, D / 2]`, scale caches fp32 `[pages, pool_page_size, H]`.
Per token and head, over the D input values x (fp32 of the input dtype, fp32-subnormals read as
zero: the quantisers' `daz`):
  1. rotate: b = the largest power of two dividing D; each of the D / b blocks of x becomes
     H_b (s * x), s the +-1 signs of `kvwrite.facts.int4_rht_signs` (torch CPU generator, seed
     0x9E3779B9), H_b the unnormalised Walsh-Hadamard matrix (H_b H_b = b I), computed in fp32
     as the radix-2 butterfly (stage h = 1, 2, .., b/2: (u, w) -> (u + w, u - w) for elements
     j and j + h of each 2h-run), then rounded to the input dtype (RNE; fp16 may overflow to inf);
  2. range: mn, mx = min, max of the finite rotated values (none finite: both 0);
     scale = max((mx - mn) / 15, 1e-6); zp = trunc(clamp(-mn / scale, 0, 15) + 0.5);
  3. codes: q = trunc(clamp(y * RN(1 / scale) + zp, 0, 15) + 0.5) (every step an fp32 op,
     rounded, never fused); a NaN y -> zp (reads back as 0), +-inf -> 15 / 0 (saturated);
  4. pack: byte j = q[2j] | q[2j + 1] << 4; stored scale = the fp32 whose bits are
     (bits(scale) & ~0xF) | zp (the zero point in the low 4 mantissa bits).
Decode: scale' = bits & ~0xF, zp = bits & 0xF, y = (q - zp) * scale', x = (H_b y) * s / b.
"""
from __future__ import annotations

import torch

from kvwrite import facts as _q
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.quant import daz


def _butterfly(x: torch.Tensor) -> torch.Tensor:
    """H_b x along the last dim (b = x.shape[-1], a power of two), fp32, the radix-2 order."""
    b = x.shape[-1]
    h = 1
    while h < b:
        xv = x.reshape(*x.shape[:-1], b // (2 * h), 2, h)
        u, w = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([u + w, u - w], dim=-2).reshape(x.shape)
        h *= 2
    return x


def rht(x: torch.Tensor) -> torch.Tensor:
    """The forward rotation (step 1, before the cast) of fp32 rows x [..., D]."""
    d = x.shape[-1]
    b = _q.int4_rht_block(d)
    s = _q.int4_rht_signs(d, x.device)
    return _butterfly(x.reshape(*x.shape[:-1], d // b, b) * s).reshape(x.shape)


def irht(y: torch.Tensor) -> torch.Tensor:
    """The inverse rotation of fp32 rows y [..., D]: (H_b y) * s / b per block."""
    d = y.shape[-1]
    b = _q.int4_rht_block(d)
    s = _q.int4_rht_signs(d, y.device)
    return ((_butterfly(y.reshape(*y.shape[:-1], d // b, b)) * s) / b).reshape(y.shape)


def rotated(x: torch.Tensor) -> torch.Tensor:
    """Step 1: the rotated rows as the quantiser reads them, fp32 values of x's dtype."""
    r = rht(daz(x))
    return r if x.dtype == torch.float32 else r.to(x.dtype).float()


def quantize_int4(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(packed uint8 [M, H, D / 2], stored fp32 scale [M, H]) of rows x [M, H, D]."""
    y = rotated(x)
    fin = torch.isfinite(y)
    any_fin = fin.any(-1)
    inf = torch.full_like(y, float("inf"))
    mn = torch.where(fin, y, inf).amin(-1)
    mx = torch.where(fin, y, -inf).amax(-1)
    mn = torch.where(any_fin, mn, torch.zeros_like(mn))
    mx = torch.where(any_fin, mx, torch.zeros_like(mx))
    scale = ((mx - mn) / _q.INT4_LEVELS).clamp_min(_q.SCALE_FLOOR)
    zp = ((-mn / scale).clamp(0.0, _q.INT4_LEVELS) + 0.5).trunc()
    inv = torch.ones_like(scale) / scale
    t = y * inv[..., None]
    t = t + zp[..., None]
    q = (t.clamp(0.0, _q.INT4_LEVELS) + 0.5).trunc()
    q = torch.where(torch.isnan(y), zp[..., None].expand_as(q), q).to(torch.uint8)
    packed = q[..., 0::2] | (q[..., 1::2] << 4)
    bits = (scale.view(torch.int32) & ~_q.INT4_ZP_BITS) | zp.to(torch.int32)
    return packed, bits.view(torch.float32)


def store_kv_int4(a) -> None:
    """`a`: kvwrite.ops.kv.KVStore in the QUANT_INT4 format (canonical caches)."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if idx.numel():
        for x, cache, sc in ((a.k, a.k_cache, a.k_scale_cache), (a.v, a.v_cache, a.v_scale_cache)):
            packed, scale = quantize_int4(x[idx])
            cache[page, offset] = packed
            sc[page, offset] = scale


def decode_int4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 rows [..., D] of packed codes [..., D / 2] and their stored scales [...]."""
    lo, hi = (packed & 0xF).float(), (packed >> 4).float()
    q = torch.stack([lo, hi], dim=-1).flatten(-2)
    bits = scale.float().contiguous().view(torch.int32)
    zp = (bits & _q.INT4_ZP_BITS).float()
    s = (bits & ~_q.INT4_ZP_BITS).view(torch.float32)
    return irht((q - zp[..., None]) * s[..., None])


def dequant_kv_int4(cache: torch.Tensor, scale_cache: torch.Tensor, loc: torch.Tensor, *,
                    layout: str = "NHD") -> torch.Tensor:
    """The rows at `loc` (int32/int64 [N], in [0, capacity)) of an int4 K or V cache (uint8
    `[pages, pool_page_size, H, D / 2]`, "HND": `[pages, H, pool_page_size, D / 2]`) with its fp32
    scale cache `[pages, pool_page_size, H]`, decoded and rotated back: fp32 `[N, H, D]`."""
    from kvwrite import validate

    cache = validate.tensor("cache", cache, ndim=4, dtypes=(torch.uint8,), last_contiguous=False)
    layout = validate.choice("layout", layout, ("NHD", "HND"))
    c = cache if layout == "NHD" else cache.transpose(1, 2)
    num_pages, pps, h = c.shape[0], c.shape[1], c.shape[2]
    sc = validate.tensor("scale_cache", scale_cache, ndim=3, dtypes=(torch.float32,), device=cache.device,
                         last_contiguous=False)
    validate.shape("scale_cache", sc, (num_pages, pps, h), "num_pages, pool_page_size, H")
    loc = validate.tensor("loc", loc, ndim=1, dtypes=validate.LOC_DTYPES, device=cache.device).long()
    if loc.numel() and (int(loc.min()) < 0 or int(loc.max()) >= num_pages * pps):
        raise ValueError(f"loc must lie in [0, {num_pages * pps}) (the cache's capacity)")
    page, offset = loc // pps, loc % pps
    return decode_int4(c[page, offset], sc[page, offset])
