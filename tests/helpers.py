"""Canary pools and shared strategies for the store tests."""
from __future__ import annotations

import math

import torch

from conftest import DEVICE, KERNEL_BACKENDS

PAD_BYTES = 512


class CanaryBuffer:
    """Caches carved out of one random byte buffer with sentinel bytes before, between and after
    them; `clone()` gives an identical twin for the reference, `bytes` the whole buffer."""

    def __init__(self, specs: dict[str, tuple[tuple[int, ...], torch.dtype]], seed: int = 0,
                 device: torch.device = DEVICE, permute: dict[str, tuple[int, ...]] | None = None):
        sizes = {n: math.prod(s) * torch.empty((), dtype=d).element_size() for n, (s, d) in specs.items()}
        total = PAD_BYTES + sum(-(-sz // PAD_BYTES) * PAD_BYTES + PAD_BYTES for sz in sizes.values())
        gen = torch.Generator().manual_seed(seed)
        self.raw = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen).to(device)
        self.specs, self.sizes, self.permute = specs, sizes, permute or {}
        self.offsets, off = {}, PAD_BYTES
        for n, sz in sizes.items():
            self.offsets[n] = off
            off += -(-sz // PAD_BYTES) * PAD_BYTES + PAD_BYTES

    def _view(self, raw: torch.Tensor, name: str) -> torch.Tensor:
        shape, dtype = self.specs[name]
        off = self.offsets[name]
        t = raw[off:off + self.sizes[name]].view(dtype).view(shape)
        return t

    def __getitem__(self, name: str) -> torch.Tensor:
        return self._view(self.raw, name)

    def clone(self) -> "CanaryBuffer":
        twin = object.__new__(CanaryBuffer)
        twin.__dict__.update(self.__dict__)
        twin.raw = self.raw.clone()
        return twin

    def canary_mask(self) -> torch.Tensor:
        """True on every byte outside the caches."""
        mask = torch.ones_like(self.raw, dtype=torch.bool)
        for n, off in self.offsets.items():
            mask[off:off + self.sizes[n]] = False
        return mask


def assert_same_bytes(actual: CanaryBuffer, expected: CanaryBuffer, original: torch.Tensor) -> None:
    """The whole buffer equals the reference's, and no sentinel byte changed."""
    canary = actual.canary_mask()
    changed = (actual.raw != original) & canary
    assert not bool(changed.any()), f"sentinel bytes changed at {torch.nonzero(changed).flatten()[:8].tolist()}"
    diff = actual.raw != expected.raw
    if bool(diff.any()):
        where = torch.nonzero(diff).flatten()
        names = [n for n, off in actual.offsets.items() if off <= int(where[0]) < off + actual.sizes[n]]
        raise AssertionError(f"{int(diff.sum())} bytes differ from the reference, first at byte "
                             f"{int(where[0])} ({names})")


def paged_locs(n: int, capacity: int, page_size: int, gen: torch.Generator, pad_frac: float = 0.0,
               dtype=torch.int64) -> torch.Tensor:
    """Unique locs from whole pages, in random order, with -1 padding mixed in."""
    perm = torch.randperm(capacity, generator=gen)[:n]
    pad = torch.rand(n, generator=gen) < pad_frac
    return torch.where(pad, torch.full_like(perm, -1), perm).to(dtype).to(DEVICE)


BACKENDS = KERNEL_BACKENDS
