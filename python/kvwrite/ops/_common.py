"""What every store op shares: loc resolution arguments, the check mode, backend dispatch."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from kvwrite import backend as backends, validate
from kvwrite.addressing import Check, Locs, prepare  # noqa: F401  (the ops' shared names)
from kvwrite.errors import default_errors
from kvwrite.geometry import PageGeometry
from kvwrite.ops.claims import claim


# Backends the C++ ops (csrc/api.h) run themselves once the extension is loaded.
NATIVE = ("auto", "cpu", "cuda")
_DEFAULT_RECORD: dict[torch.device, torch.Tensor] = {}


def default_record(device: torch.device) -> torch.Tensor:
    """The device's default guard record (as `prepare` picks it), for a C++ op call that passes none."""
    t = _DEFAULT_RECORD.get(device)
    if t is None:
        t = _DEFAULT_RECORD[device] = default_errors(device).tensor
    return t


@dataclass(frozen=True)
class Fused:
    """A fused RoPE store: the rotation, then a subclass's `store`, whose locs, check, geometry it has."""

    q: torch.Tensor | None   # rotated in place (rope_store_mla: q_pe [N, Hq, R])
    positions: torch.Tensor
    cos_sin: torch.Tensor
    rotary_dim: int
    is_neox: bool

    @property
    def locs(self) -> Locs:
        return self.store.locs

    @property
    def check(self) -> Check:
        return self.store.check

    @property
    def geometry(self) -> PageGeometry:
        return self.store.geometry


# Any dtype moves as bytes; these are the ones a pool can have (the page moves' pools).
POOL_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int8, torch.int32,
               torch.int64, *validate.FP8_MAX)


def canonical_pool(name: str, t: object) -> torch.Tensor:
    """The `[pages, rows, heads, feat]` view of a pool `[pages, rows, ...]` (2-D: one element a row,
    3-D: one head, more: the dims after the third flattened); the innermost dim contiguous."""
    t = validate.tensor(name, t, dtypes=POOL_DTYPES)
    if t.dim() < 2:
        raise ValueError(f"{name} must be a pool [pages, rows, ...], got shape {list(t.shape)}")
    if t.dim() == 2:
        t = t.unsqueeze(-1).unsqueeze(-1)
    elif t.dim() == 3:
        t = t.unsqueeze(2)
    elif t.dim() > 4:
        try:
            t = t.view(*t.shape[:3], -1)
        except RuntimeError:
            raise ValueError(f"{name}: the dims after the third must be contiguous (one run per head), "
                             f"got shape {list(t.shape)} strides {t.stride()}") from None
    if t.shape[0] < 1 or t.shape[1] < 1:
        raise ValueError(f"{name} must have at least one page of at least one row, got shape {list(t.shape)}")
    return t


def impls(reference: str, kernel: str, ext: str) -> tuple[tuple[str, str], ...]:
    """An op's backend table: its torch reference, Triton launch and C++ binding (cpu and cuda)."""
    return (("torch", f"kvwrite.reference.{reference}"), ("triton", f"kvwrite.kernels.{kernel}"),
            ("cpu", f"kvwrite._ext:{ext}"), ("cuda", f"kvwrite._ext:{ext}"))


def dispatch(op: str, table: tuple[tuple[str, str], ...], backend: str, device: torch.device,
             args: object) -> None:
    """Run `args` on the resolved backend (in assert and guard mode after `kvwrite.ops.claims`)."""
    key = (op, table, backend, device)
    name = _RESOLVED.get(key) if type(backend) is str else None
    if name is None:
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str, got {type(backend).__name__}")
        # availability is settled once per process (backend.py caches it)
        name = _RESOLVED[key] = backends.resolve(backend, device, op, tuple(dict(table)))
    impl: Callable = backends.implementation(table, name)
    if args.check.mode != "off":
        args = claim(op, name, args)
    impl(args)


_RESOLVED: dict[tuple, str] = {}   # (op, table, backend, device) -> the backend it resolved to
