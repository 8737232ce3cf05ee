"""Transfer descriptors, the only place page addresses are computed, every span checked against its region."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvwrite.geometry import GeometryError
from kvwrite.transfer.layout import Bridge, PoolLayout, Units


class DescriptorOutsidePool(ValueError):
    """A span would leave the registered memory of its pool (never made into a descriptor)."""


@dataclass(frozen=True)
class Region:
    """One registered buffer: base address, bytes, device id (0 for host memory)."""

    addr: int
    nbytes: int
    device: int = 0


class PoolAddresses:
    """A pool's layout over its registered regions (one per buffer, in order)."""

    def __init__(self, layout: PoolLayout, regions: Sequence[Region], side: str) -> None:
        if len(regions) != len(layout.buffers):
            raise GeometryError(f"{side} pool {layout.name!r} publishes {len(layout.buffers)} buffers but "
                                f"{len(regions)} registered regions")
        self.layout, self.regions, self.side = layout, tuple(regions), side
        pps = layout.pool_page_size
        # per (buffer, segment): its base (+ offset in a page), bytes a row, page bytes, buffer, region bounds, device
        entries = []
        for i, (b, r) in enumerate(zip(layout.buffers, regions)):
            if r.nbytes != b.page_bytes * layout.num_pages:
                raise GeometryError(f"{side} pool {layout.name!r} buffer {i}: region of {r.nbytes} bytes is not "
                                    f"{layout.num_pages} pages of {b.page_bytes} bytes")
            off = 0
            for s in b.segments or (b.page_bytes // pps,):   # an opaque page: rows of page_bytes / pps
                entries.append((r.addr + off, s, b.page_bytes, i, r.addr, r.addr + r.nbytes, r.device))
                off += pps * s
        (self._base, self._row, self._page, self._buf, self._lo, self._hi,
         self._dev) = np.array(entries, dtype=np.int64).reshape(-1, 7).T

    def spans(self, units: np.ndarray, u: Units) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(address, length, device) `[segments, n]` of `units` in `u`; DescriptorOutsidePool if one leaves a region."""
        units = np.asarray(units, dtype=np.int64)
        page, part = units // u.factor, units % u.factor
        addr = self._base[:, None] + page[None, :] * self._page[:, None] + (part * u.rows)[None, :] * self._row[:, None]
        length = np.broadcast_to((u.rows * self._row)[:, None], addr.shape)
        outside = (addr < self._lo[:, None]) | (addr + length > self._hi[:, None])
        if outside.any():
            k, j = np.argwhere(outside)[0]
            raise DescriptorOutsidePool(
                f"{self.side} pool {self.layout.name!r} buffer {int(self._buf[k])}: unit {int(units[j])} "
                f"(page {int(page[j])}) would span bytes [{int(addr[k, j] - self._lo[k])}, "
                f"{int(addr[k, j] + length[k, j] - self._lo[k])}) of a {int(self._hi[k] - self._lo[k])}-byte "
                f"region; no descriptor was made")
        return addr, length, np.broadcast_to(self._dev[:, None], addr.shape)


def pair_descs(src: PoolAddresses, dst: PoolAddresses, src_units: np.ndarray, dst_units: np.ndarray,
               br: Bridge, merge: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """(src, dst) NIXL descriptor arrays `[m, 3]` (uint64: address, length, device) moving unit
    `src_units[i]` of `src` to unit `dst_units[i]` of `dst` (ids checked, -1 pairs removed); `merge`: join runs."""
    sa, sl, sd = src.spans(src_units, br.src)
    da, dl, dd = dst.spans(dst_units, br.dst)
    if sa.shape != da.shape or not np.array_equal(sl, dl):
        raise GeometryError(f"src pool {src.layout.name!r} and dst pool {dst.layout.name!r} spans differ in "
                            f"shape or length: compare their layouts with bridge() first")
    sa, da, ln, sdev, ddev = (x.reshape(-1) for x in (sa, da, sl, sd, dd))   # a copy where x is broadcast
    if merge and sa.size > 1:   # merge consecutive spans that continue each other on both sides (same devices)
        cont = ((sa[1:] == sa[:-1] + ln[:-1]) & (da[1:] == da[:-1] + ln[:-1])
                & (sdev[1:] == sdev[:-1]) & (ddev[1:] == ddev[:-1]))
        starts = np.flatnonzero(np.concatenate(([True], ~cont)))
        sa, da, ln, sdev, ddev = sa[starts], da[starts], np.add.reduceat(ln, starts), sdev[starts], ddev[starts]
    return np.stack([sa, ln, sdev], axis=1).astype(np.uint64), np.stack([da, ln, ddev], axis=1).astype(np.uint64)
