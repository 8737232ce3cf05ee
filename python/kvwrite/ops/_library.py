"""The torch op library `kvwrite`: the public ops `torch.ops.kvwrite.<op>`.

Each op's schema is defined here, at import, so the ops exist (for torch.compile, for direct
calls) before the C++ extension — built lazily on first use — is loaded:

- `kvwrite::<op>`: CompositeExplicitAutograd kernel = the Python implementation (validation in
  kvwrite.ops.*, dispatch to the torch / triton / cpu / cuda backend); a fake kernel (Meta) so
  torch.compile(fullgraph=True) traces it; it runs the Python validation, so a traced call and a
  call on meta tensors fail with the same errors as an eager one. Once the extension is loaded it adds the CPU and CUDA
  kernels (csrc/api.h): the same validation, the same errors, in C++, then the kernel. Those
  kernels hand every call they do not run themselves (backend "torch"/"triton", guard mode
  without an errors tensor, assert mode on the CPU, errors that quote a Python repr) to
- `kvwrite::<op>_py`: the same Python implementation under another name (the C++ kernel calls
  it through the dispatcher; it is not meant to be called directly).

No Autograd / ADInplaceOrView Python kernels sit in front (unlike torch.library.custom_op), so
an eager call of the C++ op pays only the dispatcher.
"""
from __future__ import annotations

from typing import Callable

import torch

LIB = torch.library.Library("kvwrite", "FRAGMENT")
FORWARDED: dict[str, int] = {}   # calls the C++ kernels handed to `<op>_py`, per op (tests)


def define(name: str, schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define `kvwrite::<name><schema>` and its twin `<name>_py` with `impl` as their Python
    kernel and `fake` as the public op's fake kernel; returns the public OpOverload."""
    def forwarded(*args):
        FORWARDED[name] = FORWARDED.get(name, 0) + 1
        return impl(*args)

    for op, fn in ((name, impl), (f"{name}_py", forwarded)):
        LIB.define(op + schema)
        LIB.impl(op, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvwrite::{name}", fake, lib=LIB)
    return getattr(torch.ops.kvwrite, name).default


def native(op: torch._ops.OpOverload) -> bool:
    """Whether the extension's C++ kernels of `op` are registered (CPU key)."""
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CPU")


def fake_check(check: object, errors: object) -> object:
    """The check mode a fake kernel validates with: guard without an errors tensor as "off"
    (its default buffer is looked up when the op runs, never created on fake tensors)."""
    return "off" if check == "guard" and errors is None else check
