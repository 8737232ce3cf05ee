"""PageGeometry: the page-size namespace, loc -> (page, offset), the allocator check."""
import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from kvwrite import GeometryError, PageGeometry


@given(page_size=st.integers(1, 256), num_pages=st.integers(1, 10**6), scale=st.integers(1, 8))
def test_derived_sizes(page_size, num_pages, scale):
    g = PageGeometry(page_size, num_pages, scale)
    assert g.pool_page_size == page_size * scale
    assert g.capacity == num_pages * page_size * scale


@given(pps=st.integers(1, 128), locs=st.lists(st.integers(-(2**40), 2**40), min_size=1, max_size=50))
def test_locate_is_floor_division_int64(pps, locs):
    g = PageGeometry(pps, 4)
    page, offset = g.locate(torch.tensor(locs, dtype=torch.int64))
    assert page.dtype == offset.dtype == torch.int64
    assert page.tolist() == [l // pps for l in locs]
    assert offset.tolist() == [l % pps for l in locs]
    assert [g.page_of(l) for l in locs] == page.tolist()


def test_locate_accepts_int32_and_beyond_int32_products():
    g = PageGeometry(64, 2**30)
    page, offset = g.locate(torch.tensor([2**31 - 1], dtype=torch.int32))
    assert (page.item(), offset.item()) == ((2**31 - 1) // 64, (2**31 - 1) % 64)
    assert g.capacity == 2**36


@pytest.mark.parametrize("name, args", [
    ("page_size", (0, 4)), ("page_size", (-16, 4)), ("num_pages", (16, 0)),
    ("loc_space_scale", (16, 4, 0)), ("page_size", (16.0, 4)), ("num_pages", (16, "4")),
    ("page_size", (True, 4)),
])
def test_bad_arguments_name_the_argument(name, args):
    with pytest.raises(ValueError, match=name):
        PageGeometry(*args)


def test_numpy_ints_are_accepted():
    g = PageGeometry(np.int64(16), np.int32(4))
    assert g.capacity == 64 and type(g.page_size) is int


def test_frozen():
    g = PageGeometry(16, 4)
    with pytest.raises(Exception):
        g.page_size = 32


def test_check_allocator_accepts_matching_namespace():
    PageGeometry(16, 17, loc_space_scale=4).check_allocator(64, 17 * 64)
    PageGeometry(16, 17, loc_space_scale=4).check_allocator(64, 100)


def test_check_allocator_refuses_33348_geometry():
    """DCP draft worker: allocator pages of page_size*dcp_size over the virtual space, pool kept
    the per-rank page size (sized for the virtual space + one per-rank padding page)."""
    page_size, dcp, virtual = 16, 4, 1024
    buggy = PageGeometry(page_size, virtual // page_size + 1)
    with pytest.raises(GeometryError, match=r"allocator pages hold 64.*pool_page_size=16.*loc_space_scale=4"):
        buggy.check_allocator(page_size * dcp, virtual + page_size * dcp)


def test_check_allocator_refuses_short_pool():
    g = PageGeometry(16, 4)
    with pytest.raises(GeometryError, match=r"\[0, 80\).*capacity=64.*at least 5"):
        g.check_allocator(16, 80)


@pytest.mark.parametrize("args", [(0, 10), (16, -1), (16.5, 10)])
def test_check_allocator_bad_arguments(args):
    with pytest.raises(ValueError, match="page_granularity|num_locs"):
        PageGeometry(16, 4).check_allocator(*args)
