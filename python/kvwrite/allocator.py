"""`PagedAllocator`: hands out whole pages of locs; page 0 is reserved for padding (SGLang's
convention) unless `reserve_padding_page=False` (vLLM's: padded tokens carry loc -1).

Under DCP the allocator pages the *virtual* loc space of all ranks: `PagedAllocator.for_dcp`
builds it over `num_locs * dcp_size` locs in pages of `page_size * dcp_size` (SGLang's
`DcpTokenToKVPoolAllocator`). Running out is a named error, never a bad loc.
"""
from __future__ import annotations

import torch

from kvwrite.geometry import require_positive_int


class AllocatorExhausted(RuntimeError):
    """The allocator has fewer free pages than asked for."""


class PagedAllocator:
    """Pages `[0, num_locs)` in `page_size`-loc pages; page 0 (the padding page) is never handed
    out unless `reserve_padding_page=False`. `alloc(n)` returns the locs of the
    `ceil(n / page_size)` whole pages it takes (int64, page after page, rows in order);
    `free(locs)` returns whole pages."""

    def __init__(self, num_locs: int, page_size: int, device: "torch.device | str" = "cpu", *,
                 reserve_padding_page: bool = True) -> None:
        self.num_locs = require_positive_int("num_locs", num_locs)
        self.page_size = require_positive_int("page_size", page_size)
        if not isinstance(reserve_padding_page, bool):
            raise TypeError(f"reserve_padding_page must be a bool, got {reserve_padding_page!r}")
        self.reserve_padding_page = reserve_padding_page
        self.first_page = int(reserve_padding_page)
        if self.num_locs % self.page_size:
            raise ValueError(f"num_locs={self.num_locs} must be a whole number of pages of {self.page_size}")
        self.num_pages = self.num_locs // self.page_size
        if self.num_pages < 1 + self.first_page:
            raise ValueError(f"num_locs={self.num_locs} holds {self.num_pages} page(s); page 0 is the "
                             "padding page, so at least 2 are needed")
        self.device = torch.device(device)
        self.dcp_size = 1
        self._next = self.first_page   # pages [next, num_pages) were never handed out
        self._freed: list[int] = []    # pages handed back
        self._used = torch.zeros(self.num_pages, dtype=torch.bool)

    @classmethod
    def for_dcp(cls, num_locs: int, page_size: int, dcp_size: int, device: "torch.device | str" = "cpu",
                *, reserve_padding_page: bool = True) -> "PagedAllocator":
        """The shared allocator of `dcp_size` ranks that each hold `num_locs` locs in pages of
        `page_size`: the virtual space `num_locs * dcp_size` in pages of `page_size * dcp_size`."""
        dcp_size = require_positive_int("dcp_size", dcp_size)
        a = cls(require_positive_int("num_locs", num_locs) * dcp_size,
                require_positive_int("page_size", page_size) * dcp_size, device,
                reserve_padding_page=reserve_padding_page)
        a.dcp_size = dcp_size
        return a

    @property
    def free_pages(self) -> int:
        return self.num_pages - self._next + len(self._freed)

    @property
    def usable_locs(self) -> int:
        """Locs that can be handed out: every page but the padding page (if reserved)."""
        return (self.num_pages - self.first_page) * self.page_size

    def alloc_pages(self, num_pages: int) -> torch.Tensor:
        """`num_pages` free page indices (int64)."""
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages < 0:
            raise ValueError(f"num_pages must be an int >= 0, got {num_pages!r}")
        if num_pages > self.free_pages:
            raise AllocatorExhausted(f"asked for {num_pages} page(s) of {self.page_size} locs but only "
                                     f"{self.free_pages} of {self.num_pages - self.first_page} are free")
        take = min(num_pages, len(self._freed))
        pages = self._freed[len(self._freed) - take:]
        del self._freed[len(self._freed) - take:]
        fresh = num_pages - take
        pages += range(self._next, self._next + fresh)
        self._next += fresh
        out = torch.tensor(pages, dtype=torch.int64)
        self._used[out] = True
        return out

    def alloc(self, n: int) -> torch.Tensor:
        """The locs of `ceil(n / page_size)` whole free pages (int64, on the allocator's device)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be an int >= 0, got {n!r}")
        pages = self.alloc_pages(-(-n // self.page_size))
        locs = pages[:, None] * self.page_size + torch.arange(self.page_size, dtype=torch.int64)
        return locs.flatten().to(self.device)

    def free(self, locs: torch.Tensor) -> None:
        """Return the pages of `locs` (whole pages handed out by `alloc`)."""
        locs = torch.as_tensor(locs).to("cpu", torch.int64).flatten()
        if locs.numel() == 0:
            return
        low = self.first_page * self.page_size
        if int(locs.min()) < low or int(locs.max()) >= self.num_locs:
            raise ValueError(f"locs must be in [{low}, {self.num_locs})"
                             + (" (page 0 is the padding page)" if self.first_page else ""))
        pages = torch.unique(torch.div(locs, self.page_size, rounding_mode="floor"))
        if locs.numel() != pages.numel() * self.page_size or torch.unique(locs).numel() != locs.numel():
            raise ValueError("free() takes the locs of whole pages, each loc once")
        if not bool(self._used[pages].all()):
            bad = pages[~self._used[pages]].tolist()
            raise ValueError(f"pages {bad[:8]} are not allocated (double free?)")
        self._used[pages] = False
        self._freed += pages.tolist()

    def __repr__(self) -> str:
        dcp = f", dcp_size={self.dcp_size}" if self.dcp_size > 1 else ""
        dcp += "" if self.reserve_padding_page else ", reserve_padding_page=False"
        return (f"PagedAllocator(num_locs={self.num_locs}, page_size={self.page_size}{dcp}, "
                f"free_pages={self.free_pages})")
