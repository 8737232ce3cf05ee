"""Reference fused RoPE (+ q/k RMS norm) + K/V store: a composition of plain torch ops.

Exactly where rounding happens (every backend reproduces this bit for bit):
  1. x = q/k head (input dtype) -> fp32 (exact). cos, sin = cos_sin_cache[pos] -> fp32 (exact).
  2. RMS norm (when a weight is given), all fp32, each op rounded once (no fused multiply-add):
       ss  = sum of x_d * x_d over the head's D elements, as a fixed *pairwise* tree: pad to
             P = next_pow2(D) with zeros, then repeatedly add adjacent pairs (s[2i] + s[2i+1])
       inv = 1 / sqrt(ss / D + eps)      (fp32 division, correctly rounded sqrt, eps as fp32)
       y_d = (x_d * inv) * w_d           (w as fp32)
     without a weight y = x.
  3. Rotation of the first rotary_dim elements, pairs (a, b) = (i, i + R/2) (neox) or
     (2i, 2i + 1) (GPT-J), c/s = cos/sin[i]:  y_a' = y_a*c - y_b*s,  y_b' = y_b*c + y_a*s
     (each product rounded to fp32, then the sum; no fma). Elements past rotary_dim keep y.
  4. One rounding to the input dtype (round to nearest even; none for fp32): that is the new q
     (written in place) and the k that is stored.
  5. The stored k (and v, unrotated) then goes to the cache exactly as `store_kv` would store that
     k: copied, or quantised (static fp8/int8 scale or dynamic per-token / per-token-head scale,
     `kvwrite.reference.kv_quant`). So fused == "rope in torch, then store", bit for bit.
For MLA, k_pe' (step 4) is stored by `store_mla`'s format with kv_c, the same way.
"""
from __future__ import annotations

import dataclasses

import torch

from kvwrite.errors import KIND_POSITION
from kvwrite.reference import _locs
from kvwrite.reference.kv_quant import write_rows


def pairwise_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim as the fixed adjacent-pair tree (zero-padded to a power of two)."""
    d = x.shape[-1]
    p = 1
    while p < d:
        p *= 2
    if p > d:
        x = torch.nn.functional.pad(x, (0, p - d))
    while x.shape[-1] > 1:
        x = x[..., 0::2] + x[..., 1::2]
    return x[..., 0]


def eps32(eps: float) -> torch.Tensor:
    return torch.tensor(eps, dtype=torch.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """fp32 RMS norm over the last dim (see the module doc, step 2)."""
    x = x.float()
    if weight is None:
        return x
    ss = pairwise_sum(x * x)
    inv = 1.0 / torch.sqrt(ss / x.shape[-1] + eps32(eps).to(x.device))
    return (x * inv[..., None]) * weight.float()


def rotate(y: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int,
           is_neox: bool) -> torch.Tensor:
    """y [M, H, D] fp32 rotated on its first rotary_dim elements; cos/sin [M, rotary_dim/2]."""
    half = rotary_dim // 2
    out = y.clone()
    if is_neox:
        ia, ib = slice(0, half), slice(half, rotary_dim)
    else:
        ia, ib = slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    a, b = y[..., ia], y[..., ib]
    c, s = cos[:, None, :], sin[:, None, :]
    out[..., ia] = a * c - b * s
    out[..., ib] = b * c + a * s
    return out


def rope(x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor, rotary_dim: int,
         is_neox: bool, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Normed and rotated x [M, H, D] (positions [M], valid), rounded once to x.dtype."""
    cs = cos_sin[positions.long()].float()
    half = rotary_dim // 2
    y = rotate(rms_norm(x, weight, eps), cs[:, :half], cs[:, half:2 * half], rotary_dim, is_neox)
    return y.to(x.dtype)


def resolve_with_positions(a) -> tuple[_locs.Resolved, torch.Tensor]:
    """Loc resolution of the K store with the position check folded in: a position outside
    [0, max_position) is a KIND_POSITION error (checked first: it is the token's first read),
    never written, in every mode. Returns (resolved, valid-position mask)."""
    store = a.store
    r = _locs.resolve(store.locs, store.geometry.capacity, store.check,
                      store.geometry.pool_page_size)
    pos = a.positions.long()
    max_pos = a.cos_sin.shape[0]
    ok = (pos >= 0) & (pos < max_pos)
    if store.check.mode != "off":
        bad_pos = ~ok
        r = dataclasses.replace(
            r, write=r.write & ok, bad=r.bad | bad_pos,
            target=torch.where(bad_pos, pos, r.target),
            limit=torch.where(bad_pos, torch.full_like(pos, max_pos), r.limit),
            kind=torch.where(bad_pos, torch.full_like(pos, KIND_POSITION), r.kind))
    else:
        r = dataclasses.replace(r, write=r.write & ok)
    return r, ok


def _rotate_q_in_place(a, ok: torch.Tensor, weight) -> None:
    iq = torch.nonzero(ok).flatten()
    if iq.numel():
        a.q[iq] = rope(a.q[iq], a.positions[iq], a.cos_sin, a.rotary_dim, a.is_neox, weight,
                       getattr(a, "eps", 0.0))


def rope_store_kv(a) -> None:
    """`a`: kvwrite.ops.rope.RopeStoreKV."""
    s = a.store
    r, ok = resolve_with_positions(a)
    _locs.check(r, s.geometry, s.check)
    # k is read before q is written (q and k may be views of one qkv buffer)
    idx = torch.nonzero(r.write).flatten()
    k = rope(s.k[idx], a.positions[idx], a.cos_sin, a.rotary_dim, a.is_neox, a.k_norm_weight, a.eps)
    _rotate_q_in_place(a, ok, a.q_norm_weight)
    if idx.numel():
        page, offset = s.geometry.locate(r.row[idx])
        write_rows(k, s.k_cache, s.quant, s.k_scale, s.k_scale_cache, page, offset, s.rule)
        write_rows(s.v[idx], s.v_cache, s.quant, s.v_scale, s.v_scale_cache, page, offset, s.rule)


def rope_store_mla(a) -> None:
    """`a`: kvwrite.ops.rope.RopeStoreMLA (its `store` is a validated StoreMLA)."""
    from kvwrite.reference.mla import WRITERS

    s = a.store
    r, ok = resolve_with_positions(a)
    _locs.check(r, s.geometry, s.check)
    idx = torch.nonzero(r.write).flatten()
    k_pe = s.k_pe.clone()
    if idx.numel():
        k_pe[idx] = rope(s.k_pe[idx][:, None, :], a.positions[idx], a.cos_sin, a.rotary_dim,
                         a.is_neox)[:, 0, :]
    _rotate_q_in_place(a, ok, None)
    if idx.numel():
        page, offset = s.geometry.locate(r.row[idx])
        WRITERS[s.format.name](dataclasses.replace(s, k_pe=k_pe), idx, page, offset)
