"""The page-size namespace of one pool: the single source of every page fact.

Allocator, pools, kernels and configurator read `pool_page_size`, `capacity` and the
loc -> (page, offset) mapping from a `PageGeometry`; nobody passes a page size beside it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


class GeometryError(ValueError):
    """An allocator and a pool disagree on the page-size namespace (the SGLang #33348 class)."""


def require_positive_int(name: str, value: object) -> int:
    """Return `value` if it is a positive Python/numpy int, else raise ValueError naming it."""
    if isinstance(value, bool) or not hasattr(value, "__index__"):
        raise ValueError(f"{name} must be a positive int, got {value!r} ({type(value).__name__})")
    value = int(value)  # numpy / torch integer scalars
    if value <= 0:
        raise ValueError(f"{name} must be a positive int, got {value}")
    return value


@dataclass(frozen=True)
class PageGeometry:
    """`num_pages` pool pages of `page_size * loc_space_scale` token rows each.

    `loc_space_scale` is `dcp_size` for a pool indexed by the DCP virtual loc space (a
    replicated draft pool), else 1; the allocator serving the pool must page in
    `pool_page_size` units.
    """

    page_size: int
    num_pages: int
    loc_space_scale: int = 1

    def __post_init__(self) -> None:
        for name in ("page_size", "num_pages", "loc_space_scale"):
            object.__setattr__(self, name, require_positive_int(name, getattr(self, name)))

    @property
    def pool_page_size(self) -> int:
        """Token rows per pool page: the allocator's page granularity."""
        return self.page_size * self.loc_space_scale

    @property
    def capacity(self) -> int:
        """Token rows the pool backs; valid locs are `[0, capacity)`."""
        return self.num_pages * self.pool_page_size

    @classmethod
    def from_pool(cls, num_pages: int, pool_page_size: int) -> "PageGeometry":
        """The geometry of a cache tensor whose shape gives pages and rows per page."""
        return cls(page_size=pool_page_size, num_pages=num_pages)

    def locate(self, loc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, offset) of each loc as int64 tensors (floor division, like the kernels)."""
        loc = torch.as_tensor(loc).to(torch.int64)
        return torch.div(loc, self.pool_page_size, rounding_mode="floor"), torch.remainder(
            loc, self.pool_page_size
        )

    def page_of(self, loc: int) -> int:
        """Page index of one loc (floor division; negative for negative locs)."""
        return int(loc) // self.pool_page_size

    def check_allocator(self, page_granularity: int, num_locs: int) -> None:
        """Raise GeometryError unless an allocator paging `[0, num_locs)` in units of
        `page_granularity` hands out only locs whose whole pages this pool backs."""
        page_granularity = require_positive_int("page_granularity", page_granularity)
        num_locs = require_positive_int("num_locs", num_locs)
        if page_granularity != self.pool_page_size:
            raise GeometryError(
                f"allocator pages hold {page_granularity} locs but the pool's pages hold "
                f"pool_page_size={self.pool_page_size} (page_size={self.page_size} x "
                f"loc_space_scale={self.loc_space_scale}); build the pool with "
                f"loc_space_scale={page_granularity // self.page_size if page_granularity % self.page_size == 0 else '?'}"
                f" so that pool_page_size == {page_granularity}, or page the allocator in "
                f"{self.pool_page_size}-loc units"
            )
        if num_locs > self.capacity:
            raise GeometryError(
                f"allocator hands out locs [0, {num_locs}) but the pool backs only "
                f"capacity={self.capacity} (= {self.num_pages} pages x {self.pool_page_size}); "
                f"grow num_pages to at least {-(-num_locs // self.pool_page_size)} or shrink the "
                f"allocator to {self.capacity} locs"
            )
