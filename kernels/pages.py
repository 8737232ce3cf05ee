"""Page moves: copy_pages (unit pairs between two pools), gather (rows at locs, zero for skipped
ones) and slot_mapping (block table -> slots), with the stores' check modes and records.

Pools are canonical `[pages, rows, heads, feat]` views (feat contiguous), moved as raw words (the
widest of 4 / 2 / 1 bytes dividing the row's layout), so fp8 and quantised pools move as bits.
"""
import triton
import triton.language as tl

from kvwrite.kernels._common import (CHECK_OFF, OFF_BOUND, check_or_record, claim_tile, end_call,
                                     floor_divmod, record_table)


@triton.jit
def copy_pages_kernel(src_ptr, dst_ptr, sid_ptr, did_ptr, err_ptr, n_pairs, src_count, dst_count,
                      src_factor, dst_factor, unit_rows, n_runs, heads, feat,
                      s_sp, s_sr, s_sh, d_sp, d_sr, d_sh,
                      CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (i, q, c): pair i, runs [q * BLOCK_T, ...) of its unit (a run is one head of one
    row: `feat` contiguous words; run = row * heads + head), words [c * BLOCK_C, ...) of each.
    Unit u of a pool is rows (u % factor) * unit_rows ... of page u // factor."""
    pair = tl.program_id(0) + tl.arange(0, 1)
    s = tl.load(sid_ptr + pair).to(tl.int64)
    d = tl.load(did_ptr + pair).to(tl.int64)
    live = (s != -1) & (d != -1)
    bad_s = live & ((s < 0) | (s >= src_count))
    bad_d = live & (bad_s == 0) & ((d < 0) | (d >= dst_count))
    if CHECK == CHECK_OFF:
        write = live & (s >= 0) & (d >= 0)
        if OFF_BOUND:   # the interpreter: never copy past a pool (host memory)
            write = write & (s < src_count) & (d < dst_count)
        bad = tl.zeros_like(s) != 0
    else:
        bad = bad_s | bad_d
        write = live & (bad == 0)
    kind = tl.where(bad_s, 16, 17)          # kvwrite.errors.KIND_SRC_PAGE / KIND_DST_PAGE
    target = tl.where(bad_s, s, d)
    limit = tl.where(bad_s, src_count, dst_count)
    check_or_record(err_ptr, pair, target, bad, target, limit, kind, unit_rows, OP, CHECK,
                    (tl.program_id(1) == 0) & (tl.program_id(2) == 0))
    end_call(err_ptr, CHECK)
    if tl.sum(write.to(tl.int32), axis=0) > 0:
        s0 = tl.sum(tl.where(write, s, 0), axis=0)
        d0 = tl.sum(tl.where(write, d, 0), axis=0)
        src = (s0 // src_factor) * s_sp + (s0 % src_factor) * unit_rows * s_sr
        dst = (d0 // dst_factor) * d_sp + (d0 % dst_factor) * unit_rows * d_sr
        q = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
        r = (q // heads).to(tl.int64)
        h = (q % heads).to(tl.int64)
        c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)
        mask = (q < n_runs)[:, None] & (c < feat)[None, :]
        x = tl.load(src_ptr + (src + r * s_sr + h * s_sh)[:, None] + c[None, :], mask=mask)
        tl.store(dst_ptr + (dst + r * d_sr + h * d_sh)[:, None] + c[None, :], x, mask=mask)


@triton.jit
def gather_kernel(cache_ptr, out_ptr, addr, heads, feat, c_sp, c_sr, c_sh, o_sn,
                  CHECK: tl.constexpr, OP: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (t, c): BLOCK_T tokens, columns [c * BLOCK_C, ...) of the [heads * feat] row; a
    token not read (padding, skipped, bad) gets a zero row."""
    tok, page, offset, write = claim_tile(addr, BLOCK_T, CHECK, OP)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    cmask = cols < heads * feat
    h = (cols // feat).to(tl.int64)
    f = cols % feat
    base = page * c_sp + offset * c_sr
    x = tl.load(cache_ptr + base[:, None] + (h * c_sh + f)[None, :], mask=write[:, None] & cmask[None, :],
                other=0)
    tmask = tok < addr.n_tokens
    tl.store(out_ptr + tok.to(tl.int64)[:, None] * o_sn + cols[None, :], x,
             mask=tmask[:, None] & cmask[None, :])


@triton.jit
def slot_mapping_kernel(table_ptr, batch_ptr, pos_ptr, out_ptr, err_ptr, n_tokens, rows, width,
                        t_sr, page_size, num_pages, CHECK: tl.constexpr, OP: tl.constexpr,
                        BLOCK: tl.constexpr):
    """slot = block_table[b, pos // page_size] * page_size + pos % page_size, or -1 (padding,
    a row or block the table does not have, a negative page; assert/guard: a page past the
    pool). The reference is kvwrite.reference.pages.slot_mapping."""
    tok = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tmask = tok < n_tokens
    b = tl.load(batch_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    pos = tl.load(pos_ptr + tok, mask=tmask, other=-1).to(tl.int64)
    live = tmask & (b != -1) & (pos != -1)
    blk, off = floor_divmod(pos, page_size)
    in_row = (b >= 0) & (b < rows)
    in_width = (blk >= 0) & (blk < width)
    bad_row = live & (in_row == 0)
    bad_blk = live & in_row & (in_width == 0)
    live = live & in_row & in_width
    page = tl.load(table_ptr + b * t_sr + blk, mask=live, other=-1).to(tl.int64)
    if CHECK == CHECK_OFF:
        bad_page = tl.zeros_like(page) != 0
        write = live & (page >= 0)
    else:
        bad_page = live & ((page < 0) | (page >= num_pages))
        write = live & (bad_page == 0)
    slot = page * page_size + off
    tl.store(out_ptr + tok, tl.where(write, slot, -1), mask=tmask)
    if CHECK != CHECK_OFF:
        bad = bad_row | bad_blk | bad_page
        kind = tl.where(bad_row, 18, tl.where(bad_blk, 19, 20))   # kvwrite.errors.KIND_BLOCK_*
        target = tl.where(bad_row, b, tl.where(bad_blk, blk, page))
        limit = tl.where(bad_row, rows, tl.where(bad_blk, width, num_pages))
        loc = tl.where(bad_page, slot, -1)
        check_or_record(err_ptr, tok, loc, bad, target, limit, kind, page_size, OP, CHECK, True)
        record_table(err_ptr, tok, bad, b, pos, tl.where(bad_row, -1, blk), tl.where(bad_page, page, -1),
                     CHECK, True)
    end_call(err_ptr, CHECK)


def _word(*tensors_and_ints) -> int:
    """Bytes per moved word: the widest of 4 / 2 / 1 dividing every byte count given."""
    bits = 0
    for v in tensors_and_ints:
        bits |= int(v)
    return 4 if bits % 4 == 0 else 2 if bits % 2 == 0 else 1


def _words(t, word: int):
    """`t` (canonical [pages, rows, H, F]) as a view of `word`-byte integers, and its strides in words."""
    import torch

    dtype = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[word]
    es = t.element_size()
    v = t.view(torch.uint8) if es > 1 or t.dtype != torch.uint8 else t
    v = v.view(dtype)
    return v, [s * es // word for s in t.stride()[:3]]


def copy_pages(a) -> None:
    """Launch copy_pages_kernel for a validated `kvwrite.ops.pages.CopyPages`."""
    from kvwrite.errors import op_code
    from kvwrite.kernels._launch import launch
    from kvwrite.reference.pages import check_pairs

    s, d = a.src, a.dst
    es = s.element_size()
    word = _word(s.shape[3] * es, *(x * es for x in s.stride()[:3]), *(x * es for x in d.stride()[:3]),
                 s.data_ptr(), d.data_ptr())
    sv, ss = _words(s, word)
    dv, ds = _words(d, word)
    heads, feat, rows = s.shape[2], s.shape[3] * es // word, a.src_units.rows
    runs = rows * heads
    if all(st[2] == feat or heads == 1 for st in (ss, ds)) and all(
            st[1] == heads * feat or rows == 1 for st in (ss, ds)):
        heads, feat, runs = 1, runs * feat, 1      # a unit is one run on both sides
    block_c = min(triton.next_power_of_2(max(feat, 1)), 4096)
    block_t = max(1, min(4096 // block_c, triton.next_power_of_2(runs)))
    grid = (a.n, triton.cdiv(runs, block_t), triton.cdiv(feat, block_c))
    err = a.check.errors if a.check.errors is not None else a.src_pages
    kwargs = dict(src_ptr=sv, dst_ptr=dv, sid_ptr=a.src_pages, did_ptr=a.dst_pages, err_ptr=err,
                  n_pairs=a.n, src_count=a.src_units.count, dst_count=a.dst_units.count,
                  src_factor=a.src_units.factor, dst_factor=a.dst_units.factor, unit_rows=rows,
                  n_runs=runs, heads=heads, feat=feat, s_sp=ss[0], s_sr=ss[1], s_sh=ss[2], d_sp=ds[0], d_sr=ds[1],
                  d_sh=ds[2], CHECK=a.check.code, OP=op_code(a.check.op), BLOCK_T=block_t, BLOCK_C=block_c)
    launch(copy_pages_kernel, grid, a, lambda: check_pairs(a.src_pages, a.dst_pages, a.src_units, a.dst_units,
                                                           a.check), device=d.device, check_first=True, **kwargs)


def gather(a) -> None:
    """Launch gather_kernel for a validated `kvwrite.ops.pages.Gather`."""
    from kvwrite.kernels._launch import launch, loc_args, tiles

    c, o = a.cache, a.out
    es = c.element_size()
    word = _word(c.shape[3] * es, *(x * es for x in c.stride()[:3]), o.stride(0) * es, c.data_ptr(),
                 o.data_ptr())
    cv, cs = _words(c, word)
    ov, os_ = _words(o.unsqueeze(1), word)
    feat = c.shape[3] * es // word
    n, h = a.locs.n, c.shape[2]
    block_t, block_c = tiles(n, h * feat)
    grid = (triton.cdiv(n, block_t), triton.cdiv(h * feat, block_c))
    launch(gather_kernel, grid, a, check_first=True, cache_ptr=cv, out_ptr=ov, heads=h, feat=feat,
           c_sp=cs[0], c_sr=cs[1], c_sh=cs[2], o_sn=os_[0], BLOCK_T=block_t, BLOCK_C=block_c, **loc_args(a))


def slot_mapping(a) -> None:
    """Launch slot_mapping_kernel for a validated `kvwrite.ops.pages.SlotMapping`."""
    from kvwrite.errors import op_code
    from kvwrite.kernels._launch import launch
    from kvwrite.reference import pages as ref

    n = a.n
    block = min(triton.next_power_of_2(max(n, 1)), 1024)
    bt = a.block_table
    err = a.check.errors if a.check.errors is not None else a.out
    launch(slot_mapping_kernel, (triton.cdiv(n, block),), a, lambda: ref.slot_mapping(a), device=bt.device,
           check_first=True, table_ptr=bt, batch_ptr=a.batch_indices, pos_ptr=a.positions, out_ptr=a.out,
           err_ptr=err, n_tokens=n, rows=bt.shape[0], width=bt.shape[1],
           t_sr=bt.stride(0) if bt.shape[0] > 1 else 0, page_size=a.geometry.pool_page_size,
           num_pages=a.geometry.num_pages, CHECK=a.check.code, OP=op_code(a.check.op), BLOCK=block)


def variants():
    """(name, kernel, pointer dtypes, constexprs) of every variant, for compile_check."""
    import torch

    for check in (0, 1, 2):
        for word in (torch.int32, torch.uint8):
            ptrs = dict(src_ptr=word, dst_ptr=word, sid_ptr=torch.int64, did_ptr=torch.int64, err_ptr=torch.int64)
            yield f"copy_pages-{str(word)[6:]}", copy_pages_kernel, ptrs, dict(CHECK=check, OP=9, BLOCK_T=1,
                                                                               BLOCK_C=4096)
        ptrs = dict(cache_ptr=torch.int32, out_ptr=torch.int32, loc_ptr=torch.int64, err_ptr=torch.int64,
                    loc_map_ptr=torch.int64)
        yield "gather-int32", gather_kernel, ptrs, dict(HAS_MAP=False, HAS_DCP=0, CHECK=check, OP=10,
                                                        BLOCK_T=4, BLOCK_C=1024)
        ptrs = dict(table_ptr=torch.int32, batch_ptr=torch.int32, pos_ptr=torch.int32, out_ptr=torch.int64,
                    err_ptr=torch.int64)
        yield "slot_mapping-int32", slot_mapping_kernel, ptrs, dict(CHECK=check, OP=11, BLOCK=1024)

