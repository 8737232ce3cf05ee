"""kvwrite.transfer's checks without NIXL: layouts compared (bridged or refused), page ids
checked in every mode, and descriptors that never leave a pool: applied here as plain memory
copies, they move exactly the bytes an indexing oracle moves."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvwrite import ErrorBuffer, GeometryError, PageGeometry
from kvwrite.transfer import (DescriptorOutsidePool, PoolAddresses, PoolLayout, Region, TransferPageError, bridge,
                              check_pairs, pair_descs, tensors_layout)

WHERE = {"src": "agent 'p', pool 'kv'", "dst": "agent 'd', pool 'kv'"}


def _pool(pages, rows, layout="NHD", dtype=torch.bfloat16, heads=2, dim=8, scale=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    shape = (pages, rows, heads, dim) if layout == "NHD" else (pages, heads, rows, dim)
    ts = [torch.randint(0, 256, (torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size(),),
                        generator=g, dtype=torch.uint8).view(dtype).view(shape) for _ in range(2)]
    geo = PageGeometry(rows // scale, pages, scale)
    return ts, tensors_layout("kv", ts, geo, layout)


def _addresses(ts, lay, side):
    return PoolAddresses(lay, [Region(t.data_ptr(), t.numel() * t.element_size()) for t in ts], side)


def _apply(descs_s, descs_d, src, dst):
    """Run descriptors as memory copies between the byte views of the two pools' buffers."""
    def locate(bufs, addr, n):
        for b in bufs:
            base = b.data_ptr()
            if base <= addr and addr + n <= base + b.numel():
                return b, addr - base
        raise AssertionError(f"descriptor [{addr}, +{n}) is in no buffer")
    sb = [t.view(-1).view(torch.uint8) for t in src]
    db = [t.view(-1).view(torch.uint8) for t in dst]
    for (sa, n, _), (da, n2, _) in zip(descs_s.tolist(), descs_d.tolist()):
        assert n == n2
        s, so = locate(sb, sa, n)
        d, do = locate(db, da, n)
        d[do:do + n] = s[so:so + n]


