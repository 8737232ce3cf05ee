"""Torch twins of the page moves (kvwrite.ops.pages): copy_pages, gather, slot_mapping."""
from __future__ import annotations

import numpy as np
import torch

from kvwrite import errors as _e
from kvwrite.errors import OutOfBoundsWrite, record_torch
from kvwrite.reference import _locs


def _floordiv(x: torch.Tensor, d: int) -> torch.Tensor:
    return torch.div(x, d, rounding_mode="floor")


def resolve_pairs(sp: torch.Tensor, dp: torch.Tensor, su, du, mode: str):
    """(write, bad, kind, target, limit) of each pair, as the kernels resolve them: a -1 on either
    side skips the pair; assert/guard check src then dst against the pools' units; off skips
    negative ids only. Torch tensors, or int64 numpy arrays (kvwrite.transfer checks host ids
    without waking torch's threads)."""
    xp = np if isinstance(sp, np.ndarray) else torch
    s, d = (sp, dp) if xp is np else (sp.to(torch.int64), dp.to(torch.int64))
    live = (s != -1) & (d != -1)
    bad_s = live & ((s < 0) | (s >= su.count))
    bad_d = live & ~bad_s & ((d < 0) | (d >= du.count))
    if mode == "off":
        bad = xp.zeros_like(live)
        write = live & (s >= 0) & (d >= 0)
    else:
        bad = bad_s | bad_d
        write = live & ~bad
    kind = xp.where(bad_s, _e.KIND_SRC_PAGE, _e.KIND_DST_PAGE)
    target = xp.where(bad_s, s, d)
    limit = xp.where(bad_s, su.count, du.count)
    return write, bad, kind, target, limit


def check_pairs(sp, dp, su, du, chk) -> torch.Tensor:
    """Resolve and check the pairs (assert: raise; guard: record; off: a page past either pool
    raises before anything is written, as torch indexing would half-way); return `write`."""
    write, bad, kind, target, limit = resolve_pairs(sp, dp, su, du, chk.mode)
    if chk.mode == "off":
        s, d = sp.to(torch.int64), dp.to(torch.int64)
        past_s, past_d = write & (s >= su.count), write & (d >= du.count)
        bad = past_s | past_d
        kind = torch.where(past_s, _e.KIND_SRC_PAGE, _e.KIND_DST_PAGE)
    if chk.mode in ("assert", "off") and bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        t, lim = int(target[i]), int(limit[i])
        raise OutOfBoundsWrite(op=chk.op, token_index=i, loc=t, page=t, num_pages=lim,
                               pool_page_size=su.rows, count=int(bad.sum()), kind=int(kind[i]),
                               target=t, limit=lim)
    if chk.mode == "guard":
        record_torch(chk.errors, bad, target, target, limit, su.rows, chk.op, kind)
    return write


def checked_pairs(sp, dp, su, du, chk) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids with every skipped or bad pair set to -1 on both sides, after the checks."""
    write = check_pairs(sp, dp, su, du, chk)
    neg = torch.full_like(sp, -1)
    return torch.where(write, sp, neg), torch.where(write, dp.to(sp.dtype), neg)


def _unit_rows(ids: torch.Tensor, units) -> tuple[torch.Tensor, torch.Tensor]:
    """(page, row) index grids `[k, unit rows]` of units `ids` of a pool counted in `units`."""
    rows = torch.arange(units.rows, device=ids.device)
    page = _floordiv(ids, units.factor)[:, None].expand(-1, units.rows)
    row = (ids % units.factor * units.rows)[:, None] + rows[None, :]
    return page, row


def copy_pages(a) -> None:
    """`a`: kvwrite.ops.pages.CopyPages."""
    write = check_pairs(a.src_pages, a.dst_pages, a.src_units, a.dst_units, a.check)
    idx = torch.nonzero(write).flatten()
    if idx.numel() == 0:
        return
    sp, sr = _unit_rows(a.src_pages.to(torch.int64)[idx], a.src_units)
    dp, dr = _unit_rows(a.dst_pages.to(torch.int64)[idx], a.dst_units)
    a.dst[dp, dr] = a.src[sp, sr]


def gather(a) -> None:
    """`a`: kvwrite.ops.pages.Gather; rows not read (padding, skipped, bad) are zero."""
    idx, page, offset = _locs.resolve_and_check(a.locs, a.geometry, a.check)
    a.out.zero_()
    if idx.numel():
        a.out[idx] = a.cache[page, offset]


def slot_mapping(a) -> None:
    """`a`: kvwrite.ops.pages.SlotMapping."""
    bt = a.block_table.to(torch.int64)
    b, pos = a.batch_indices.to(torch.int64), a.positions.to(torch.int64)
    rows, width = bt.shape
    ps, num_pages = a.geometry.pool_page_size, a.geometry.num_pages
    checking = a.check.mode != "off"
    live = (b != -1) & (pos != -1)
    in_row = (b >= 0) & (b < rows)
    blk, off = _floordiv(pos, ps), torch.remainder(pos, ps)
    in_width = (blk >= 0) & (blk < width)
    bad_row = live & ~in_row
    bad_blk = live & in_row & ~in_width
    live = live & in_row & in_width
    page = bt[b.clamp(0, max(rows - 1, 0)), blk.clamp(0, max(width - 1, 0))] if rows * width else torch.full_like(b, -1)
    page = torch.where(live, page, -1)
    if checking:
        bad_page = live & ((page < 0) | (page >= num_pages))
        write = live & ~bad_page
    else:
        bad_page = torch.zeros_like(live)
        write = live & (page >= 0)
    slot = page * ps + off
    a.out.copy_(torch.where(write, slot, -1))
    if not checking:
        return
    bad = bad_row | bad_blk | bad_page
    kind = torch.where(bad_row, _e.KIND_BLOCK_ROW, torch.where(bad_blk, _e.KIND_BLOCK_INDEX, _e.KIND_BLOCK_PAGE))
    target = torch.where(bad_row, b, torch.where(bad_blk, blk, page))
    limit = torch.where(bad_row, rows, torch.where(bad_blk, width, num_pages))
    loc = torch.where(bad_page, slot, -1)
    context = {_e.BATCH: b, _e.POSITION: pos, _e.TABLE_SLOT: torch.where(bad_row, -1, blk),
               _e.TABLE_PAGE: torch.where(bad_page, page, -1)}
    if a.check.mode == "assert" and bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise OutOfBoundsWrite(op=a.check.op, token_index=i, loc=int(loc[i]), page=None, num_pages=None,
                               pool_page_size=ps, count=int(bad.sum()), kind=int(kind[i]),
                               target=int(target[i]), limit=int(limit[i]), batch=int(b[i]),
                               position=int(pos[i]), table_slot=int(context[_e.TABLE_SLOT][i]),
                               table_page=int(context[_e.TABLE_PAGE][i]))
    if a.check.mode == "guard":
        record_torch(a.check.errors, bad, loc, target, limit, ps, a.check.op, kind, context)
