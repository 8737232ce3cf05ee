"""PagedAllocator: whole pages, page 0 reserved, DCP construction, exhaustion is a named error."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from kvwrite import AllocatorExhausted, PagedAllocator


def test_alloc_hands_out_whole_pages_never_page_zero():
    a = PagedAllocator(64, 16)
    assert a.free_pages == 3 and a.usable_locs == 48
    locs = a.alloc(20)
    assert locs.dtype == torch.int64 and locs.tolist() == list(range(16, 48))
    assert a.alloc(0).numel() == 0
    last = a.alloc(16)
    assert last.tolist() == list(range(48, 64))
    with pytest.raises(AllocatorExhausted, match="asked for 1 page"):
        a.alloc(1)
    a.free(locs[:16])
    assert a.alloc(3).tolist() == list(range(16, 32))


def test_free_checks_its_argument():
    a = PagedAllocator(64, 16)
    locs = a.alloc(32)
    for bad, msg in ((locs[:5], "whole pages"), (torch.arange(0, 16), r"page 0"), (torch.arange(48, 64), "not allocated"),
                     (torch.cat([locs[:16], locs[:16]]), "each loc once"), (torch.tensor([64]), r"\[16, 64\)")):
        with pytest.raises(ValueError, match=msg):
            a.free(bad)
    a.free(locs)
    with pytest.raises(ValueError, match="double free"):
        a.free(locs[:16])


def test_construction_errors():
    for args, msg in (((60, 16), "whole number of pages"), ((16, 16), "at least 2"), ((0, 16), "num_locs"),
                      ((64, 0), "page_size")):
        with pytest.raises(ValueError, match=msg):
            PagedAllocator(*args)


def test_dcp_allocator_pages_the_virtual_space():
    a = PagedAllocator.for_dcp(num_locs=1024 + 64, page_size=64, dcp_size=4)
    assert (a.num_locs, a.page_size, a.dcp_size) == ((1024 + 64) * 4, 256, 4)
    locs = a.alloc(a.usable_locs)
    assert locs.min() == 256 and locs.max() == a.num_locs - 1 and locs.unique().numel() == 1024 * 4
    # each virtual page holds page_size locs of every rank
    page = locs[:256]
    assert all(int((page % 4 == r).sum()) == 64 for r in range(4))


@given(ops=st.lists(st.integers(-5, 9), max_size=30), page=st.sampled_from([1, 4, 16]), pages=st.integers(2, 12))
def test_alloc_free_never_hands_out_a_loc_twice(ops, page, pages):
    a = PagedAllocator(page * pages, page)
    held: list[torch.Tensor] = []
    for op in ops:
        if op < 0 and held:
            a.free(held.pop(op % len(held)))
            continue
        n = abs(op) * page
        if -(-n // page) > a.free_pages:
            with pytest.raises(AllocatorExhausted):
                a.alloc(n)
            continue
        got = a.alloc(n)
        assert got.numel() == -(-n // page) * page
        held.append(got)
        everything = torch.cat(held) if held else torch.empty(0, dtype=torch.int64)
        assert everything.unique().numel() == everything.numel()
        assert bool((everything >= page).all()) and bool((everything < page * pages).all())
    assert a.free_pages == pages - 1 - sum(h.numel() for h in held) // page
