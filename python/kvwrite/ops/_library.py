"""The torch op library `kvwrite`, defined at import so the ops exist before the lazily built C++
extension loads: `kvwrite::<op>` (Python kernel: validation and dispatch; a fake kernel running the
same validation for torch.compile; the extension adds its CPU / CUDA kernels, csrc/api.h) and
`kvwrite::<op>_py`, the same Python kernel, where the C++ kernels forward every call they do not
run themselves. No Autograd / ADInplaceOrView Python kernels in front (unlike
torch.library.custom_op): an eager call of the C++ op pays only the dispatcher."""
from __future__ import annotations

from typing import Callable

import torch

LIB = torch.library.Library("kvwrite", "FRAGMENT")
FORWARDED: dict[str, int] = {}   # calls the C++ kernels handed to `<op>_py`, per op (tests)


def define(name: str, schema: str, impl: Callable, fake: Callable) -> torch._ops.OpOverload:
    """Define `kvwrite::<name><schema>` and its twin `<name>_py` (kernel `impl`, fake `fake`): the public OpOverload."""
    def forwarded(*args):
        FORWARDED[name] = FORWARDED.get(name, 0) + 1
        return impl(*args)

    for op, fn in ((name, impl), (f"{name}_py", forwarded)):
        LIB.define(op + schema)
        LIB.impl(op, fn, "CompositeExplicitAutograd")
    torch.library.register_fake(f"kvwrite::{name}", fake, lib=LIB)
    return getattr(torch.ops.kvwrite, name).default
