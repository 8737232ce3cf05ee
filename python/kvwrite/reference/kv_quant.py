"""Reference int8 / fp8 K/V stores with static or dynamic (per-token, per-token-head) scales, and
`dequant_kv`, their reader: the definition of store_kv's formats.

Formats (the quant mode `kvwrite.facts.QUANT_*`, picked from the cache dtype and the scales):
copy (a cache in the input dtype), static (an fp8 or int8 cache with fp32 `k_scale`/`v_scale`),
dynamic per token / per token-head (an int8 / e4m3fn / e5m2 cache with fp32 scale caches
`k_scale_cache`/`v_scale_cache`, vLLM's per-token-quant caches), int4 (QUANT_INT4: a uint8 cache
`[pages, pps, H, D / 2]` with per-token-head scale caches, vLLM's INT4_PER_TOKEN_HEAD; formulas
on `kvwrite.reference.kv_int4`). Copy and static fp8 run the store_kv kernels; int8 and dynamic
scales the store_kv_quant kernels (`kernels/store_kv_quant.py`, device functions
`kernels/_quant.py`, C++ `csrc/kvwrite/store_kv_quant.h`, `kv_quant.h`); int4 its own
(`kernels/store_kv_int4.py`, `csrc/kvwrite/kv_int4.h`).

Per token (or token-head) over the values x (fp32 of the input dtype):
    scale  = max(amax(|x|) / QMAX, 1e-6)       fp32 division; QMAX 127 (int8), 448 (e4m3fn), 57344 (e5m2)
    stored = saturate(RNE(x / scale))          fp32 division (not a multiply by 1/scale), then
                                               round to nearest even: int8 clamped to [-128, 127],
                                               fp8 by the shared fp8 rounding (saturating at its max)
Static int8 / fp8: the same with the given fp32 scale ([], [1] or [H]). dequant: code * scale.
Amax is taken over the finite values (NaN / +-inf do not count; they are then coded as the
special-value policy says: NaN -> int8 0 / the fp8 NaN code, +-inf -> +-max).

`quant_rule="vllm"` (dynamic modes only) is vLLM's per-token-head store instead:
    stored = saturate(x * (1 / scale))         1 / scale rounded to fp32 first; int8: the fp32
                                               sum x * (1 / scale) +- 0.5 (half away from zero)
                                               clamped to [-128, 127], then truncated
"""
from __future__ import annotations

import torch

from kvwrite import facts as _q
from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.quant import daz, finite_amax, fp8_codes


def scaled(x: torch.Tensor, scale: torch.Tensor, rule: int = _q.RULE_RNE) -> torch.Tensor:
    """fp32 daz(x) / scale (RULE_RNE) or daz(x) * (1 / scale) (RULE_VLLM, the reciprocal
    rounded to fp32 first, as vLLM's store computes it)."""
    if rule == _q.RULE_VLLM:
        s = scale.float() if isinstance(scale, torch.Tensor) else torch.tensor(scale, dtype=torch.float32)
        return daz(x) * (torch.ones_like(s) / s)
    return daz(x) / scale


def int8_codes(y: torch.Tensor, rule: int = _q.RULE_RNE) -> torch.Tensor:
    """int8 codes of scaled fp32 y: RNE(clamp(y)) (RULE_RNE) or trunc(clamp(y +- 0.5))
    (RULE_VLLM: half away from zero, the +-0.5 an fp32 add); NaN -> 0."""
    y = torch.where(torch.isnan(y), torch.zeros_like(y), y)
    if rule == _q.RULE_VLLM:
        t = torch.where(y >= 0, y + 0.5, y - 0.5)
        return t.clamp(-128.0, 127.0).trunc().to(torch.int8)
    return y.clamp(-128.0, 127.0).round().to(torch.int8)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor, rule: int = _q.RULE_RNE) -> torch.Tensor:
    """int8 codes of x under `scale` (fp32; see `scaled` and `int8_codes`)."""
    return int8_codes(scaled(x, scale, rule), rule)


def quantize(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
             rule: int = _q.RULE_RNE) -> torch.Tensor:
    """int8 or fp8 (saturating, RNE: `fp8_codes`) codes of x under `scale`."""
    y = scaled(x, scale, rule)
    return int8_codes(y, rule) if dtype == torch.int8 else fp8_codes(y, dtype)


def dynamic_scale(x: torch.Tensor, dtype: torch.dtype, per_head: bool) -> torch.Tensor:
    """max(amax / QMAX, 1e-6) of rows x [M, H, D], amax over the finite |x|: [M, H] per head,
    else [M, 1]."""
    a = finite_amax(x, -1)
    amax = a if per_head else a.amax(-1, keepdim=True)
    return (amax / _q.QMAX[dtype]).clamp_min(_q.SCALE_FLOOR)


def write_rows(x: torch.Tensor, cache: torch.Tensor, quant: int, scale: torch.Tensor | None,
               scale_cache: torch.Tensor | None, page: torch.Tensor, offset: torch.Tensor,
               rule: int = _q.RULE_RNE) -> None:
    """Store rows x [M, H, D] (already the tokens to write) at (page, offset) in `quant` mode."""
    if quant == _q.QUANT_COPY:
        cache[page, offset] = x.to(cache.dtype)
    elif quant == _q.QUANT_STATIC:
        s = scale.float().reshape(-1)[None, :, None] if scale.dim() else scale.float()
        cache[page, offset] = quantize(x, s, cache.dtype)
    else:
        s = dynamic_scale(x, cache.dtype, quant == _q.QUANT_HEAD)  # [M, 1 or H]
        cache[page, offset] = quantize(x, s[..., None], cache.dtype, rule)
        scale_cache[page, offset] = s


def store_kv_quant(a) -> None:
    """`a`: kvwrite.ops.kv.KVStore."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    if idx.numel():
        write_rows(a.k[idx], a.k_cache, a.quant, a.k_scale, a.k_scale_cache, page, offset, a.rule)
        write_rows(a.v[idx], a.v_cache, a.quant, a.v_scale, a.v_scale_cache, page, offset, a.rule)


def dequant_kv(k_cache: torch.Tensor, loc: torch.Tensor, *, scale: torch.Tensor | None = None,
               scale_cache: torch.Tensor | None = None, layout: str = "NHD") -> torch.Tensor:
    """The rows at `loc` (int32/int64 [N], in [0, capacity)) of a paged K or V cache as fp32
    `[N, H, D]`: code * scale for int8/fp8 caches with a static `scale` ([], [1] or [H]) or a
    dynamic `scale_cache` ([pages, pool_page_size] or [pages, pool_page_size, H]); plain caches
    (and fp8 without a scale) are converted as they are."""
    from kvwrite import validate

    k_cache = validate.tensor("k_cache", k_cache, ndim=4, last_contiguous=False)
    layout = validate.choice("layout", layout, ("NHD", "HND"))
    kc = k_cache if layout == "NHD" else k_cache.transpose(1, 2)
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
        sc = validate.scale_cache("scale_cache", scale_cache, num_pages, pps, h, k_cache.device)
        rows = rows * sc[page, offset][..., None]
    return rows
