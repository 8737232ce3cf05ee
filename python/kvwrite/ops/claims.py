"""Duplicate-row detection for every store and page move, in assert and guard mode: `claim` runs
in `ops._common.dispatch` before the backend's implementation (the C++ fast path: the same
pre-pass in `csrc/api.h`), the extension's `claim_rows` on cpu / cuda, `kvwrite.reference.claims`
elsewhere. Rules, record and cost: docs/checks.md, "Duplicate rows"."""
from __future__ import annotations

import contextlib
import dataclasses

import torch

from kvwrite import _ext
from kvwrite.reference import claims as _ref

# Ops that write no pool row (a gather fills its own output), and move_rows (its halves check).
READ_ONLY = ("gather", "slot_mapping", "move_rows")
_ON = [True]


@contextlib.contextmanager
def disabled():
    """Assert and guard without the duplicate check (the bench's baseline), the C++ fast path too."""
    _ON[0] = False
    native = _ext.LOADED and hasattr(torch.ops.kvwrite_ext, "set_claims")
    if native:
        torch.ops.kvwrite_ext.set_claims(False)
    try:
        yield
    finally:
        _ON[0] = True
        if native:
            torch.ops.kvwrite_ext.set_claims(True)


def with_locs(a: object, locs: object) -> object:
    """The call `a` with its Locs replaced (a fused call's are its inner store's)."""
    if hasattr(a, "store"):
        return dataclasses.replace(a, store=with_locs(a.store, locs))
    return dataclasses.replace(a, locs=locs)


def claim(op: str, backend: str, a: object) -> object:
    """The call a backend runs: `a` itself, or `a` on the pre-pass's scratch locs (or dst pages)."""
    chk = a.check
    if chk.mode == "off" or op in READ_ONLY or not _ON[0]:
        return a
    if hasattr(a, "dst_pages"):   # copy_pages (move_rows' second half)
        if a.n == 0:
            return a
        dst = _ref.unique_pairs(a.src_pages, a.dst_pages, a.src_units, a.dst_units, chk)
        return a if dst is a.dst_pages else dataclasses.replace(a, dst_pages=dst)
    locs = a.locs
    if locs.n < 2:   # one token writes one row: nothing to claim (a bad loc is the store's own check)
        return a
    # the extension's pre-pass on cpu / cuda, its torch twin elsewhere
    new = (_ext.claim_rows if backend in ("cpu", "cuda") else _ref.unique_locs)(locs, a.geometry, chk)
    return a if new is locs else with_locs(a, new)
