"""The layout a pool publishes for page transfers (`PoolLayout`), and `bridge`, the comparison of two."""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Sequence

import torch

from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.ops.pages import Units, canonical_pool   # unit u: rows [(u % factor) * rows, + rows) of page u // factor

BUFFER_LAYOUTS = ("NHD", "HND", "page_major", "page")   # "page": opaque page bytes (no sub-page moves)


@dataclass(frozen=True)
class BufferLayout:
    """One paged buffer: `[num_pages, page_bytes]` in memory, row r of segment s at byte
    `pool_page_size * sum(segments[:s]) + r * segments[s]` of its page."""

    dtype: str                     # torch dtype name of the buffer's elements
    format: str                    # the pool's kv_cache_dtype ("auto", "fp8_e4m3", "fp8_ds_mla", "nvfp4", ...)
    row_shape: tuple[int, ...]     # one token row (NHD view)
    layout: str                    # BUFFER_LAYOUTS
    segments: tuple[int, ...]      # bytes per row of each segment (empty for "page")
    page_bytes: int

    def row_key(self) -> tuple:
        """What must be equal on both sides for a row to move as it is."""
        return (self.dtype, self.format, tuple(self.row_shape), self.layout, tuple(self.segments))


@dataclass(frozen=True)
class PoolLayout:
    """A registered pool: its page-size namespace and its buffers (every layer's, in order)."""

    name: str
    page_size: int
    loc_space_scale: int
    num_pages: int
    heads_per_rank: int
    buffers: tuple[BufferLayout, ...]

    @property
    def pool_page_size(self) -> int:
        return self.page_size * self.loc_space_scale

    @property
    def geometry(self) -> PageGeometry:
        return PageGeometry(self.page_size, self.num_pages, self.loc_space_scale)

    @property
    def nbytes(self) -> int:
        return sum(b.page_bytes for b in self.buffers) * self.num_pages

    def to_dict(self) -> dict:
        return {**asdict(self), "pool_page_size": self.pool_page_size}   # published for the reader; derived on load

    @classmethod
    def from_dict(cls, d: dict) -> "PoolLayout":
        """The peer's published layout, checked for consistency (a forged or stale one is refused)."""
        bufs = tuple(BufferLayout(b["dtype"], b["format"], tuple(b["row_shape"]), b["layout"],
                                  tuple(b["segments"]), int(b["page_bytes"])) for b in d["buffers"])
        out = cls(d["name"], int(d["page_size"]), int(d["loc_space_scale"]), int(d["num_pages"]),
                  int(d["heads_per_rank"]), bufs)
        try:
            out.geometry   # positive page_size, loc_space_scale and num_pages
        except ValueError as exc:
            raise GeometryError(f"pool {out.name!r}: published {exc}") from None
        if d.get("pool_page_size", out.pool_page_size) != out.pool_page_size:
            raise GeometryError(f"pool {out.name!r}: published pool_page_size {d['pool_page_size']} is not "
                                f"page_size {out.page_size} x loc_space_scale {out.loc_space_scale}")
        for i, b in enumerate(bufs):
            if b.segments and sum(b.segments) * out.pool_page_size != b.page_bytes:
                raise GeometryError(f"pool {out.name!r} buffer {i}: {b.page_bytes} page bytes are not "
                                    f"{out.pool_page_size} rows of {sum(b.segments)} bytes")
        return out


