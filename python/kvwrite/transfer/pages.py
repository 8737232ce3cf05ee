"""Page ids of a transfer checked against both pools by copy_pages' rules ("off" still refuses past a pool)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kvwrite import validate
from kvwrite.errors import KIND_SRC_PAGE, ErrorBuffer, OutOfBoundsWrite, default_errors, record_torch
from kvwrite.reference.pages import resolve_pairs
from kvwrite.transfer.layout import Bridge


class TransferPageError(OutOfBoundsWrite):
    """A transfer names a page its src or dst pool does not have (nothing was moved)."""

    def __init__(self, where: dict[str, str], i: int, target: int, limit: int, rows: int, count: int,
                 kind: int) -> None:
        self.where = where   # {"src": "agent 'prefill', pool 'kv'", "dst": ...}
        super().__init__("transfer", i, target, target, limit, rows, count, kind=kind, target=target, limit=limit)

    def _page_message(self) -> str:
        side = "src" if self.kind == KIND_SRC_PAGE else "dst"
        many = f"{self.count} bad page ids; the first: " if self.count > 1 else ""
        return (f"transfer: {many}pair {self.token_index} names {side} page {self.target} of {side} "
                f"{self.where[side]}, which has pages [0, {self.limit}) (in units of {self.pool_page_size} "
                f"rows); nothing was moved" + ("; padding must be -1" if self.target < 0 else ""))


@dataclass(frozen=True)
class CheckedPairs:
    """The pairs that move (`src`, `dst` unit ids, int64) and how many were skipped."""

    src: np.ndarray
    dst: np.ndarray
    skipped: int


def _ids(name: str, pages: object) -> np.ndarray:
    """int64 host ids of a 1-D int tensor, array or list (numpy from here on: no torch threads)."""
    if isinstance(pages, torch.Tensor):
        return validate.tensor(name, pages, ndim=1, dtypes=validate.LOC_DTYPES).to("cpu", torch.int64).numpy()
    a = np.asarray(pages)
    if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
        raise ValueError(f"{name} must be 1-D integer page ids, got {a.dtype} of shape {list(a.shape)}")
    return a.astype(np.int64)


def check_pairs(src_pages: object, dst_pages: object, br: Bridge, where: dict[str, str], check: str | None,
                errors: ErrorBuffer | None = None) -> CheckedPairs:
    """Check the ids of a transfer against both pools (`br`: their units) in mode `check`."""
    mode = validate.check_mode(check)
    sp, dp = _ids("src_pages", src_pages), _ids("dst_pages", dst_pages)
    if sp.shape[0] != dp.shape[0]:
        raise ValueError(f"src_pages and dst_pages must pair up one to one, got {sp.shape[0]} and "
                         f"{dp.shape[0]} entries")
    write, bad, kind, target, limit = resolve_pairs(sp, dp, br.src, br.dst, mode)
    if mode == "off":   # past either pool: refused all the same (no descriptor may leave a pool)
        past_s, past_d = write & (sp >= br.src.count), write & (dp >= br.dst.count)
        bad, write = past_s | past_d, write & ~(past_s | past_d)
        kind = np.where(past_s, KIND_SRC_PAGE, kind)
    if mode in ("assert", "off") and bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise TransferPageError(where, i, int(target[i]), int(limit[i]), br.src.rows, int(bad.sum()), int(kind[i]))
    if mode == "guard" and bad.any():
        rec = errors if errors is not None else default_errors("cpu")
        if rec.device.type != "cpu":
            raise ValueError(f"errors must be a CPU ErrorBuffer (a transfer checks its ids on the host), "
                             f"got one on {rec.device}")
        t = torch.from_numpy
        record_torch(rec.tensor, t(bad), t(target), t(target), t(limit), br.src.rows, "copy_pages", t(kind))
    return CheckedPairs(sp[write], dp[write], int(write.size - write.sum()))