def _oracle(src, dst, sp, dp, layout):
    views = lambda ts: ts if layout == "NHD" else [t.transpose(1, 2) for t in ts]   # noqa: E731
    sv, out = views(src), [v.clone() for v in views(dst)]
    ps, pd = sv[0].shape[1], out[0].shape[1]
    u = min(ps, pd)
    for s, d in zip(sp, dp):
        for o, v in zip(out, sv):
            o[d * u // pd, d * u % pd:d * u % pd + u] = v[s * u // ps, s * u % ps:s * u % ps + u]
    return out


def _bytes(t):
    return t.contiguous().view(-1).view(torch.uint8)


@given(st.sampled_from(["NHD", "HND"]), st.sampled_from([(4, 4), (4, 16), (16, 4), (8, 16)]),
       st.integers(1, 12), st.randoms(use_true_random=False))
def test_descriptors_move_the_oracle_bytes(layout, rows, n, rnd):
    rs, rd = rows
    src, ls = _pool(6, rs, layout, seed=1)
    dst, ld = _pool(5, rd, layout, seed=2)
    br = bridge(ls, ld)
    sp = rnd.sample(range(br.src.count), min(n, br.src.count, br.dst.count))
    dp = rnd.sample(range(br.dst.count), len(sp))
    want = _oracle(src, dst, sp, dp, layout)
    pairs = check_pairs(sp, dp, br, WHERE, "assert")
    ds, dd = pair_descs(_addresses(src, ls, "src"), _addresses(dst, ld, "dst"), pairs.src, pairs.dst, br)
    unit_bytes = br.src.rows * 2 * 8 * 2
    assert int(ds[:, 1].sum()) == len(sp) * unit_bytes * len(src)
    _apply(ds, dd, src, dst)
    got = dst if layout == "NHD" else [t.transpose(1, 2) for t in dst]
    assert all(torch.equal(_bytes(a), _bytes(b)) for a, b in zip(got, want))


def test_contiguous_runs_merge_into_one_descriptor():
    src, ls = _pool(8, 4)
    dst, ld = _pool(8, 4, seed=3)
    br = bridge(ls, ld)
    ds, dd = pair_descs(_addresses(src, ls, "src"), _addresses(dst, ld, "dst"), np.arange(1, 6), np.arange(2, 7), br)
    assert ds.shape == (2, 3) and ds[:, 1].tolist() == [5 * 4 * 2 * 8 * 2] * 2   # one run per buffer
    ds, _ = pair_descs(_addresses(src, ls, "src"), _addresses(dst, ld, "dst"), np.array([1, 2, 4]),
                       np.array([2, 3, 5]), br)
    assert ds.shape[0] == 4   # [1, 2] and [4] in each buffer


def test_a_descriptor_outside_either_pool_cannot_be_made():
    """Whatever ids reach the builder (the checks bypassed), no span leaves a registered region."""
    src, ls = _pool(4, 16)
    dst, ld = _pool(2, 64, seed=3)
    br = bridge(ls, ld)                        # dst has 2 pages of 64 = 8 units of 16 rows
    sa, da = _addresses(src, ls, "src"), _addresses(dst, ld, "agent 'd'")
    for units in ([8], [-1], [7, 9], [2 ** 40]):
        with pytest.raises(DescriptorOutsidePool, match="agent 'd' pool 'kv' buffer 0"):
            pair_descs(sa, da, np.zeros(len(units), np.int64), np.array(units), br)
    with pytest.raises(DescriptorOutsidePool, match="src pool"):
        pair_descs(sa, da, np.array([4]), np.array([0]), br)
    # a region smaller than the layout it claims is refused when the addresses are bound
    with pytest.raises(GeometryError, match="region of"):
        PoolAddresses(ld, [Region(dst[0].data_ptr(), dst[0].numel()), Region(dst[1].data_ptr(), 10)], "dst")
    ds, dd = pair_descs(sa, da, np.array([3]), np.array([7]), br)   # the last unit fits
    assert int(dd[0, 0] + dd[0, 1]) <= dst[0].data_ptr() + dst[0].numel() * 2


def test_bridge_units_and_refusals():
    _, a = _pool(4, 16)
    _, b = _pool(2, 64)
    br = bridge(a, b)
    assert (br.src.factor, br.src.rows, br.src.count, br.dst.factor, br.dst.count) == (1, 16, 4, 4, 8)
    br = bridge(b, a)
    assert (br.src.factor, br.src.count, br.dst.factor, br.dst.count) == (4, 8, 1, 4)
    _, c = _pool(4, 24)
    with pytest.raises(GeometryError, match="pool_page_size: src has 16, dst has 24"):
        bridge(a, c)
    _, d = _pool(4, 16, dtype=torch.float16)
    with pytest.raises(GeometryError, match="buffer 0 dtype: src has 'bfloat16', dst has 'float16'"):
        bridge(a, d)
    _, e = _pool(4, 16, heads=4, dim=4)
    with pytest.raises(GeometryError, match="heads_per_rank: src has 2, dst has 4"):
        bridge(a, e)
    _, f = _pool(4, 16, scale=2)
    with pytest.raises(GeometryError, match="loc_space_scale: src has 1, dst has 2"):
        bridge(a, f)
    _, h = _pool(4, 16, "HND")
    with pytest.raises(GeometryError, match="buffer 0 layout: src has 'NHD', dst has 'HND'"):
        bridge(a, h)


def test_published_layout_round_trips_and_forgeries_are_refused():
    _, a = _pool(4, 16, scale=2)
    d = a.to_dict()
    assert PoolLayout.from_dict(d) == a and d["pool_page_size"] == 16
    with pytest.raises(GeometryError, match="published pool_page_size 32"):
        PoolLayout.from_dict({**d, "pool_page_size": 32})
    forged = {**d, "buffers": [{**d["buffers"][0], "page_bytes": 10 ** 6}, d["buffers"][1]]}
    with pytest.raises(GeometryError, match="buffer 0"):
        PoolLayout.from_dict(forged)
    for field in ("page_size", "loc_space_scale", "num_pages"):
        with pytest.raises(GeometryError, match=f"published {field} must be a positive int, got 0"):
            PoolLayout.from_dict({**d, field: 0, "pool_page_size": 0 if field != "num_pages" else 16})


def test_page_ids_in_every_check_mode():
    _, a = _pool(4, 16)
    _, b = _pool(2, 64)
    br = bridge(a, b)
    with pytest.raises(TransferPageError, match=r"pair 1 names dst page 8 of dst agent 'd', pool 'kv', which has "
                                                r"pages \[0, 8\) \(in units of 16 rows\); nothing was moved"):
        check_pairs([0, 1], [0, 8], br, WHERE, "assert")
    with pytest.raises(TransferPageError, match="2 bad page ids; the first: pair 0 names src page 4 of src agent 'p'"):
        check_pairs(torch.tensor([4, 5]), [0, 1], br, WHERE, "assert")
    with pytest.raises(TransferPageError, match="padding must be -1"):
        check_pairs([-3], [0], br, WHERE, "assert")
    p = check_pairs([0, -1, 2], [1, 2, -1], br, WHERE, "assert")     # -1 on either side: padding
    assert p.src.tolist() == [0] and p.dst.tolist() == [1] and p.skipped == 2
    errors = ErrorBuffer("cpu")
    p = check_pairs([0, 1, 2], [1, 9, 3], br, WHERE, "guard", errors)
    assert p.src.tolist() == [0, 2] and p.skipped == 1
    assert "dst page 9" in str(errors.error())
    p = check_pairs([0, -2], [1, 3], br, WHERE, "off")             # off: negative ids skipped ...
    assert p.src.tolist() == [0]
    with pytest.raises(TransferPageError, match="names dst page 8"):   # ... but never past a pool
        check_pairs([0], [8], br, WHERE, "off")
    with pytest.raises(ValueError, match="pair up one to one"):
        check_pairs([0, 1], [0], br, WHERE, "assert")
    with pytest.raises(ValueError, match="check must be one of"):
        check_pairs([0], [0], br, WHERE, "strict")
