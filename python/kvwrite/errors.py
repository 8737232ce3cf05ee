"""Guard-mode error records: a tiny int64 device buffer the kernels fill without a host sync.

Layout (shared by the torch, Triton, CPU and CUDA backends; see `csrc/kvwrite/record.h`):
slot COUNT counts bad tokens (atomic add). Every other slot holds a *packed key*
`token_index << 32 | uint32 chunk` and is updated with an atomic min, so after any number of
racing writers each slot holds the chunk written by the lowest bad token index, and the
fields below are mutually consistent without a lock. Tokens are limited to 2**31 - 1 per call.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

# Slot indices. Each 64-bit field takes two packed slots (low, high 32 bits).
COUNT = 0
LOC_LO, LOC_HI = 1, 2            # the caller's loc (virtual loc under DCP)
TARGET_LO, TARGET_HI = 3, 4      # the index that was out of range
LIMIT_LO, LIMIT_HI = 5, 6        # ... and the bound it was checked against: [0, limit)
POOL_PAGE_SIZE = 7               # rows per pool page of the target pool (1 for a map lookup)
META = 8                         # op code | kind << 8
NUM_SLOTS = 16
EMPTY = (1 << 63) - 1            # initial value of every packed slot
MAX_TOKENS = (1 << 31) - 1

# What was out of range.
KIND_POOL = 0        # the (local, translated) loc against the pool capacity
KIND_LOC_MAP = 1     # the loc against the SWA loc_map length (lookup)
KIND_POSITION = 5    # rope_store_*: the token's position against the cos/sin cache (max_position)

# Op codes, recorded so a shared buffer tells which op failed. Append only.
OPS = (
    "store_kv",
    "store_mla",
    "store_indexer_k",
    "store_kv_nvfp4",
    "rope_store_kv",
    "rope_store_mla",
)


def op_code(name: str) -> int:
    return OPS.index(name)


class OutOfBoundsWrite(RuntimeError):
    """A store would have written outside its pool. Raised by `ErrorBuffer.raise_if_any`
    (guard mode) and by the `assert` mode on CPU backends."""

    def __init__(self, op: str, token_index: int, loc: int, page: int | None, num_pages: int,
                 pool_page_size: int, count: int, kind: int = KIND_POOL,
                 target: int | None = None, limit: int | None = None) -> None:
        self.op, self.token_index, self.loc, self.page = op, token_index, loc, page
        self.num_pages, self.pool_page_size, self.count = num_pages, pool_page_size, count
        self.kind = kind
        self.target = loc if target is None else target
        self.limit = num_pages * pool_page_size if limit is None else limit
        super().__init__(self._message())

    def _message(self) -> str:
        many = f"{self.count} bad token(s); the first is " if self.count > 1 else ""
        if self.kind == KIND_LOC_MAP:
            return (
                f"{self.op}: {many}token {self.token_index} with loc {self.loc}, which is outside "
                f"loc_map (length {self.limit}): the full->SWA map does not cover the full pool's "
                f"loc space; size loc_map to the full allocator's locs"
            )
        if self.kind == KIND_POSITION:
            return (
                f"{self.op}: {many}token {self.token_index} (loc {self.loc}) has position "
                f"{self.target}, outside the cos/sin cache [0, {self.limit}): the token was not "
                f"written and its q not rotated; size cos_sin_cache to the model's max position"
            )
        where = (f"page {self.page}, but the pool has pages [0, {self.num_pages}) of "
                 f"{self.pool_page_size} rows (capacity {self.limit})")
        via = "" if self.target == self.loc else f" (translated/local loc {self.target})"
        hint = ("; padding must be -1" if self.target < 0 else
                "; check that the allocator pages in pool_page_size units and that the pool "
                "covers its whole loc space (PageGeometry.check_allocator)")
        return f"{self.op}: {many}token {self.token_index} writes loc {self.loc}{via} into {where}{hint}"


def _unpack(lo: int, hi: int) -> int:
    value = ((hi & 0xFFFFFFFF) << 32) | (lo & 0xFFFFFFFF)
    return value - (1 << 64) if value >= (1 << 63) else value


class ErrorBuffer:
    """The guard-mode record on one device: lowest bad token index, its loc, page, count."""

    def __init__(self, device: torch.device | str = "cpu") -> None:
        self.tensor = torch.empty(NUM_SLOTS, dtype=torch.int64, device=device)
        self.reset()

    @property
    def device(self) -> torch.device:
        return self.tensor.device

    def reset(self) -> None:
        """Clear the record (asynchronous on the device, no host sync)."""
        self.tensor.fill_(EMPTY)
        self.tensor[COUNT] = 0

    def error(self) -> OutOfBoundsWrite | None:
        """The recorded error, or None. Synchronises with the device."""
        s = self.tensor.tolist()
        if s[COUNT] == 0:
            return None
        token = s[META] >> 32
        meta = s[META] & 0xFFFFFFFF
        kind, op = meta >> 8, OPS[meta & 0xFF]
        loc = _unpack(s[LOC_LO], s[LOC_HI])
        target = _unpack(s[TARGET_LO], s[TARGET_HI])
        limit = _unpack(s[LIMIT_LO], s[LIMIT_HI])
        pps = s[POOL_PAGE_SIZE] & 0xFFFFFFFF
        page = target // pps if kind == KIND_POOL else None
        return OutOfBoundsWrite(op=op, token_index=token, loc=loc, page=page,
                                num_pages=limit // pps, pool_page_size=pps, count=s[COUNT],
                                kind=kind, target=target, limit=limit)

    def raise_if_any(self) -> None:
        """Raise OutOfBoundsWrite if any guarded store skipped a write since the last reset."""
        err = self.error()
        if err is not None:
            raise err

    def __repr__(self) -> str:
        err = self.error()
        return f"ErrorBuffer({self.device}, {'clean' if err is None else err})"


_default: dict[torch.device, ErrorBuffer] = {}
_default_lock = threading.Lock()


def default_errors(device: torch.device | str) -> ErrorBuffer:
    """The per-device buffer guard mode uses when a call passes no `errors`."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    with _default_lock:
        if device not in _default:
            _default[device] = ErrorBuffer(device)
        return _default[device]


@dataclass(frozen=True)
class Violation:
    """What the host-side reference found wrong with one call (used by `assert` on CPU)."""

    token_index: int
    loc: int
    target: int
    limit: int
    kind: int
    count: int


def pack(token: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Packed key `token << 32 | (value & 0xFFFFFFFF)` (int64 tensors), as the kernels build it."""
    return (token << 32) | (value & 0xFFFFFFFF)


def record_torch(errors: torch.Tensor, bad: torch.Tensor, loc: torch.Tensor, target: torch.Tensor,
                 limit: torch.Tensor | int, pool_page_size: int, op: str, kind: torch.Tensor | int
                 ) -> None:
    """Reference guard record: fold every bad token into `errors` with the same packed-min rule
    the kernels use (no host sync). All tensors are [N]; `bad` is bool."""
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
    empty = torch.full_like(tok, EMPTY)
    for slot, value in fields.items():
        key = torch.where(bad, pack(tok, value), empty).min()
        errors[slot] = torch.minimum(errors[slot], key)
    errors[COUNT] += bad.sum()
