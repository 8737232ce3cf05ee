"""Page-table addressing (FlashInfer's CSR convention) as a `loc` for every store op, resolved in
each backend's kernel prologue (kernels/_common.resolve_table, csrc/kvwrite/locs.h,
reference/_locs.resolve_table); the rule and its checks: docs/checks.md, "Page tables"."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate


@dataclass(frozen=True)
class PageTable:
    """Where each token goes, by request and position: int32/int64 1-D tensors.

    batch_indices [N], positions [N]: each token's request and its position in that request;
    kv_indices [total pages]: the pages of every request, request b's at
    kv_indptr[b]..kv_indptr[b + 1]; kv_indptr [batch_size + 1].
    """

    batch_indices: torch.Tensor
    positions: torch.Tensor
    kv_indices: torch.Tensor
    kv_indptr: torch.Tensor

    @property
    def num_batches(self) -> int:
        return self.kv_indptr.shape[0] - 1


def table(t: PageTable, n: int, device: torch.device) -> PageTable:
    """Check every tensor of a PageTable (named errors, no device sync)."""
    for name in ("batch_indices", "positions", "kv_indices", "kv_indptr"):
        x = validate.tensor(name, getattr(t, name), ndim=1, dtypes=validate.LOC_DTYPES, device=device)
        if x.shape[0] > 1 and x.stride(0) != 1:
            raise ValueError(f"{name} must be contiguous, got stride {x.stride(0)}")
    for name in ("batch_indices", "positions"):
        if getattr(t, name).shape[0] != n:
            raise ValueError(f"{name} must have one entry per token ({n}), got {getattr(t, name).shape[0]}")
    if t.kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr must have batch_size + 1 >= 1 entries, got 0")
    return t
