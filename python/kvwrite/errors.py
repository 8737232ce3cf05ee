"""Guard-mode error records: a tiny int64 device buffer the kernels fill without a host sync.

Layout and protocol (every backend; csrc/kvwrite/record.h): COUNT counts bad tokens; every field
slot holds a packed key `token_index << 32 | uint32 chunk` updated with an atomic min, so each
holds the call's lowest bad token's chunk (at most 2**31 - 1 tokens a call). Only one call may
write the fields (token indices of two calls collide): EPOCH counts the calls that used the buffer
(the last program of a call, or the host after a CPU call, adds one), the first bad token claims
OWNER with its call's epoch (CAS from EMPTY) and a bad token folds its fields only when OWNER holds
its epoch; DONE counts a running call's finished programs. Calls on different streams that share
a buffer must be ordered (they would share an epoch). Duplicate rows, reading: docs/checks.md.
"""
from __future__ import annotations

import atexit
import sys
import threading

import torch

from kvwrite.facts import OPS, READ_OPS, op_code  # noqa: F401  (op codes: kvwrite.facts)

# Slot indices. Each 64-bit field takes two packed slots (low, high 32 bits).
COUNT = 0
LOC_LO, LOC_HI = 1, 2            # the caller's loc (virtual loc under DCP)
TARGET_LO, TARGET_HI = 3, 4      # the index that was out of range
LIMIT_LO, LIMIT_HI = 5, 6        # ... and the bound it was checked against: [0, limit)
POOL_PAGE_SIZE = 7               # rows per pool page of the target pool (1 for a map lookup)
META = 8                         # op code | kind << 8
# Page-table context (KIND_BATCH / KIND_TABLE_SLOT / KIND_TABLE_PAGE records only), one packed
# slot each: the low 32 bits, read back sign-extended (FlashInfer's tables are int32; the exact
# out-of-range index is also in TARGET, 64-bit).
BATCH = 9                        # batch_indices[i]
POSITION = 10                    # positions[i]
TABLE_SLOT = 11                  # kv_indptr[b] + positions[i] // page_size (-1: not reached)
TABLE_PAGE = 12                  # kv_indices[slot] (-1: not reached)
OWNER = 13                       # epoch of the call whose fields the record holds (EMPTY: none)
EPOCH = 14                       # calls completed since the reset (plain counter)
DONE = 15                        # programs of the running call that have finished (plain counter)
NUM_SLOTS = 16
EMPTY = (1 << 63) - 1            # initial value of every packed slot (and of OWNER)
FIELDS = (LOC_LO, LOC_HI, TARGET_LO, TARGET_HI, LIMIT_LO, LIMIT_HI, POOL_PAGE_SIZE, META)
TABLE_FIELDS = (BATCH, POSITION, TABLE_SLOT, TABLE_PAGE)
MAX_TOKENS = (1 << 31) - 1

# What was out of range (docs/checks.md's table).
KIND_POOL = 0        # the (local, translated) loc against the pool capacity
KIND_LOC_MAP = 1     # the loc against the SWA loc_map length (lookup)
# Page-table addressing (`kvwrite.PageTable`): target/limit are
KIND_BATCH = 2       # the batch index against [0, len(kv_indptr) - 1)
KIND_TABLE_SLOT = 3  # the page-table slot against batch b's slots [kv_indptr[b], min(kv_indptr[b+1], len(kv_indices)))
KIND_TABLE_PAGE = 4  # the page kv_indices[slot] against the pool's pages [0, num_pages)
TABLE_KINDS = (KIND_BATCH, KIND_TABLE_SLOT, KIND_TABLE_PAGE)
KIND_POSITION = 5    # rope_store_*: the token's position against the cos/sin cache (max_position)
# Page moves (kvwrite.ops.pages), numbered apart from the store kinds: a pair's src / dst unit
KIND_SRC_PAGE = 16
KIND_DST_PAGE = 17
KIND_BLOCK_ROW = 18     # slot_mapping: the batch row, the block index, the page of a block table
KIND_BLOCK_INDEX = 19
KIND_BLOCK_PAGE = 20
KIND_DUPLICATE = 6      # a row (dst unit) a lower token writes: TARGET the row, LIMIT that token
PAGE_KINDS = (KIND_SRC_PAGE, KIND_DST_PAGE)
BLOCK_KINDS = (KIND_BLOCK_ROW, KIND_BLOCK_INDEX, KIND_BLOCK_PAGE)


