"""Reference paged K+V store (MHA/GQA, fp8)."""
from __future__ import annotations

import torch

from kvwrite.reference._locs import resolve_and_check
from kvwrite.reference.quant import quantize_fp8  # noqa: F401  (re-exported: the shared quantiser)
from kvwrite.validate import FP8_MAX


def _store(x: torch.Tensor, cache: torch.Tensor, scale: torch.Tensor | None,
           idx: torch.Tensor, page: torch.Tensor, offset: torch.Tensor) -> None:
    rows = x[idx]
    if cache.dtype in FP8_MAX:
        s = scale.float().reshape(-1)[None, :, None] if scale.dim() else scale.float()
        rows = quantize_fp8(rows, s, cache.dtype)
    rows = rows.to(cache.dtype)
    if cache.dim() == 5:  # split head dim [pages, rows, H, D / X, X] (vLLM's legacy layout)
        rows = rows.unflatten(-1, cache.shape[3:])
    cache[page, offset] = rows


def store_kv(a) -> None:
    """`a`: kvwrite.ops.kv.KVStore with the caches in canonical [pages, rows, H, D] view (or
    [pages, rows, H, D / X, X]: a split head dim, `kvwrite.ops.kv_head_major`)."""
    idx, page, offset = resolve_and_check(a.locs, a.geometry, a.check)
    _store(a.k, a.k_cache, a.k_scale, idx, page, offset)
    _store(a.v, a.v_cache, a.v_scale, idx, page, offset)
