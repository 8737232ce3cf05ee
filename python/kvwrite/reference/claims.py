"""Duplicate rows, the torch twin of `csrc/kvwrite/claims.h`: the pre-pass `kvwrite.ops.claims`
runs before a store or page move in assert and guard mode (never in off mode).

Rule: the lowest token index that writes a row keeps it (`first_writers`); every later token
that resolves to the same row is a KIND_DUPLICATE error. Guard mode records the call's bad and
duplicate tokens (one packed-min fold that leaves EPOCH to the store, so the record holds the
call's lowest) and hands the store a scratch loc in which every token not to write is the
padding -1 (a page-table call becomes plain rows): each store's existing padding path skips
them, no kernel changes. Assert mode fails on the lowest bad-or-duplicate token when the call
has a duplicate (a CPU raises `DuplicateWrite` / `OutOfBoundsWrite`; a GPU asserts on the device
without a host sync) and otherwise leaves the call to the store's own check.

Sort-based: a stable sort of the rows (no host sync, no buffer sized by the pool), O(N log N);
extra memory a few int64 tensors of N.
"""
from __future__ import annotations

import dataclasses

import torch

from kvwrite import errors as _e
from kvwrite.addressing import Check, Locs
from kvwrite.errors import DuplicateWrite, record_torch
from kvwrite.geometry import PageGeometry
from kvwrite.reference import _locs
from kvwrite.reference.pages import check_pairs, resolve_pairs

_NONE = torch.iinfo(torch.int64).max   # sort key of a token that writes nothing


def first_writers(row: torch.Tensor, write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dup, first) per token: `dup` where a lower token that writes (`write`) has the same
    `row`; `first` the lowest token writing that row (only meaningful where `write`)."""
    n = row.shape[0]
    key = torch.where(write, row.to(torch.int64), _NONE)
    order, perm = torch.sort(key, stable=True)          # equal rows keep token order
    idx = torch.arange(n, device=row.device)
    start = torch.ones(n, dtype=torch.bool, device=row.device)
    start[1:] = order[1:] != order[:-1]
    head = torch.cummax(torch.where(start, idx, 0), 0).values   # each sorted slot's group start
    dup, first = torch.empty_like(start), torch.empty_like(idx)
    dup[perm] = ~start & (order != _NONE)
    first[perm] = perm[head]
    return dup, first


def _fail(i: int, count: int, dup: torch.Tensor, first: torch.Tensor, raise_bad, dup_error) -> None:
    """Assert mode on the host: raise for token `i`, the call's lowest bad or duplicate token."""
    if not bool(dup[i]):
        raise_bad()
    raise dup_error(i, int(first[i]), count)


def _assert(bad: torch.Tensor, dup: torch.Tensor, first: torch.Tensor, raise_bad, dup_error) -> None:
    """Assert mode: a call with a duplicate fails on its lowest bad-or-duplicate token (a GPU:
    a device assert, no host sync); a call without one is left to the store's own check."""
    if dup.device.type != "cpu":
        torch._assert_async(~dup.any(), "kvwrite: two tokens of one call write the same row (check=assert)")
        return
    if bool(dup.any()):
        either = bad | dup
        _fail(int(torch.nonzero(either)[0, 0]), int(either.sum()), dup, first, raise_bad, dup_error)


def unique_locs(locs: Locs, geometry: PageGeometry, chk: Check) -> Locs:
    """The pre-pass of a store: the Locs the store runs on (assert mode: `locs` itself)."""
    r = _locs.resolve(locs, geometry.capacity, chk, geometry.pool_page_size)
    dup, first = first_writers(r.row, r.write)
    pps = geometry.pool_page_size
    table = locs.table is not None
    loc = r.row if table else r.loc
    if chk.mode == "assert":
        def dup_error(i: int, f: int, count: int) -> DuplicateWrite:
            ctx = dict(batch=int(r.table[_e.BATCH][i]), position=int(r.table[_e.POSITION][i])) if table else {}
            return DuplicateWrite(chk.op, i, int(loc[i]), int(r.row[i]), f, pps, count, **ctx)
        _assert(r.bad, dup, first, lambda: _locs.check(r, geometry, chk), dup_error)
        return locs
    record_torch(chk.errors, r.bad | dup, torch.where(dup, loc, r.loc), torch.where(dup, r.row, r.target),
                 torch.where(dup, first, r.limit), pps, chk.op,
                 torch.where(dup, _e.KIND_DUPLICATE, r.kind), r.table, advance=False)
    keep = r.write & ~dup
    if table:
        return Locs(torch.where(keep, r.row, -1))
    return dataclasses.replace(locs, loc=torch.where(keep, r.loc, -1))


def unique_pairs(src_pages: torch.Tensor, dst_pages: torch.Tensor, su, du, chk: Check) -> torch.Tensor:
    """The pre-pass of a page move (`copy_pages`, `move_rows`): the dst ids it runs on, every
    bad or duplicate pair's dst -1 (guard), or `dst_pages` itself (assert)."""
    write, bad, kind, target, limit = resolve_pairs(src_pages, dst_pages, su, du, chk.mode)
    d = dst_pages.to(torch.int64)
    dup, first = first_writers(d, write)
    if chk.mode == "assert":
        def dup_error(i: int, f: int, count: int) -> DuplicateWrite:
            return DuplicateWrite(chk.op, i, int(d[i]), int(d[i]), f, du.rows, count)
        _assert(bad, dup, first, lambda: check_pairs(src_pages, dst_pages, su, du, chk), dup_error)
        return dst_pages
    record_torch(chk.errors, bad | dup, torch.where(dup, d, target), torch.where(dup, d, target),
                 torch.where(dup, first, limit), du.rows, chk.op,
                 torch.where(dup, _e.KIND_DUPLICATE, kind), advance=False)
    return torch.where(write & ~dup, d, -1).to(dst_pages.dtype)
