"""Device functions every kvwrite Triton kernel shares: addressing and guard records.

`Addr` is a store's addressing, one kernel argument; `claim_tile` / `claim_rows` / `claim` the
prologue that turns it into (page, offset, write). `resolve_locs` is the one place that
implements padding, SWA translation, DCP sharding and the bounds check; `resolve_table` the
page-table addressing (batch, position -> page, row); `check_or_record` asserts or writes the
packed-min record described in `kvwrite.errors`.
"""
from typing import NamedTuple

import triton
import triton.language as tl

from kvwrite import errors as _e
from kvwrite.backend import triton_interpreting


def block_tokens(n: int, row_elems: int, gpu_elems: int = 4096) -> int:
    """BLOCK_T, tokens a program: about `gpu_elems` elements a program on a GPU; under the
    interpreter as few programs as memory allows (≈0.45 ms a program)."""
    per = 65536 if triton_interpreting() else gpu_elems
    return max(1, min(triton.next_power_of_2(max(n, 1)), per // max(row_elems, 1), 256))

class Addr(NamedTuple):
    """One store's addressing, one kernel argument (like FlashInfer's paged_kv_t): where its
    tokens go and the record of the ones that cannot. A None member is a compile-time None (the
    feature is off); `dcp` is a constexpr. Built by `kernels._launch.addr` from a validated call."""
    loc: object              # int tensor [n]: the tokens' locs (page-table mode: positions)
    loc_map: object          # SWA loc -> row map, or None
    errors: object           # the guard record (kvwrite.errors), or None (off / assert)
    n_tokens: int
    capacity: int            # rows of the local pool
    page_size: int           # the pool's rows a page
    map_len: int             # loc_map's length (0 without one)
    dcp_rank: int
    dcp_size: int
    dcp: object              # tl.constexpr: 0 no DCP, 1 per token, DCP_PAGE per page
    batch_indices: object    # page table (kvwrite.PageTable), or None: loc addressing
    kv_indices: object
    kv_indptr: object
    num_batches: int
    num_indices: int


CHECK_OFF = tl.constexpr(0)
CHECK_ASSERT = tl.constexpr(1)
CHECK_GUARD = tl.constexpr(2)
DCP_PAGE = tl.constexpr(2)  # Addr.dcp of page-granular DCP sharding (0 none, 1 per token)
# Off mode under the interpreter also skips a row past the pool (like the cpu backend): there a
# store past the cache tensor writes host memory. Compiled for a GPU it is False: no cost.
OFF_BOUND = tl.constexpr(triton_interpreting())

_COUNT = tl.constexpr(_e.COUNT)
_LOC_LO = tl.constexpr(_e.LOC_LO)
_LOC_HI = tl.constexpr(_e.LOC_HI)
_TARGET_LO = tl.constexpr(_e.TARGET_LO)
_TARGET_HI = tl.constexpr(_e.TARGET_HI)
_LIMIT_LO = tl.constexpr(_e.LIMIT_LO)
_LIMIT_HI = tl.constexpr(_e.LIMIT_HI)
_PPS = tl.constexpr(_e.POOL_PAGE_SIZE)
_META = tl.constexpr(_e.META)
_KIND_POOL = tl.constexpr(_e.KIND_POOL)
_KIND_LOC_MAP = tl.constexpr(_e.KIND_LOC_MAP)
_KIND_BATCH = tl.constexpr(_e.KIND_BATCH)
_KIND_TABLE_SLOT = tl.constexpr(_e.KIND_TABLE_SLOT)
_KIND_TABLE_PAGE = tl.constexpr(_e.KIND_TABLE_PAGE)
_KIND_POSITION = tl.constexpr(_e.KIND_POSITION)
_BATCH = tl.constexpr(_e.BATCH)
_POSITION = tl.constexpr(_e.POSITION)
_TABLE_SLOT = tl.constexpr(_e.TABLE_SLOT)
_TABLE_PAGE = tl.constexpr(_e.TABLE_PAGE)
_OWNER = tl.constexpr(_e.OWNER)
_EPOCH = tl.constexpr(_e.EPOCH)
_DONE = tl.constexpr(_e.DONE)
_EMPTY = tl.constexpr(_e.EMPTY)


@triton.jit
def resolve_locs(a, tok, tmask, CHECK: tl.constexpr):
    """Map each token's loc to the local row it writes (`a`: the call's `Addr`).

    Composition order (the reference `kvwrite.reference._locs.resolve` mirrors it):
      1. padding: loc == -1 is skipped;
      2. SWA (a.loc_map): loc must lie in [0, map_len) (else KIND_LOC_MAP; skipped in off mode
         too, so loc_map is never read out of bounds), then row = loc_map[loc]; a mapped -1 is
         skipped;
      3. DCP (a.dcp): the (mapped) virtual row belongs to rank row % dcp_size and lives at
         local row row // dcp_size; other ranks' tokens are skipped. a.dcp == DCP_PAGE
         (DeepSeek V4 stores) shards by page instead: virtual page p = row // page_size
         belongs to rank p % dcp_size as its local page p // dcp_size;
      4. bounds: the local row must lie in [0, capacity) (else KIND_POOL; off mode skips only
         negative rows and does not check the upper bound, except under the interpreter:
         OFF_BOUND).
    Returns (loc, row, write, bad, target, limit, kind): `write` masks the tokens to store,
    `bad` the out-of-range ones (never written); the record keeps the caller's virtual `loc`.
    """
    loc = tl.load(a.loc + tok, mask=tmask, other=-1).to(tl.int64)
    bad = tl.zeros_like(loc) != 0
    kind = tl.zeros_like(loc) + _KIND_POOL
    live = tmask & (loc != -1)
    row = loc
    if a.loc_map is not None:
        in_map = (loc >= 0) & (loc < a.map_len)
        if CHECK != CHECK_OFF:
            bad = live & (in_map == 0)
            kind = tl.where(bad, _KIND_LOC_MAP, kind)
        live = live & in_map  # off mode too: never read loc_map out of bounds, skip the token
        row = tl.load(a.loc_map + loc, mask=live, other=-1).to(tl.int64)
        live = live & (row != -1)
    if a.dcp == DCP_PAGE:
        vpage = row // a.page_size
        live = live & ((row < 0) | (vpage % a.dcp_size == a.dcp_rank))
        row = tl.where(row >= 0, (vpage // a.dcp_size) * a.page_size + row % a.page_size, row)
    elif a.dcp:
        owned = (row < 0) | (row % a.dcp_size == a.dcp_rank)
        live = live & owned
        row = tl.where(row >= 0, row // a.dcp_size, row)
    if CHECK == CHECK_OFF:
        write = live & (row >= 0)
        if OFF_BOUND:
            write = write & (row < a.capacity)
    else:
        oob = live & ((row < 0) | (row >= a.capacity))
        bad = bad | oob
        write = live & (oob == 0)
    target = tl.where(kind == _KIND_LOC_MAP, loc, row)
    limit = tl.where(kind == _KIND_LOC_MAP, a.map_len, a.capacity)
    return loc, row, write, bad, target, limit, kind


@triton.jit
def owns_record(err_ptr):
    """Whether this call may write the record's fields: OWNER is claimed (compare-and-swap from
    EMPTY) with this call's EPOCH, or already holds it (see kvwrite.errors). Idempotent."""
    epoch = tl.load(err_ptr + _EPOCH, volatile=True)
    empty = tl.zeros_like(epoch) + _EMPTY
    owner = tl.atomic_cas(err_ptr + _OWNER, empty, epoch)
    return (owner == empty) | (owner == epoch)


@triton.jit
def end_call(err_ptr, CHECK: tl.constexpr):
    """Guard mode, once per program after its record: count the program in DONE; the call's last
    program resets DONE and advances EPOCH, so the next call on the buffer has its own epoch."""
    if CHECK == CHECK_GUARD:
        tl.debug_barrier()  # every lane of this program has recorded (and read EPOCH)
        total = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
        done = tl.atomic_add(err_ptr + _DONE, 1)
        if done == total - 1:
            tl.atomic_xchg(err_ptr + _DONE, 0)
            tl.atomic_add(err_ptr + _EPOCH, 1)


@triton.jit
def check_or_record(err_ptr, tok, loc, bad, target, limit, kind, pool_page_size,
                    OP: tl.constexpr, CHECK: tl.constexpr, record):
    """`assert` mode: fail if any token is bad. `guard` mode (when RECORD): fold the bad tokens
    into the packed-min error record (their fields only if this call owns the record; COUNT
    always). Both run before any store of the calling program."""
    if CHECK == CHECK_ASSERT:
        assert tl.sum(bad.to(tl.int32), axis=0) == 0, "kvwrite: store loc outside the pool (check=assert)"
    if CHECK == CHECK_GUARD:
        if record:
            n_bad = tl.sum(bad.to(tl.int64), axis=0)
            if n_bad > 0:
                bad = bad & owns_record(err_ptr)
                base = tok.to(tl.int64) << 32
                lo = 0xFFFFFFFF
                zero = tl.zeros_like(base)
                tl.atomic_min(err_ptr + _LOC_LO + zero, base | (loc & lo), mask=bad)
                tl.atomic_min(err_ptr + _LOC_HI + zero, base | ((loc >> 32) & lo), mask=bad)
                tl.atomic_min(err_ptr + _TARGET_LO + zero, base | (target & lo), mask=bad)
                tl.atomic_min(err_ptr + _TARGET_HI + zero, base | ((target >> 32) & lo), mask=bad)
                tl.atomic_min(err_ptr + _LIMIT_LO + zero, base | (limit & lo), mask=bad)
                tl.atomic_min(err_ptr + _LIMIT_HI + zero, base | ((limit >> 32) & lo), mask=bad)
                tl.atomic_min(err_ptr + _PPS + zero, base | (zero + pool_page_size), mask=bad)
                tl.atomic_min(err_ptr + _META + zero, base | (OP | (kind << 8)), mask=bad)
                tl.atomic_add(err_ptr + _COUNT, n_bad)


@triton.jit
def floor_divmod(x, n):
    """(x // n, x % n) rounded to minus infinity whatever the integer division rounds to (a
    negative position lies on a negative page)."""
    q = x // n
    r = x - q * n
    neg = r < 0
    return tl.where(neg, q - 1, q), tl.where(neg, r + n, r)


@triton.jit
def resolve_table(a, tok, tmask, CHECK: tl.constexpr):
    """Page-table addressing (FlashInfer's): token i writes row positions[i] % page_size of page
    kv_indices[kv_indptr[b] + positions[i] // page_size], b = batch_indices[i] (floor division;
    page_size = the pool's; `a.loc` holds the positions). The reference
    `kvwrite.reference._locs.resolve_table` mirrors it.

      1. batch: b must lie in [0, n_batch) (else KIND_BATCH); off mode skips such a token too,
         so kv_indptr is never read out of bounds;
      2. slot: kv_indptr[b] + positions[i] // page_size must lie in [kv_indptr[b],
         min(kv_indptr[b + 1], n_table)) (else KIND_TABLE_SLOT); off mode checks only
         [0, n_table), so kv_indices is never read out of bounds, and skips the token;
      3. page: kv_indices[slot] must lie in [0, num_pages) (else KIND_TABLE_PAGE); off mode
         skips only a negative page, like a negative row (and, under the interpreter, a page
         past the pool: OFF_BOUND).
    Returns (position, loc, page, offset, write, bad, target, limit, kind, batch, slot,
    table_page); `loc` is the row a KIND_TABLE_PAGE token would have written (else -1).
    """
    pool_page_size = a.page_size
    n_batch = a.num_batches
    n_table = a.num_indices
    pos = tl.load(a.loc + tok, mask=tmask, other=0).to(tl.int64)
    b = tl.load(a.batch_indices + tok, mask=tmask, other=0).to(tl.int64)
    q, r = floor_divmod(pos, pool_page_size)
    in_batch = (b >= 0) & (b < n_batch)
    bad = tl.zeros_like(pos) != 0
    kind = tl.zeros_like(pos) + _KIND_TABLE_PAGE
    if CHECK != CHECK_OFF:
        bad = tmask & (in_batch == 0)
        kind = tl.where(bad, _KIND_BATCH, kind)
    live = tmask & in_batch
    start = tl.load(a.kv_indptr + b, mask=live, other=0).to(tl.int64)
    slot = start + q
    ok = (slot >= 0) & (slot < n_table)
    hi = tl.zeros_like(pos) + n_table
    if CHECK != CHECK_OFF:
        end = tl.load(a.kv_indptr + b + 1, mask=live, other=0).to(tl.int64)
        hi = tl.minimum(end, hi)
        ok = ok & (slot >= start) & (slot < hi)
        bad_slot = live & (ok == 0)
        bad = bad | bad_slot
        kind = tl.where(bad_slot, _KIND_TABLE_SLOT, kind)
    live = live & ok
    page = tl.load(a.kv_indices + slot, mask=live, other=-1).to(tl.int64)
    num_pages = a.capacity // pool_page_size
    if CHECK == CHECK_OFF:
        write = live & (page >= 0)
        if OFF_BOUND:
            write = write & (page < num_pages)
    else:
        oob = live & ((page < 0) | (page >= num_pages))
        bad = bad | oob
        write = live & (oob == 0)
    is_batch = kind == _KIND_BATCH
    is_page = kind == _KIND_TABLE_PAGE
    target = tl.where(is_batch, b, tl.where(is_page, page, slot))
    limit = tl.where(is_batch, n_batch, tl.where(is_page, num_pages, hi))
    loc = tl.where(is_page, page * pool_page_size + r, -1)
    return (pos, loc, page, r, write, bad, target, limit, kind, b, tl.where(is_batch, -1, slot),
            tl.where(is_page, page, -1))


@triton.jit
def record_table(err_ptr, tok, bad, batch, position, slot, page, CHECK: tl.constexpr, record):
    """Guard mode: the page-table context slots of the packed-min record (see kvwrite.errors)."""
    if CHECK == CHECK_GUARD:
        if record:
            if tl.sum(bad.to(tl.int32), axis=0) > 0:
                bad = bad & owns_record(err_ptr)
                base = tok.to(tl.int64) << 32
                lo = 0xFFFFFFFF
                zero = tl.zeros_like(base)
                tl.atomic_min(err_ptr + _BATCH + zero, base | (batch & lo), mask=bad)
                tl.atomic_min(err_ptr + _POSITION + zero, base | (position & lo), mask=bad)
                tl.atomic_min(err_ptr + _TABLE_SLOT + zero, base | (slot & lo), mask=bad)
                tl.atomic_min(err_ptr + _TABLE_PAGE + zero, base | (page & lo), mask=bad)


@triton.jit
def claim(a, tok, CHECK: tl.constexpr, OP: tl.constexpr, record, pos_ok=None, pos=None, max_pos=0):
    """Resolve the tokens' addresses (`a.kv_indices`: page table, `resolve_table`; else locs,
    `resolve_locs`), assert or record the bad ones (`record`: this program owns the record for
    its tokens) and return (page, offset, write). With `pos_ok` (the fused RoPE stores) a
    position outside [0, max_pos) is a KIND_POSITION error, never written (every mode; the
    reference `resolve_with_positions`)."""
    tmask = tok < a.n_tokens
    if a.kv_indices is not None:
        tpos, loc, page, offset, write, bad, target, limit, kind, batch, slot, tpage = resolve_table(
            a, tok, tmask, CHECK)
    else:
        loc, row, write, bad, target, limit, kind = resolve_locs(a, tok, tmask, CHECK)
        if pos_ok is not None:  # (page, offset) here, as the fused stores were tuned with
            page, offset = row // a.page_size, row % a.page_size
    if pos_ok is not None:
        write = write & pos_ok
        if CHECK != CHECK_OFF:
            bad_pos = tmask & (pos_ok == 0)
            bad = bad | bad_pos
            kind = tl.where(bad_pos, _KIND_POSITION, kind)
            target = tl.where(bad_pos, pos, target)
            limit = tl.where(bad_pos, max_pos, limit)
    check_or_record(a.errors, tok, loc, bad, target, limit, kind, a.page_size, OP, CHECK, record)
    if a.kv_indices is not None:
        record_table(a.errors, tok, bad, batch, tpos, slot, tpage, CHECK, record)
    elif pos_ok is None:  # after the record: the division's results are not live across it
        page, offset = row // a.page_size, row % a.page_size
    return page, offset, write


@triton.jit
def claim_rows(a, tok, CHECK: tl.constexpr, OP: tl.constexpr, record):
    """Every store kernel's prologue, called once per program: `claim`, then count the program
    in the record's DONE (`end_call`)."""
    page, offset, write = claim(a, tok, CHECK, OP, record)
    end_call(a.errors, CHECK)
    return page, offset, write


@triton.jit
def claim_tile(a, BLOCK_T: tl.constexpr, CHECK: tl.constexpr, OP: tl.constexpr):
    """The prologue of program (t, c, ...) of a store: tokens [t * BLOCK_T, ...) claimed
    (`claim_rows`), column program 0 owning their record. Returns (tok, page, offset, write)."""
    pid_t = tl.program_id(0)
    pid_c = tl.program_id(1)
    tok = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    page, offset, write = claim_rows(a, tok, CHECK, OP, pid_c == 0)
    return tok, page, offset, write


# The special-value policy of every quantising op (README "Special values"; the torch twin is
# kvwrite.reference.quant, the C++ one csrc/kvwrite/fp8.h + quant.h):
#   inputs whose magnitude is an fp32 subnormal (< 2**-126) are read as a zero of the same sign
#   (`daz`), so a GPU's flush-to-zero and a CPU give the same bytes; NaN -> the format's one NaN
#   code (0x7F; e4m3fnuz 0x80), whatever its sign; +-inf and finite overflow -> +-max;
#   -0 -> -0 (0x80; e4m3fnuz has none: 0x00); block scales come from the finite values only
#   (`finite_abs`).
FLT_TINY = tl.constexpr(1.1754943508222875e-38)   # 2**-126, torch.finfo(torch.float32).tiny
FLT_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def daz(x):
    """fp32 `x` with fp32-subnormal magnitudes replaced by a zero of the same sign (bit ops:
    the same on a GPU that flushes subnormals and on a CPU that does not)."""
    x = x.to(tl.float32)
    bits = x.to(tl.int32, bitcast=True)
    zero = (bits & -2147483648).to(tl.float32, bitcast=True)
    return tl.where((bits & 0x7F800000) == 0, zero, x)


@triton.jit
def finite_abs(x):
    """|x| where x is finite, else 0: what a block's amax is taken over (NaN and +-inf are
    excluded, so one special value never changes the scale of its neighbours)."""
    ax = tl.abs(x.to(tl.float32))
    return tl.where(ax <= FLT_MAX, ax, 0.0)


@triton.jit
def fp8_bits(x, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """The fp8 code (int32 in [0, 256)) of saturate(x) for a format with MANT mantissa bits,
    smallest normal exponent EMIN and finite max FMAX: round to nearest, ties to even; NaN ->
    the format's NaN code, +-inf -> +-FMAX, -0 -> 0x80. FMAX == 240 is e4m3fnuz (bias 8, NaN
    0x80, no -0: a result that rounds to zero is 0x00).

    Built from fp32 bit arithmetic, not a cast: the result is identical on every backend (the
    interpreter's fp8 cast misrounds), and sm_80, which has no e4m3 type, stores it as a byte.
    NaN is tested before the clamp (a GPU's min/max would turn it into -FMAX).
    """
    FNUZ: tl.constexpr = FMAX == 240.0
    x = x.to(tl.float32)
    is_nan = x != x
    x = tl.where(is_nan, 0.0, x)
    x = tl.minimum(tl.maximum(x, -FMAX), FMAX)
    xbits = x.to(tl.int32, bitcast=True)
    ax = tl.abs(x)
    bits = xbits & 0x7FFFFFFF
    drop: tl.constexpr = 23 - MANT
    half: tl.constexpr = (1 << (drop - 1)) - 1
    normal = (bits + half + ((bits >> drop) & 1)) >> drop  # RNE; a carry bumps the exponent
    bias: tl.constexpr = 1 - EMIN
    normal = normal - ((127 - bias) << MANT)
    magic: tl.constexpr = 2.0 ** (EMIN - MANT + 23)  # fp32 add rounds to the subnormal step
    tiny = tl.minimum(ax, 2.0 ** EMIN)
    subnormal = (((tiny + magic) - magic) * (2.0 ** (MANT - EMIN))).to(tl.int32)
    code = tl.where(ax < 2.0 ** EMIN, subnormal, normal)
    if FNUZ:
        code = tl.where(code == 0, 0, code | ((xbits >> 24) & 0x80))
        return tl.where(is_nan, 0x80, code)
    else:
        code = code | ((xbits >> 24) & 0x80)
        return tl.where(is_nan, 0x7F, code)


@triton.jit
def fp8_quant(x, scale, FMAX: tl.constexpr, MANT: tl.constexpr, EMIN: tl.constexpr):
    """The fp8 code of saturate(daz(x) / scale) (division rounded to nearest, as torch's)."""
    xs = daz(x)
    return fp8_bits(tl.div_rn(xs, tl.zeros_like(xs) + scale), FMAX, MANT, EMIN)


@triton.jit
def store_le_bytes(dst_ptr, addr, bits, mask, NBYTES: tl.constexpr):
    """Store the low NBYTES bytes of int32 `bits`, little-endian, at byte addresses `addr`."""
    for i in tl.static_range(NBYTES):
        tl.store(dst_ptr + addr + i, ((bits >> (8 * i)) & 0xFF).to(tl.uint8), mask=mask)