class OutOfBoundsWrite(RuntimeError):
    """A store would have written outside its pool. Raised by `ErrorBuffer.raise_if_any`
    (guard mode) and by the `assert` mode on CPU backends."""

    # the fields a subclass's record may leave unset (page-table context, or all of them)
    op = token_index = loc = page = num_pages = pool_page_size = kind = target = limit = None
    batch = position = table_slot = table_page = None

    def __init__(self, op: str, token_index: int, loc: int, page: int | None, num_pages: int | None,
                 pool_page_size: int, count: int, kind: int = KIND_POOL,
                 target: int | None = None, limit: int | None = None, *,
                 batch: int | None = None, position: int | None = None,
                 table_slot: int | None = None, table_page: int | None = None) -> None:
        self.op, self.token_index, self.loc, self.page = op, token_index, loc, page
        self.num_pages, self.pool_page_size, self.count, self.kind = num_pages, pool_page_size, count, kind
        self.target = loc if target is None else target
        self.limit = num_pages * pool_page_size if limit is None else limit
        # page-table addressing (None where the resolver did not get that far)
        self.batch, self.position, self.table_slot, self.table_page = batch, position, table_slot, table_page
        super().__init__(self._message())

    def _table_message(self, many: str) -> str:
        who = f"{self.op}: {many}token {self.token_index} (page table: batch {self.batch}, position {self.position}"
        if self.kind == KIND_BATCH:
            return (f"{who}) has batch index {self.batch}, outside [0, {self.limit}) = "
                    f"[0, len(kv_indptr) - 1); batch_indices must name a request of kv_indptr")
        if self.kind == KIND_TABLE_SLOT:
            start = self.table_slot - self.position // self.pool_page_size
            return (f"{who}) reads page-table slot {self.table_slot} = kv_indptr[{self.batch}] + "
                    f"{self.position} // {self.pool_page_size}, outside [{start}, {self.limit}): batch "
                    f"{self.batch}'s slots [kv_indptr[b], kv_indptr[b + 1]) within kv_indices; the "
                    f"position is past the pages allocated to its request")
        return (f"{who}, slot {self.table_slot}) maps to page {self.table_page} = "
                f"kv_indices[{self.table_slot}], but the pool has pages [0, {self.limit}) of "
                f"{self.pool_page_size} rows; kv_indices holds a page the pool does not have")

    def _page_message(self) -> str:
        """copy_pages / slot_mapping records (KIND_SRC_PAGE ... KIND_BLOCK_PAGE)."""
        if self.kind in PAGE_KINDS:
            many = f"{self.count} bad page id(s); the first is " if self.count > 1 else ""
            side = "src" if self.kind == KIND_SRC_PAGE else "dst"
            what = "row" if self.op == "move_rows" else "page"
            unit = (f" (counted in units of {self.pool_page_size} rows, the smaller pool's page)"
                    if self.op == "copy_pages" else "")
            return (f"{self.op}: {many}pair {self.token_index} names {side} {what} {self.target}, but "
                    f"{side} has {what}s [0, {self.limit}){unit}; nothing was copied for that pair"
                    + ("; padding must be -1" if self.target < 0 else ""))
        many = f"{self.count} bad token(s); the first is " if self.count > 1 else ""
        who = f"{self.op}: {many}token {self.token_index} (batch {self.batch}, position {self.position})"
        if self.kind == KIND_BLOCK_ROW:
            return (f"{who} has batch index {self.batch}, outside the block table's rows [0, "
                    f"{self.limit}); its slot is -1")
        if self.kind == KIND_BLOCK_INDEX:
            return (f"{who} needs block {self.target} = {self.position} // {self.pool_page_size}, "
                    f"past the block table's row of {self.limit} blocks; its slot is -1")
        return (f"{who} maps to page {self.target} = block_table[{self.batch}, {self.table_slot}], "
                f"but the pool has pages [0, {self.limit}) of {self.pool_page_size} rows; its slot is -1")

    def _message(self) -> str:
        many = f"{self.count} bad token(s); the first is " if self.count > 1 else ""
        if self.kind in PAGE_KINDS or self.kind in BLOCK_KINDS:
            return self._page_message()
        if self.kind in TABLE_KINDS:
            return self._table_message(many)
        if self.kind == KIND_LOC_MAP:
            return (f"{self.op}: {many}token {self.token_index} with loc {self.loc}, which is outside "
                    f"loc_map (length {self.limit}), the locs its map covers (a full->SWA map: size it to "
                    f"the full allocator's locs; a page-part map: the pool's pages times page_size)")
        if self.kind == KIND_POSITION:
            return (f"{self.op}: {many}token {self.token_index} (loc {self.loc}) has position "
                    f"{self.target}, outside the cos/sin cache [0, {self.limit}): the token was not "
                    f"written and its q not rotated; size cos_sin_cache to the model's max position")
        where = (f"page {self.page}, but the pool has pages [0, {self.num_pages}) of "
                 f"{self.pool_page_size} rows (capacity {self.limit})")
        via = "" if self.target == self.loc else f" (translated/local loc {self.target})"
        hint = ("; padding must be -1" if self.target < 0 else
                "; check that the allocator pages in pool_page_size units and that the pool "
                "covers its whole loc space (PageGeometry.check_allocator)")
        verb, prep = ("reads", "from") if self.op in READ_OPS else ("writes", "into")
        return f"{self.op}: {many}token {self.token_index} {verb} loc {self.loc}{via} {prep} {where}{hint}"


