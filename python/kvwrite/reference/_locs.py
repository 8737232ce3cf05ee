"""Torch twin of `kernels/_common.py`: loc resolution and the assert/guard checks."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite.errors import KIND_LOC_MAP, KIND_POOL, OutOfBoundsWrite, record_torch
from kvwrite.geometry import PageGeometry
from kvwrite.ops._common import Check, Locs


@dataclass(frozen=True)
class Resolved:
    loc: torch.Tensor      # int64 virtual locs
    row: torch.Tensor      # int64 local rows (valid where `write`)
    write: torch.Tensor    # bool: tokens to store
    bad: torch.Tensor      # bool: out-of-range tokens (never stored)
    target: torch.Tensor   # int64: the index that was out of range
    limit: torch.Tensor    # int64: its bound
    kind: torch.Tensor     # int64: KIND_POOL or KIND_LOC_MAP


def resolve(locs: Locs, capacity: int, check: Check, pool_page_size: int = 1) -> Resolved:
    """Virtual loc -> loc_map -> DCP shard -> bounds check, exactly as the kernels do (the order
    is documented on `kvwrite.kernels._common.resolve_locs`)."""
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
    if checking:
        oob = live & ((row < 0) | (row >= capacity))
        bad = bad | oob
        write = live & ~oob
    else:
        write = live & (row >= 0)
    n_map = locs.loc_map.shape[0] if locs.loc_map is not None else 0
    target = torch.where(kind == KIND_LOC_MAP, loc, row)
    limit = torch.where(kind == KIND_LOC_MAP, torch.full_like(loc, n_map), torch.full_like(loc, capacity))
    return Resolved(loc, row, write, bad, target, limit, kind)


def check(r: Resolved, geometry: PageGeometry, chk: Check) -> None:
    """`assert`: raise on the first bad token (host sync). `guard`: fold into the record."""
    if chk.mode == "assert" and bool(r.bad.any()):
        i = int(torch.nonzero(r.bad)[0, 0])
        kind, target = int(r.kind[i]), int(r.target[i])
        raise OutOfBoundsWrite(op=chk.op, token_index=i, loc=int(r.loc[i]),
                               page=geometry.page_of(target) if kind == KIND_POOL else None,
                               num_pages=geometry.num_pages,
                               pool_page_size=geometry.pool_page_size,
                               count=int(r.bad.sum()), kind=kind, target=target,
                               limit=int(r.limit[i]))
    if chk.mode == "guard":
        record_torch(chk.errors, r.bad, r.loc, r.target, r.limit, geometry.pool_page_size,
                     chk.op, r.kind)


def resolve_and_check(locs: Locs, geometry: PageGeometry, chk: Check) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Resolve, check, and return (token indices, pages, offsets) of the tokens to store."""
    r = resolve(locs, geometry.capacity, chk, geometry.pool_page_size)
    check(r, geometry, chk)
    idx = torch.nonzero(r.write).flatten()
    page, offset = geometry.locate(r.row[idx])
    return idx, page, offset
