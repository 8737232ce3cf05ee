"""Where each token goes (`Locs`: loc, SWA loc_map, DCP shard, or a page table) and how a call is
checked (`Check`): the addressing arguments every op takes, validated once here. Below the ops
(kernels/ and reference/ read these types without importing kvwrite.ops)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import MAX_TOKENS, NUM_SLOTS, ErrorBuffer, default_errors
from kvwrite.pagetable import PageTable, table as _table

TABLE_ARGS = ("batch_indices", "kv_indices", "kv_indptr")   # a PageTable's tensors beside loc


@dataclass(slots=True, eq=False)
class Locs:
    """Where each token goes: `loc` (virtual), optional SWA `loc_map`, DCP shard of this rank; or
    a `table` (`loc` its positions). Slotted, not frozen (4x cheaper to build); treat as read-only."""

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
            errors: ErrorBuffer | torch.Tensor | None, loc_name: str = "loc") -> tuple[Locs, Check]:
    """Validate the arguments every op takes the same way (`loc_name`: what errors call loc)."""
    if n > MAX_TOKENS:
        raise ValueError(f"{op}: at most {MAX_TOKENS} tokens per call, got {n}")
    if isinstance(loc, PageTable):
        if loc_map is not None or dcp_size != 1:
            raise ValueError(f"{op}: a PageTable loc does not combine with loc_map or DCP "
                             f"(loc_map={'set' if loc_map is not None else None}, dcp_size={dcp_size!r})")
        t = _table(loc, n, device)
        locs = Locs(t.positions, table=t)
    else:
        locs = Locs(validate.loc(loc_name, loc, n, device),
                    None if loc_map is None else validate.loc("loc_map", loc_map, None, device),
                    *validate.dcp(dcp_rank, dcp_size))
    mode = validate.check_mode(check)
    if errors is None:
        # guard records into the device's default buffer (one for the process: one Check); never
        # while tracing (the fake kernel validates guard without a buffer as "off")
        key = (op, mode, device)
        chk = _DEFAULT_CHECKS.get(key)
        if chk is None:
            chk = _DEFAULT_CHECKS[key] = Check(op, mode, default_errors(device).tensor if mode == "guard" else None)
        return locs, chk
    record = errors.tensor if isinstance(errors, ErrorBuffer) else errors
    if not (isinstance(record, torch.Tensor) and record.dtype == torch.int64 and record.shape == (NUM_SLOTS,)):
        raise TypeError(f"errors must be a kvwrite.ErrorBuffer or None, got {type(errors).__name__}")
    if record.device != device:
        raise ValueError(f"errors is on {record.device} but the inputs are on {device}")
    return locs, Check(op, mode, record if mode == "guard" else None)
