"""Which backends exist, which can run on a device, and what `backend="auto"` picks."""
from __future__ import annotations

import importlib
import logging
import os
import warnings
from functools import lru_cache
from typing import Callable

import torch

BACKENDS = ("torch", "triton", "cpu", "cuda")
AUTO_ORDER = {"cuda": ("cuda", "triton", "torch"), "cpu": ("cpu", "torch")}


class BackendUnavailable(RuntimeError):
    """The requested backend cannot run the tensors' device (the message says why)."""


def triton_interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@lru_cache(maxsize=None)
def _triton_import_error() -> str | None:
    try:
        importlib.import_module("kvwrite.kernels._common")
    except Exception as exc:  # ImportError, or a triton that fails to initialise
        return f"triton is not importable ({exc.__class__.__name__}: {exc})"
    return None


@lru_cache(maxsize=None)
def _extension_reason(device_type: str) -> str | None:
    try:
        ext = importlib.import_module("kvwrite._ext")
    except ImportError as exc:
        return f"the C++/CUDA extension module is missing ({exc})"
    return ext.unavailable_reason(device_type)


def unavailable_reason(backend: str, device: torch.device) -> str | None:
    """None if `backend` can run on `device`, else why not."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {('auto',) + BACKENDS}, got {backend!r}")
    dev = device.type
    if backend == "torch":
        return None if dev in ("cpu", "cuda") else f"device type {dev} is not supported"
    if backend == "triton":
        if dev == "cpu" and not triton_interpreting():
            return "triton runs CPU tensors only under the interpreter (set TRITON_INTERPRET=1 before importing triton)"
        return _triton_import_error() if dev in ("cpu", "cuda") else f"device type {dev} is not supported"
    # cpu / cuda: the extension's kernels, on their own device type only
    return f"the {backend} backend runs {backend.upper()} tensors, not {dev}" if dev != backend else \
        _extension_reason(dev)


def backends(device: torch.device | str = "cpu") -> dict[str, str | None]:
    """Every backend with None (available) or the reason it cannot run on `device`."""
    device = torch.device(device)
    return {name: unavailable_reason(name, device) for name in BACKENDS}


_warned: set[tuple[str, str]] = set()


def resolve(backend: str, device: torch.device, op: str, implemented: tuple[str, ...] = BACKENDS) -> str:
    """The concrete backend for a call: `backend` itself if it can run and `implemented` (the op's
    table) has it, else a clear error; "auto" walks AUTO_ORDER over `implemented`."""
    if backend != "auto":
        reason = unavailable_reason(backend, device)
        if reason is None and backend not in implemented:
            reason = f"it has no implementation of this op (implemented: {', '.join(implemented)})"
        if reason is not None:
            raise BackendUnavailable(f"{op}: backend={backend!r} is unavailable on {device}: {reason}")
        return backend
    order = AUTO_ORDER.get(device.type)
    if order is None:
        raise BackendUnavailable(f"{op}: no backend runs on device type {device.type}")
    for name in order:
        if name not in implemented:
            continue
        reason = unavailable_reason(name, device)
        if reason is None:
            return name
        if name in ("cpu", "cuda") and (name, device.type) not in _warned:
            # said once per (backend, device type), as a warning and a log line: "auto" runs slower
            _warned.add((name, device.type))
            later = order[order.index(name) + 1:]
            instead = next((n for n in later if n in implemented and unavailable_reason(n, device) is None), None)
            text = (f"kvwrite: backend {name!r} unavailable on {device.type} ({reason}); stores run on "
                    f"{instead or 'another backend'!r} instead, slower; kvwrite.backends({device.type!r}) lists why")
            logging.getLogger("kvwrite").warning("%s", text)
            warnings.warn(text, RuntimeWarning, stacklevel=3)
    raise BackendUnavailable(f"{op}: no backend available on {device}")


@lru_cache(maxsize=None)
def implementation(table: tuple[tuple[str, str], ...], backend: str) -> Callable:
    """Import `module:function` for `backend` from an op's (backend, path) table."""
    path = dict(table)[backend]
    module, _, fn = path.partition(":")
    return getattr(importlib.import_module(module), fn)