class DuplicateWrite(OutOfBoundsWrite):
    """Two tokens of one call resolve to the same pool row (or two pairs of a page move to one dst
    page): `token_index` the later, `first_token` the row's writer, `row`, `page`, `offset` (docs/checks.md)."""

    def __init__(self, op: str, token_index: int, loc: int, row: int, first_token: int,
                 pool_page_size: int, count: int, *, batch: int | None = None,
                 position: int | None = None) -> None:
        self.op, self.token_index, self.loc, self.count = op, token_index, loc, count
        self.kind, self.target, self.row, self.first_token = KIND_DUPLICATE, row, row, first_token
        self.page, self.offset = divmod(row, pool_page_size)
        self.pool_page_size, self.batch, self.position = pool_page_size, batch, position
        RuntimeError.__init__(self, self._message())

    def _message(self) -> str:
        many = f"{self.count} bad or duplicate item(s); the first is " if self.count > 1 else ""
        if self.op in ("copy_pages", "move_rows"):
            what = "row" if self.op == "move_rows" else "page"
            unit = (f" (in units of {self.pool_page_size} rows)" if self.op == "copy_pages" else "")
            return (f"{self.op}: {many}pair {self.token_index} writes dst {what} {self.row}{unit}, "
                    f"which pair {self.first_token} of the same call already writes; each dst "
                    f"{what} may be written once per call (guard keeps pair {self.first_token}'s copy)")
        via = "" if self.row == self.loc else f" (local row {self.row})"
        table = ("" if self.batch is None else
                 f" (page table: batch {self.batch}, position {self.position})")
        return (f"{self.op}: {many}token {self.token_index}{table} writes loc {self.loc}{via}, row "
                f"{self.offset} of page {self.page}, which token {self.first_token} of the same call "
                f"already writes; a call may write each pool row once (guard keeps token "
                f"{self.first_token}'s bytes): the allocator handed out one slot twice (a double "
                f"free or a prefix-cache bug?)")


class IncompleteRecord(OutOfBoundsWrite):
    """COUNT > 0 but the fields are not all written: read before a running guarded store finished."""

    def __init__(self, count: int, detail: str) -> None:
        self.detail, self.count = detail, count
        RuntimeError.__init__(self, f"kvwrite guard record: {count} bad token(s) counted but the record is "
                                    f"incomplete ({detail}): a guarded store is still writing it; read the record "
                                    f"after the stream that ran the store (ErrorBuffer.raise_if_any(stream=that_stream))")


def _unpack(lo: int, hi: int) -> int:
    value = ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)
    return value - (1 << 64) if value >= (1 << 63) else value


def _signed32(packed_key: int) -> int:
    v = packed_key & 0xFFFFFFFF
    return v - (1 << 32) if v >= (1 << 31) else v


def table_error(op: str, token: int, kind: int, target: int, limit: int, pool_page_size: int,
                count: int, batch: int, position: int, slot: int, page: int) -> OutOfBoundsWrite:
    """The OutOfBoundsWrite of a page-table record (built here for every backend, so the fields
    agree); `loc` is the row the token would have written (KIND_TABLE_PAGE), else -1."""
    return OutOfBoundsWrite(
        op=op, token_index=token, loc=page * pool_page_size + position % pool_page_size
        if kind == KIND_TABLE_PAGE else -1,
        page=page if kind == KIND_TABLE_PAGE else None,
        num_pages=limit if kind == KIND_TABLE_PAGE else None, pool_page_size=pool_page_size,
        count=count, kind=kind, target=target, limit=limit, batch=batch, position=position,
        table_slot=slot if kind != KIND_BATCH else None,
        table_page=page if kind == KIND_TABLE_PAGE else None)


