"""Torch twin of `kernels/_common.py`: loc resolution and the assert/guard checks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import errors as _e
from kvwrite.errors import KIND_LOC_MAP, KIND_POOL, OutOfBoundsWrite, record_torch
from kvwrite.geometry import PageGeometry
from kvwrite.addressing import Check, Locs


@dataclass(frozen=True)
class Resolved:
    loc: torch.Tensor      # int64 virtual locs
    row: torch.Tensor      # int64 local rows (valid where `write`)
    write: torch.Tensor    # bool: tokens to store
    bad: torch.Tensor      # bool: out-of-range tokens (never stored)
    target: torch.Tensor   # int64: the index that was out of range
    limit: torch.Tensor    # int64: its bound
    kind: torch.Tensor     # int64: KIND_POOL or KIND_LOC_MAP (or a page-table kind)
    table: dict[int, torch.Tensor] | None = None   # page-table context record slots -> [N]


def _bounded(live: torch.Tensor, bad: torch.Tensor, index: torch.Tensor, limit, checking: bool):
    """(bad, write) once `index` of the live tokens is checked against [0, limit): checking, an index
    outside is bad and not written; off, only a negative index (padding) is skipped."""
    if not checking:
        return bad, live & (index >= 0)
    oob = live & ((index < 0) | (index >= limit))
    return bad | oob, live & ~oob


def _floordiv(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x, d, rounding_mode="floor")


def resolve_table(locs: Locs, capacity: int, check: Check, pool_page_size: int) -> Resolved:
    """Page-table addressing, exactly as `kvwrite.kernels._common.resolve_table` (the checks
    and what off mode skips are documented there and in `kvwrite.pagetable`)."""
    t = locs.table
    checking = check.mode != "off"
    pps = pool_page_size
    b = t.batch_indices.to(torch.int64)
    pos = t.positions.to(torch.int64)
    indptr, indices = t.kv_indptr.to(torch.int64), t.kv_indices.to(torch.int64)
    n_batch, n_table, num_pages = t.num_batches, indices.shape[0], capacity // pps
    q, r = _floordiv(pos, pps), torch.remainder(pos, pps)
    in_batch = (b >= 0) & (b < n_batch)
    bad = ~in_batch if checking else torch.zeros_like(in_batch)
    kind = torch.where(bad, _e.KIND_BATCH, _e.KIND_TABLE_PAGE)
    live = in_batch
    bc = b.clamp(0, indptr.shape[0] - 1)
    start = torch.where(live, indptr[bc], 0)
    slot = start + q
    ok = (slot >= 0) & (slot < n_table)
    hi = torch.full_like(slot, n_table)
    if checking:
        end = torch.where(live, indptr[(bc + 1).clamp(max=indptr.shape[0] - 1)], 0)
        hi = torch.minimum(end, hi)
        ok = ok & (slot >= start) & (slot < hi)
        bad_slot = live & ~ok
        bad = bad | bad_slot
        kind = torch.where(bad_slot, _e.KIND_TABLE_SLOT, kind)
    live = live & ok
    page = indices[slot.clamp(0, max(n_table - 1, 0))] if n_table else torch.full_like(slot, -1)
    page = torch.where(live, page, -1)
    bad, write = _bounded(live, bad, page, num_pages, checking)
    is_batch, is_page = kind == _e.KIND_BATCH, kind == _e.KIND_TABLE_PAGE
    target = torch.where(is_batch, b, torch.where(is_page, page, slot))
    limit = torch.where(is_batch, n_batch, torch.where(is_page, num_pages, hi))
    row = page * pps + r
    loc = torch.where(is_page, row, -1)
    context = {_e.BATCH: b, _e.POSITION: pos, _e.TABLE_SLOT: torch.where(is_batch, -1, slot),
               _e.TABLE_PAGE: torch.where(is_page, page, -1)}
    return Resolved(loc, row, write, bad, target, limit, kind, context)


def resolve(locs: Locs, capacity: int, check: Check, pool_page_size: int = 1) -> Resolved:
    """Virtual loc -> loc_map -> DCP shard -> bounds check, exactly as the kernels do (the order
    is documented on `kvwrite.kernels._common.resolve_locs`); or the page table (`locs.table`,
    rows of `pool_page_size`)."""
    if locs.table is not None:
        return resolve_table(locs, capacity, check, pool_page_size)
    loc = locs.loc.to(torch.int64)
    checking = check.mode != "off"
    live = loc != -1
    bad = torch.zeros_like(live)
    kind = torch.full_like(loc, KIND_POOL)
    row = loc
    if locs.loc_map is not None:
        n_map = locs.loc_map.shape[0]
        in_map = (loc >= 0) & (loc < n_map)
        if checking:
            bad = live & ~in_map
            kind = torch.where(bad, KIND_LOC_MAP, kind)
        live = live & in_map  # off mode too: a loc outside loc_map is skipped
        looked = locs.loc_map.to(torch.int64)[loc.clamp(0, max(n_map - 1, 0))] if n_map else loc
        row = torch.where(live, looked, torch.full_like(loc, -1))
        live = live & (row != -1)
    if locs.dcp_size > 1 and locs.dcp_page:   # whole pages: page p on rank p % dcp_size
        vpage = torch.div(row, pool_page_size, rounding_mode="floor")
        live = live & ((row < 0) | (vpage % locs.dcp_size == locs.dcp_rank))
        local = torch.div(vpage, locs.dcp_size, rounding_mode="floor") * pool_page_size + row % pool_page_size
        row = torch.where(row >= 0, local, row)
    elif locs.dcp_size > 1:
        live = live & ((row < 0) | (row % locs.dcp_size == locs.dcp_rank))
        row = torch.where(row >= 0, torch.div(row, locs.dcp_size, rounding_mode="floor"), row)
    bad, write = _bounded(live, bad, row, capacity, checking)
    n_map = locs.loc_map.shape[0] if locs.loc_map is not None else 0
    target = torch.where(kind == KIND_LOC_MAP, loc, row)
    limit = torch.where(kind == KIND_LOC_MAP, torch.full_like(loc, n_map), torch.full_like(loc, capacity))
    return Resolved(loc, row, write, bad, target, limit, kind)


def check(r: Resolved, geometry: PageGeometry, chk: Check) -> None:
    """`assert`: raise on the first bad token (host sync). `guard`: fold into the record.
    `off`: a row past the pool (which torch indexing would refuse half-way through the store)
    raises the same error before anything is written; negative rows are skipped."""
    bad = r.bad
    if chk.mode == "off":  # a written token's kind/target/limit already name the pool (or page)
        bad = r.write & (r.row >= geometry.capacity)
    if chk.mode in ("assert", "off") and bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        kind, target = int(r.kind[i]), int(r.target[i])
        if r.table is not None and kind in _e.TABLE_KINDS:
            ctx = [int(r.table[s][i]) for s in (_e.BATCH, _e.POSITION, _e.TABLE_SLOT, _e.TABLE_PAGE)]
            raise _e.table_error(chk.op, i, kind, target, int(r.limit[i]), geometry.pool_page_size,
                                 int(bad.sum()), *ctx)
        raise OutOfBoundsWrite(op=chk.op, token_index=i, loc=int(r.loc[i]),
                               page=geometry.page_of(target) if kind == KIND_POOL else None,
                               num_pages=geometry.num_pages,
                               pool_page_size=geometry.pool_page_size,
                               count=int(bad.sum()), kind=kind, target=target,
                               limit=int(r.limit[i]))
    if chk.mode == "guard":
        record_torch(chk.errors, r.bad, r.loc, r.target, r.limit, geometry.pool_page_size,
                     chk.op, r.kind, r.table)


def resolve_and_check(locs: Locs, geometry: PageGeometry, chk: Check) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve, check, and return (token indices, pages, offsets) of the tokens to store."""
    r = resolve(locs, geometry.capacity, chk, geometry.pool_page_size)
    check(r, geometry, chk)
    idx = torch.nonzero(r.write).flatten()
    page, offset = geometry.locate(r.row[idx])
    return idx, page, offset
