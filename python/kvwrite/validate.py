"""Host-side argument checks shared by every op: cheap (no device sync), each error names the
argument and what was expected, and all of them run before any kernel."""
from __future__ import annotations

import os
from typing import Sequence

import torch

FLOAT_INPUTS = (torch.float32, torch.float16, torch.bfloat16)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.float8_e4m3fnuz: 240.0}
LOC_DTYPES = (torch.int32, torch.int64)
CHECK_MODES = {"off": 0, "assert": 1, "guard": 2}
CHECK_ENV = "KVWRITE_CHECK"


class CheckEnvError(ValueError):
    """`KVWRITE_CHECK` holds something that is not a check mode."""


@torch._dynamo.assume_constant_result
def default_check() -> str:
    """The process default check mode (`KVWRITE_CHECK`), read once: a constant, also while tracing."""
    global DEFAULT_CHECK
    try:
        return DEFAULT_CHECK   # a global read: a call with check=None runs this
    except NameError:
        pass
    value = os.environ.get(CHECK_ENV, "").strip()
    if value and value.lower() not in CHECK_MODES:
        raise CheckEnvError(f"{CHECK_ENV}={value!r} is not a check mode: set it to one of "
                            f"{'|'.join(CHECK_MODES)} (or unset it for 'off')")
    DEFAULT_CHECK = value.lower() or "off"
    return DEFAULT_CHECK


def __getattr__(name: str) -> str:
    """`validate.DEFAULT_CHECK`, resolved on first access (a bad `KVWRITE_CHECK` fails the call that needs it)."""
    if name == "DEFAULT_CHECK":
        return default_check()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def tensor(name: str, t: object, *, ndim: int | None = None,
           dtypes: Sequence[torch.dtype] | None = None, device: torch.device | None = None,
           last_contiguous: bool = True) -> torch.Tensor:
    """Check one tensor argument's type, rank, dtype, device and innermost stride."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    dims = t.shape  # one attribute fetch: this runs on every call (host overhead)
    if ndim is not None and len(dims) != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got shape {tuple(dims)}")
    if dtypes is not None and t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({names}), got {t.dtype}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} is on {t.device} but the inputs are on {device}")
    if last_contiguous and dims and dims[-1] > 1 and t.stride()[-1] != 1:
        raise ValueError(f"{name} must be contiguous in its last dim, got strides {t.stride()}")
    return t


def shape(name: str, t: torch.Tensor, expected: Sequence[int | None], what: str) -> None:
    """Check `t.shape` against `expected` (None = any); `what` names the dims."""
    dims = t.shape
    if len(dims) == len(expected) and all(e is None or s == e for s, e in zip(dims, expected)):
        return
    want = ", ".join("*" if e is None else str(e) for e in expected)
    raise ValueError(f"{name} must have shape [{want}] ({what}), got {list(dims)}")


def loc(name: str, t: object, n: int | None, device: torch.device) -> torch.Tensor:
    """A contiguous int32/int64 `[n]` index tensor (a loc_map: `n` None, any length)."""
    t = tensor(name, t, ndim=1, dtypes=LOC_DTYPES, device=device)
    if n is not None and t.shape[0] != n:
        raise ValueError(f"{name} must have one entry per token ({n}), got {t.shape[0]}")
    if t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous, got stride {t.stride(0)}")
    return t


def dcp(dcp_rank: object, dcp_size: object) -> tuple[int, int]:
    if isinstance(dcp_size, bool) or not isinstance(dcp_size, int) or dcp_size < 1:
        raise ValueError(f"dcp_size must be an int >= 1, got {dcp_size!r}")
    if isinstance(dcp_rank, bool) or not isinstance(dcp_rank, int) or not 0 <= dcp_rank < dcp_size:
        raise ValueError(f"dcp_rank must be an int in [0, dcp_size={dcp_size}), got {dcp_rank!r}")
    return dcp_rank, dcp_size


def check_mode(check: object) -> str:
    """`check` itself, or the process default (`KVWRITE_CHECK`, else "off") when it is None."""
    if check is None:
        return default_check()
    if check not in CHECK_MODES:
        raise ValueError(f"check must be one of {tuple(CHECK_MODES)} or None (the process "
                         f"default, {CHECK_ENV}), got {check!r}")
    return check  # type: ignore[return-value]


def choice(name: str, value: object, options: Sequence[str]) -> str:
    if value not in options:
        raise ValueError(f"{name} must be one of {tuple(options)}, got {value!r}")
    return value  # type: ignore[return-value]


def scale(name: str, t: object, num_heads: int | None, device: torch.device) -> torch.Tensor:
    """An fp32 dequant scale of shape [] or [1] (per tensor) or, if num_heads, [H]."""
    t = tensor(name, t, dtypes=(torch.float32,), device=device)
    if not (t.dim() == 0 or (t.dim() == 1 and (t.shape[0] == 1 or t.shape[0] == num_heads))):
        want = "[], [1]" + (f" or [{num_heads}] (one per head)" if num_heads else "")
        raise ValueError(f"{name} must have shape {want}, got {list(t.shape)}")
    if t.dim() == 1 and t.shape[0] > 1 and t.stride(0) != 1:
        raise ValueError(f"{name} must be contiguous")
    return t


def scale_cache(name: str, t: object, num_pages: int, pps: int, h: int, device) -> torch.Tensor:
    """A dynamic fp32 scale cache `[pages, pps]` or `[pages, pps, H]`, as a `[pages, pps, 1 or H]` view."""
    t = tensor(name, t, dtypes=(torch.float32,), device=device)
    if t.dim() == 2:
        shape(name, t, (num_pages, pps), "num_pages, pool_page_size: one scale per token")
        return t.unsqueeze(-1)
    shape(name, t, (num_pages, pps, h),
          "num_pages, pool_page_size (one scale per token) or num_pages, pool_page_size, H "
          "(one per token-head)")
    return t