class ErrorBuffer:
    """The guard-mode record on one device: lowest bad token index, its loc, page, count.

    Made inside a CUDA graph capture, its zero-fill (like any `reset()` there) is part of the
    graph: every replay clears it first (a per-replay record). Made before the capture, it
    accumulates over replays until `reset()`."""

    read: list[int] | None = None   # the slots as error() last read them (the exit report's "seen")

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.tensor = torch.empty(NUM_SLOTS, dtype=torch.int64, device=device)
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def reset(self) -> None:
        """Clear the record (asynchronous on the device, no host sync)."""
        self.tensor.fill_(EMPTY)
        self.tensor[COUNT].fill_(0)   # a fill kernel (`[COUNT] = 0` would copy a CPU scalar in)
        self.tensor[EPOCH:].zero_()  # EPOCH, DONE

    def error(self, stream: torch.cuda.Stream | None = None) -> OutOfBoundsWrite | None:
        """The recorded error, or None. Synchronises with the device: the current stream, and
        `stream` too when given (the stream the guarded stores ran on, if another)."""
        if stream is not None:
            stream.synchronize()
        self.read = self.tensor.tolist()
        return decode(self.read)

    def raise_if_any(self, stream: torch.cuda.Stream | None = None) -> None:
        """Raise OutOfBoundsWrite if any guarded store skipped a write since the last reset.

        The read is ordered after the current stream's work; pass `stream` when the stores ran
        on another one (it is synchronised first). Read unordered, the record of a store still
        running can be incomplete (raised as IncompleteRecord) or not yet hold the lowest token."""
        err = self.error(stream)
        if err is not None:
            raise err

    def __repr__(self) -> str:
        err = self.error()
        return f"ErrorBuffer({self.device}, {'clean' if err is None else err})"