def cache_buffers(cache: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The pools of a transfer: one `[pages, rows, ...]` tensor or a sequence of them (all layers)."""
    bufs = [cache] if isinstance(cache, torch.Tensor) else list(cache)
    if not bufs:
        raise ValueError("cache must be a pool tensor or a non-empty sequence of them")
    for i, b in enumerate(bufs):
        canonical_pool(f"cache[{i}]", b)
        if b.shape[:2] != bufs[0].shape[:2]:
            raise ValueError(f"cache[{i}] has {list(b.shape[:2])} pages x rows, cache[0] "
                             f"{list(bufs[0].shape[:2])}: every buffer pages one loc space")
    return bufs


def buffer_layout(t: torch.Tensor, layout: str, pool_page_size: int, fmt: str = "auto",
                  row_shape: Sequence[int] | None = None) -> BufferLayout:
    """The BufferLayout of one contiguous paged tensor (`layout` as the tensor is stored)."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"a pool buffer must be a torch.Tensor, got {type(t).__name__}")
    if not t.is_contiguous():
        raise ValueError(f"pool buffer {list(t.shape)} is not contiguous: NIXL registers and moves whole "
                         f"pages of memory, so each buffer must be one dense allocation")
    e, pages = t.element_size(), t.shape[0]
    page_bytes = t.numel() * e // max(pages, 1)
    dtype = str(t.dtype).replace("torch.", "")
    if layout in ("NHD", "HND"):   # HND: one row segment per head
        axis = 1 if layout == "NHD" else 2
        if t.dim() <= axis or t.shape[axis] != pool_page_size:
            raise GeometryError(f"{layout} buffer {list(t.shape)} does not hold pool_page_size={pool_page_size} "
                                f"rows a page")
        h, rest = (1 if layout == "NHD" else t.shape[1]), tuple(t.shape[axis + 1:])
        return BufferLayout(dtype, fmt, rest if layout == "NHD" else (h, *rest), layout, (math.prod(rest) * e,) * h,
                            page_bytes)
    if layout == "page_major":
        if row_shape is None:
            raise ValueError("a page_major buffer needs its row_shape (the bytes of each row segment)")
        if page_bytes != pool_page_size * sum(row_shape) * e:
            raise GeometryError(f"page_major buffer of {page_bytes} bytes a page is not {pool_page_size} "
                                f"rows of {sum(row_shape) * e} bytes")
        return BufferLayout(dtype, fmt, tuple(row_shape), "page_major", tuple(int(s) * e for s in row_shape),
                            page_bytes)
    if layout == "page":
        return BufferLayout(dtype, fmt, tuple(row_shape or ()), "page", (), page_bytes)
    raise ValueError(f"layout must be one of {BUFFER_LAYOUTS}, got {layout!r}")


def kvpool_layout(pool, sub: str | None = None) -> tuple[PoolLayout, list[torch.Tensor]]:
    """(layout, buffers) of sub-pool `sub` of a built `KVPool`: every layer's paged buffers."""
    name = pool._sub_pool(sub)
    sp = pool.plan.pool(name)
    g = sp.geometry
    specs = {b.name: b for b in sp.spec.buffers}
    bufs = [(specs[bname], t) for layer in pool.buffers[name] for bname, t in layer.items()]
    # page-major buffers (the DSA indexer's, DeepSeek V4's) move as opaque whole pages
    layouts = tuple(buffer_layout(t, {"rows": "NHD", "hnd": "HND"}.get(b.layout, "page"), g.pool_page_size,
                                  pool.plan.kv_cache_dtype, row_shape=b.row_shape) for b, t in bufs)
    heads = pool.plan.parallel.kv_heads_per_rank(pool.plan.model.num_kv_heads) if pool.plan.model.num_kv_heads else 1
    return PoolLayout(name, g.page_size, g.loc_space_scale, g.num_pages, heads, layouts), [t for _, t in bufs]


def tensors_layout(name: str, tensors: Sequence[torch.Tensor], geometry: PageGeometry | None = None,
                   layout: str = "NHD", fmt: str = "auto", heads_per_rank: int | None = None) -> PoolLayout:
    """The layout of raw pool tensors (all `layout`, one page-size namespace)."""
    if not tensors:
        raise ValueError("a pool needs at least one buffer")
    t0 = tensors[0]
    pps = t0.shape[2] if layout == "HND" else t0.shape[1]
    geometry = geometry or PageGeometry.from_pool(t0.shape[0], pps)
    if geometry.num_pages != t0.shape[0]:
        raise GeometryError(f"geometry has {geometry.num_pages} pages but the buffers {t0.shape[0]}")
    bufs = tuple(buffer_layout(t, layout, geometry.pool_page_size, fmt) for t in tensors)
    for i, t in enumerate(tensors):
        if t.shape[0] != geometry.num_pages:
            raise GeometryError(f"buffer {i} has {t.shape[0]} pages, buffer 0 {geometry.num_pages}: "
                                f"every buffer pages one loc space")
    if heads_per_rank is None:
        heads_per_rank = t0.shape[1] if layout == "HND" else (t0.shape[2] if t0.dim() >= 4 else 1)
    return PoolLayout(name, geometry.page_size, geometry.loc_space_scale, geometry.num_pages, int(heads_per_rank), bufs)


@dataclass(frozen=True)
class Bridge:
    """Two compared layouts: the units each side's page ids count (`kvwrite.ops.pages.Units`)."""

    src: Units
    dst: Units


def bridge(src: PoolLayout, dst: PoolLayout, src_name: str = "src", dst_name: str = "dst") -> Bridge:
    """Compare two layouts: a Bridge when pages can move as they are, else a GeometryError naming every difference."""
    diff = []
    if len(src.buffers) != len(dst.buffers):
        diff.append(f"{src_name} has {len(src.buffers)} buffers, {dst_name} {len(dst.buffers)}")
    for f in ("loc_space_scale", "heads_per_rank"):
        if getattr(src, f) != getattr(dst, f):
            diff.append(f"{f}: {src_name} has {getattr(src, f)}, {dst_name} has {getattr(dst, f)}")
    for i, (a, b) in enumerate(zip(src.buffers, dst.buffers)):
        for f, x, y in zip(("dtype", "format", "row_shape", "layout", "segments"), a.row_key(), b.row_key()):
            if x != y:
                diff.append(f"buffer {i} {f}: {src_name} has {x!r}, {dst_name} has {y!r}")
    ps, pd = src.pool_page_size, dst.pool_page_size
    if ps != pd:
        if ps % pd and pd % ps:
            diff.append(f"pool_page_size: {src_name} has {ps}, {dst_name} has {pd}; pages bridge only when "
                        f"one is a whole multiple of the other")
        opaque = [i for i, b in enumerate(src.buffers) if not b.segments]
        if opaque:
            diff.append(f"pool_page_size: {src_name} has {ps}, {dst_name} has {pd}, but buffers {opaque} are "
                        f"opaque pages ({src.buffers[opaque[0]].layout!r}) that move only whole")
    if diff:
        raise GeometryError(f"pool {src.name!r} ({src_name}) and pool {dst.name!r} ({dst_name}) cannot exchange "
                            f"pages, nothing was moved: " + "; ".join(diff))
    unit = min(ps, pd)
    return Bridge(*(Units(p // unit, unit, lay.num_pages * (p // unit)) for p, lay in ((ps, src), (pd, dst))))
