"""What the engine adapters share: fp8 dtype names, uint8-typed fp8 caches, byte copies."""
from __future__ import annotations

import torch

from kvwrite import validate

FP8_DTYPES = tuple(validate.FP8_MAX)


def as_fp8(name: str, cache: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`cache` as fp8 `dtype`: a uint8 cache (how vLLM and SGLang allocate fp8 pools) is viewed
    as `dtype`; an fp8-typed cache must already be `dtype`."""
    cache = validate.tensor(name, cache)
    if cache.dtype == torch.uint8:
        return cache.view(dtype)
    if cache.dtype != dtype:
        raise TypeError(f"{name} is {cache.dtype} but the cache format is {dtype}: pass a uint8 or "
                        f"{dtype} cache")
    return cache


def byte_pairs(name: str, x: torch.Tensor, cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8 rows stored as they are into an fp8 cache of the same format: a bit copy, run as a
    copy of 16-bit pairs (kvwrite's copy kernels move 16/32-bit elements)."""
    if x.dtype != cache.dtype:
        raise TypeError(f"{name} is {x.dtype} but the cache format is {cache.dtype}: fp8 inputs are "
                        f"stored as they are, so they must be in the cache's format")
    if x.shape[-1] % 2 or (x.shape[-1] > 1 and (x.stride(-1) != 1 or cache.stride(-1) != 1)):
        raise ValueError(f"fp8 {name} is stored as a byte copy of pairs: its last dim must be even "
                         f"and contiguous, got shape {list(x.shape)} strides {x.stride()}")
    return x.view(torch.float16), cache.view(torch.float16)


def scale_tensor(name: str, scale: object, device: torch.device) -> torch.Tensor | None:
    """A float / 0-d / [1] / [H] scale as an fp32 tensor on `device` (None stays None)."""
    if scale is None:
        return None
    if isinstance(scale, torch.Tensor):
        return scale if scale.dtype == torch.float32 else scale.float()
    if isinstance(scale, (int, float)) and not isinstance(scale, bool):
        # a fill kernel on the device, not a copy of a host tensor (no sync, capturable)
        return torch.full((), float(scale), dtype=torch.float32, device=device)
    raise TypeError(f"{name} must be a float or an fp32 tensor, got {type(scale).__name__}")