def decode(s: list[int]) -> OutOfBoundsWrite | None:
    """The OutOfBoundsWrite a record's slots describe (None if COUNT is 0; IncompleteRecord if partial)."""
    if s[COUNT] == 0:
        return None
    if s[OWNER] == EMPTY or any(s[k] == EMPTY for k in FIELDS):
        return IncompleteRecord(s[COUNT], "fields not written yet")
    tokens = {s[k] >> 32 for k in FIELDS}
    meta = s[META] & 0xFFFFFFFF
    if (meta >> 8) in TABLE_KINDS or (meta >> 8) in BLOCK_KINDS:
        if any(s[k] == EMPTY for k in TABLE_FIELDS):
            return IncompleteRecord(s[COUNT], "page-table fields not written yet")
        tokens |= {s[k] >> 32 for k in TABLE_FIELDS}
    if len(tokens) > 1:
        return IncompleteRecord(s[COUNT], f"fields from tokens {sorted(tokens)}")
    if (meta & 0xFF) >= len(OPS):
        return IncompleteRecord(s[COUNT], f"unknown op code {meta & 0xFF}")
    token = s[META] >> 32
    kind, op = meta >> 8, OPS[meta & 0xFF]
    loc = _unpack(s[LOC_LO], s[LOC_HI])
    target = _unpack(s[TARGET_LO], s[TARGET_HI])
    limit = _unpack(s[LIMIT_LO], s[LIMIT_HI])
    pps = s[POOL_PAGE_SIZE] & 0xFFFFFFFF
    if kind == KIND_DUPLICATE:
        ctx = {}
        if all(s[k] >> 32 == token for k in (BATCH, POSITION)):   # a page-table call's context
            ctx = dict(batch=_signed32(s[BATCH]), position=_signed32(s[POSITION]))
        return DuplicateWrite(op, token, loc, target, limit, pps, s[COUNT], **ctx)
    if kind in TABLE_KINDS:
        return table_error(op, token, kind, target, limit, pps, s[COUNT],
                           *(_signed32(s[k]) for k in (BATCH, POSITION, TABLE_SLOT, TABLE_PAGE)))
    common = dict(op=op, token_index=token, loc=loc, pool_page_size=pps, count=s[COUNT], kind=kind, target=target,
                  limit=limit)
    if kind in PAGE_KINDS:
        return OutOfBoundsWrite(page=target, num_pages=limit, **common)
    if kind in BLOCK_KINDS:
        b, pos, blk, page = (_signed32(s[k]) for k in (BATCH, POSITION, TABLE_SLOT, TABLE_PAGE))
        return OutOfBoundsWrite(page=None, num_pages=None, batch=b, position=pos, table_slot=blk, table_page=page,
                                **common)
    return OutOfBoundsWrite(page=target // pps if kind == KIND_POOL else None, num_pages=limit // pps, **common)


_default: dict[torch.device, ErrorBuffer] = {}
_default_lock = threading.Lock()


def default_errors(device: torch.device | str) -> ErrorBuffer:
    """The per-device buffer guard mode uses when a call passes no `errors`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _default_lock:
        if device not in _default:
            if device.type == "cuda" and torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"kvwrite: guard mode's default record on {device} is first needed inside a "
                                   f"CUDA graph capture, where its zero-fill would be recorded and rerun by "
                                   f"every replay (clearing the record) instead of run once: create it before "
                                   f"the capture (call kvwrite.default_errors({str(device)!r}) or run one "
                                   f"guarded store eagerly), or pass errors=kvwrite.ErrorBuffer(...) made "
                                   f"before the capture")
            if not _default:
                atexit.register(report_default_errors)
            _default[device] = ErrorBuffer(device)
        return _default[device]


def report_default_errors(stream=None) -> int:
    """Write every per-device default record that holds a bad write to `stream` (stderr) and
    return how many did: registered with atexit with the first default buffer, so a guard-mode run
    reports what it skipped at exit. A record read since (`error()`) and unchanged is not repeated."""
    stream = sys.stderr if stream is None else stream
    found = 0
    for device, buf in list(_default.items()):
        try:
            seen = buf.read
            err = buf.error()
            if buf.read == seen:
                continue
        except Exception as exc:  # a device already torn down at exit: say so, do not hide it
            print(f"kvwrite: could not read the guard record on {device} at exit: {exc}",
                  file=stream)
            continue
        if err is not None:
            found += 1
            print(f"kvwrite: guard mode skipped bad writes on {device} that were never checked "
                  f"(kvwrite.default_errors({str(device)!r}).raise_if_any()): {err}", file=stream)
    stream.flush()
    return found


def pack(token: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Packed key `token << 32 | (value & 0xFFFFFFFF)` (int64 tensors), as the kernels build it."""
    return (token << 32) | (value & 0xFFFFFFFF)


def record_torch(errors: torch.Tensor, bad: torch.Tensor, loc: torch.Tensor, target: torch.Tensor,
                 limit: torch.Tensor | int, pool_page_size: int, op: str, kind: torch.Tensor | int,
                 extra: dict[int, torch.Tensor] | None = None, advance: bool = True) -> None:
    """Reference guard record of one call: fold every bad token (`bad`, bool [N]) into `errors` by the
    kernels' rules, no host sync. `extra`: more slot -> [N] fields (page-table context);
    `advance=False`: a pre-pass of the call (`kvwrite.claims`), which leaves EPOCH to the store."""
    n = bad.shape[0]
    if n == 0:
        return
    tok = torch.arange(n, device=bad.device, dtype=torch.int64)
    loc, target = loc.to(torch.int64), target.to(torch.int64)
    limit = torch.as_tensor(limit, device=bad.device, dtype=torch.int64).expand(n)
    kind = torch.as_tensor(kind, device=bad.device, dtype=torch.int64).expand(n)
    fields = {
        LOC_LO: loc, LOC_HI: loc >> 32, TARGET_LO: target, TARGET_HI: target >> 32,
        LIMIT_LO: limit, LIMIT_HI: limit >> 32,
        POOL_PAGE_SIZE: torch.full_like(tok, pool_page_size),
        META: op_code(op) | (kind << 8),
    }
    for slot, value in (extra or {}).items():
        fields[slot] = value.to(torch.int64)
    epoch, owner = errors[EPOCH].clone(), errors[OWNER].clone()
    claim = bad.any() & (owner == EMPTY)
    errors[OWNER] = torch.where(claim, epoch, owner)
    folded = bad & (claim | (owner == epoch))
    empty = torch.full_like(tok, EMPTY)
    for slot, value in fields.items():
        key = torch.where(folded, pack(tok, value), empty).min()
        errors[slot] = torch.minimum(errors[slot], key)
    errors[COUNT] += bad.sum()
    if advance:
        errors[EPOCH] += 1
