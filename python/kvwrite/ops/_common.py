"""What every store op shares: loc resolution arguments, the check mode, backend dispatch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvwrite import backend as backends, validate
from kvwrite.errors import MAX_TOKENS, NUM_SLOTS, ErrorBuffer, default_errors
from kvwrite.geometry import PageGeometry
from kvwrite.pagetable import PageTable, table as _table


@dataclass(slots=True, eq=False)
class Locs:
    """Where each token goes: `loc` (virtual), optional SWA `loc_map`, DCP shard of this rank;
    or a `table` (page-table addressing; `loc` is then its positions). Built on every call of
    the Python path: a plain slotted dataclass (a frozen one costs ~4x to construct); treat it as
    read-only (`dataclasses.replace` for a variant)."""

    loc: torch.Tensor
    loc_map: torch.Tensor | None = None
    dcp_rank: int = 0
    dcp_size: int = 1
    table: PageTable | None = None
    dcp_page: bool = False   # DCP shards whole pages (page p on rank p % dcp_size), not tokens

    @property
    def n(self) -> int:
        return self.loc.shape[0]


@dataclass(frozen=True)
class Check:
    """The check mode of one call and where guard mode records (None unless guard)."""

    op: str
    mode: str
    errors: torch.Tensor | None

    @property
    def code(self) -> int:
        return validate.CHECK_MODES[self.mode]


_DEFAULT_CHECKS: dict[tuple[str, str, torch.device], Check] = {}


def prepare(op: str, device: torch.device, n: int, loc: object, loc_map: object,
            dcp_rank: object, dcp_size: object, check: object,
            errors: ErrorBuffer | torch.Tensor | None) -> tuple[Locs, Check]:
    """Validate the arguments every op takes the same way."""
    if n > MAX_TOKENS:
        raise ValueError(f"{op}: at most {MAX_TOKENS} tokens per call, got {n}")
    if isinstance(loc, PageTable):
        if loc_map is not None or dcp_size != 1:
            raise ValueError(f"{op}: a PageTable loc does not combine with loc_map or DCP "
                             f"(loc_map={'set' if loc_map is not None else None}, dcp_size={dcp_size!r})")
        if torch.compiler.is_compiling():
            raise ValueError(f"{op}: page-table addressing (a PageTable loc) is not traceable by "
                             f"torch.compile yet; call it outside the compiled region")
        t = _table(loc, n, device)
        locs = Locs(t.positions, table=t)
    else:
        locs = Locs(validate.loc("loc", loc, n, device), validate.loc_map(loc_map, device),
                    *validate.dcp(dcp_rank, dcp_size))
    mode = validate.check_mode(check)
    if errors is None:
        # No buffer passed: guard records into the device's default buffer (valid by
        # construction, and the same object for the life of the process), so the Check is
        # the same every time.
        key = (op, mode, device)
        chk = _DEFAULT_CHECKS.get(key)
        if chk is None:
            chk = Check(op, mode, default_errors(device).tensor if mode == "guard" else None)
            _DEFAULT_CHECKS[key] = chk
        return locs, chk
    record = errors.tensor if isinstance(errors, ErrorBuffer) else errors
    if record is not None:
        if not (isinstance(record, torch.Tensor) and record.dtype == torch.int64
                and record.shape == (NUM_SLOTS,)):
            raise TypeError(f"errors must be a kvwrite.ErrorBuffer or None, got {type(errors).__name__}")
        if record.device != device:
            raise ValueError(f"errors is on {record.device} but the inputs are on {device}")
    if mode != "guard":
        record = None
    return locs, Check(op, mode, record)


# Backends the C++ ops (csrc/api.h) run themselves once the extension is loaded.
NATIVE = ("auto", "cpu", "cuda")
_DEFAULT_RECORD: dict[torch.device, torch.Tensor] = {}


def record(errors: object, check: object, ref: object) -> object:
    """The `errors` argument of a C++ op call: an ErrorBuffer's tensor; in guard mode without
    one, the default buffer of `ref`'s device (as `prepare` picks it); anything else unchanged
    (the op validates it)."""
    if errors is None:
        if check != "guard":
            return None
        device = ref.device
        t = _DEFAULT_RECORD.get(device)
        if t is None:
            t = _DEFAULT_RECORD[device] = default_errors(device).tensor
        return t
    return errors.tensor if isinstance(errors, ErrorBuffer) else errors


def cache_geometry(name: str, num_pages: int, pool_page_size: int) -> PageGeometry:
    if num_pages < 1 or pool_page_size < 1:
        raise ValueError(f"{name} must have at least one page of at least one row, got "
                         f"{num_pages} pages of {pool_page_size}")
    return PageGeometry.from_pool(num_pages, pool_page_size)


def dispatch(op: str, table: tuple[tuple[str, str], ...], backend: str, device: torch.device,
             args: object) -> None:
    """Run `args` on the resolved backend's implementation of `op`."""
    key = (op, table, backend, device)
    name = _RESOLVED.get(key) if type(backend) is str else None
    if name is None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        name = backends.resolve(backend, device, op, backends.implemented(table))
        _RESOLVED[key] = name  # availability is settled once per process (backend.py caches it)
    impl: Callable = backends.implementation(table, name)
    impl(args)


_RESOLVED: dict[tuple, str] = {}   # (op, table, backend, device) -> the backend it resolved to
