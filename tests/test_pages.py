"""Page moves (copy_pages, gather, slot_mapping, move_rows) on every backend against the torch
reference: bytes of whole canary buffers, every check mode, records, refused geometry."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from kvwrite import ErrorBuffer, GeometryError, OutOfBoundsWrite, PageGeometry, PageTable
from kvwrite.errors import KIND_BLOCK_INDEX, KIND_BLOCK_PAGE, KIND_BLOCK_ROW, KIND_DST_PAGE, KIND_SRC_PAGE
from kvwrite.ops import pages as ops_pages

from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes

ALL = ["torch", *BACKENDS]


def _pools(src_shape, dst_shape, dtype, seed=0):
    return CanaryBuffer({"src": (src_shape, dtype), "dst": (dst_shape, dtype)}, seed=seed)


def _ids(values, dtype=torch.int64):
    return torch.tensor(values, dtype=dtype, device=DEVICE)


def _run_copy(backend, buf, sp, dp, view=lambda t: t, **kw):
    kvwrite.copy_pages(view(buf["src"]), view(buf["dst"]), sp, dp, backend=backend, **kw)


# --- copy_pages ------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("src_shape, dst_shape, sp, dp", [
    ((6, 4, 2, 8), (5, 4, 2, 8), [1, 5, -1, 0, 3], [4, 0, 2, -1, 1]),         # same page size
    ((6, 8, 2, 8), (5, 4, 2, 8), [11, 0, 3, -1], [0, 4, 1, 2]),               # src pages hold 2 units
    ((9, 2, 2, 8), (3, 8, 2, 8), [0, 8, 3, 4, 2], [11, 0, 5, 6, -1]),         # dst pages hold 4 units
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32])
def test_copy_pages_matches_reference(backend, src_shape, dst_shape, sp, dp, dtype):
    buf = _pools(src_shape, dst_shape, dtype)
    ref, original = buf.clone(), buf.raw.clone()
    for idx in (torch.int64, torch.int32):
        _run_copy("torch", ref, _ids(sp, idx), _ids(dp, idx))
        _run_copy(backend, buf, _ids(sp, idx), _ids(dp, idx))
    assert_same_bytes(buf, ref, original)
    assert not torch.equal(buf.raw, original)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_pages_between_nhd_and_hnd_views(backend):
    """Strided pools (an HND cache's [pages, rows, H, D] view) copy row by row, head by head."""
    buf = CanaryBuffer({"src": ((4, 3, 4, 8), torch.float16), "dst": ((5, 3, 4, 8), torch.float16)})
    ref, original = buf.clone(), buf.raw.clone()
    hnd = lambda b: b["src"].transpose(1, 2)          # noqa: E731  [pages, H=3, rows=4, D] as rows x heads
    for b, be in ((ref, "torch"), (buf, backend)):
        kvwrite.copy_pages(hnd(b), b["dst"].view(5, 4, 3, 8), _ids([3, 0, 2]), _ids([0, 4, 2]), backend=be)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["guard", "assert"])
def test_copy_pages_bad_ids_are_reported_and_never_copied(backend, mode):
    buf = _pools((6, 8, 2, 4), (5, 4, 2, 4), torch.float32)   # src: 12 units of 4 rows, dst: 5
    original = buf.raw.clone()
    sp, dp = _ids([1, 12, 2, 3, -3]), _ids([0, 1, 5, -1, 2])
    if mode == "assert":
        with pytest.raises(OutOfBoundsWrite) as info:
            _run_copy(backend, buf, sp, dp, check="assert")
        assert torch.equal(buf.raw, original)                 # nothing moved
        err = info.value
    else:
        errors = ErrorBuffer(DEVICE)
        ref = buf.clone()
        _run_copy("torch", ref, _ids([1]), _ids([0]))          # only the good pair moves
        _run_copy(backend, buf, sp, dp, check="guard", errors=errors)
        assert_same_bytes(buf, ref, original)
        err = errors.error()
    assert (err.op, err.token_index, err.kind, err.target, err.limit, err.count) == (
        "copy_pages", 1, KIND_SRC_PAGE, 12, 12, 3)
    assert "pair 1 names src page 12, but src has pages [0, 12)" in str(err)


@pytest.mark.parametrize("backend", ALL)
def test_copy_pages_dst_record(backend):
    buf = _pools((6, 4, 4), (3, 4, 4), torch.bfloat16)
    errors = ErrorBuffer(DEVICE)
    _run_copy(backend, buf, _ids([0, 1]), _ids([-1, 3]), check="guard", errors=errors)
    err = errors.error()
    assert (err.kind, err.token_index, err.target, err.limit) == (KIND_DST_PAGE, 1, 3, 3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_copy_pages_off_mode_skips_negative_ids(backend):
    buf = _pools((4, 4, 8), (4, 4, 8), torch.float16)
    ref, original = buf.clone(), buf.raw.clone()
    _run_copy("torch", ref, _ids([2]), _ids([1]))
    _run_copy(backend, buf, _ids([2, -5, 1]), _ids([1, 0, -7]), check="off")
    assert_same_bytes(buf, ref, original)


def test_copy_pages_refuses_mismatched_pools_before_moving():
    a = torch.zeros(4, 6, 2, 8)
    for dst, what in ((torch.zeros(4, 4, 2, 8), "whole multiple"), (torch.zeros(4, 6, 2, 4), "row shapes"),
                      (torch.zeros(4, 6, 2, 8, dtype=torch.float16), "dtypes")):
        with pytest.raises(GeometryError, match=what):
            kvwrite.copy_pages(a, dst, _ids([0]), _ids([0]))
    with pytest.raises(ValueError, match="pair up"):
        kvwrite.copy_pages(a, torch.zeros_like(a), _ids([0, 1]), _ids([0]))
    with pytest.raises(TypeError, match="src_pages"):
        kvwrite.copy_pages(a, torch.zeros_like(a), _ids([0]).float(), _ids([0]))


def test_copy_pages_staged_path_matches_the_direct_one():
    """The cross-device path (check, stage, move, scatter) run on one device: same bytes, same
    record."""
    buf = _pools((6, 8, 2, 4), (5, 4, 2, 4), torch.bfloat16)
    ref, original = buf.clone(), buf.raw.clone()
    sp, dp = _ids([1, 12, 2, 3, -1]), _ids([0, 1, 4, 2, 2])
    e1, e2 = ErrorBuffer(DEVICE), ErrorBuffer(DEVICE)
    _run_copy("torch", ref, sp, dp, check="guard", errors=e1)
    ops_pages._copy_across(buf["src"], buf["dst"], sp, dp, "guard", e2, "auto")
    assert_same_bytes(buf, ref, original)
    assert str(e1.error()) == str(e2.error())


# --- gather ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype, shape", [(torch.bfloat16, (5, 4, 2, 8)), (torch.float8_e5m2, (5, 4, 16)),
                                          (torch.uint8, (3, 4, 656)), (torch.float32, (6, 2, 3, 5))])
def test_gather_rows_in_the_cache_dtype(backend, dtype, shape):
    buf = CanaryBuffer({"cache": (shape, dtype), "out": ((7, *shape[2:]), dtype)})
    ref, original = buf.clone(), buf.raw.clone()
    cap = shape[0] * shape[1]
    loc = _ids([3, cap - 1, -1, 0, 5, -1, 7])
    for b, be in ((ref, "torch"), (buf, backend)):
        got = kvwrite.gather(b["cache"], loc, backend=be, out=b["out"])
        assert got.dtype == dtype and got.data_ptr() == b["out"].data_ptr()
    assert_same_bytes(buf, ref, original)
    rows = buf["cache"].flatten(0, 1)
    assert torch.equal(buf["out"][0].view(torch.uint8), rows[3].view(torch.uint8))
    assert not buf["out"][2].view(torch.uint8).any()
    fresh = kvwrite.gather(buf["cache"], loc.to(torch.int32), backend=backend)
    assert torch.equal(fresh.view(torch.uint8), buf["out"].view(torch.uint8))


@pytest.mark.parametrize("backend", ALL)
def test_gather_bad_loc_guard_and_assert(backend):
    cache = torch.randn(4, 4, 2, 8, device=DEVICE)
    errors = ErrorBuffer(DEVICE)
    out = kvwrite.gather(cache, _ids([1, 16, -1, -2]), check="guard", errors=errors, backend=backend)
    assert not out[1].any() and not out[3].any() and torch.equal(out[0], cache[0, 1])
    err = errors.error()
    assert (err.op, err.token_index, err.loc, err.count) == ("gather", 1, 16, 2)
    assert "token 1 reads loc 16 from page 4" in str(err)
    with pytest.raises(OutOfBoundsWrite, match="reads loc 16"):
        kvwrite.gather(cache, _ids([1, 16]), check="assert", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gather_through_a_page_table(backend):
    cache = torch.randn(6, 4, 3, 2, device=DEVICE).to(torch.float8_e4m3fn)
    t = PageTable(_ids([0, 0, 1, 1, 2], torch.int32), _ids([0, 5, 3, 9, 0], torch.int32),
                  _ids([4, 1, 2, 5], torch.int32), _ids([0, 2, 3, 4], torch.int32))
    e_ref, e = ErrorBuffer(DEVICE), ErrorBuffer(DEVICE)
    want = kvwrite.gather(cache, t, backend="torch", check="guard", errors=e_ref)
    got = kvwrite.gather(cache, t, backend=backend, check="guard", errors=e)
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert torch.equal(want[1].view(torch.uint8), cache[1, 1].view(torch.uint8))
    assert str(e.error()) == str(e_ref.error()) and e.error().count == 1   # position 9: past batch 1's page


# --- slot_mapping ----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["off", "guard"])
def test_slot_mapping_matches_reference(backend, mode):
    bt = _ids([[3, 1, 7], [2, -1, 0], [5, 9, 6]], torch.int32)
    geo = PageGeometry(page_size=4, num_pages=8)
    b = _ids([0, 0, 1, 1, -1, 3, 2, 2, 0, 2, 1], torch.int32)
    p = _ids([1, 9, 3, 6, 0, 0, 2, 5, 12, -1, -3], torch.int32)
    e_ref, e = ErrorBuffer(DEVICE), ErrorBuffer(DEVICE)
    want = kvwrite.slot_mapping(bt, b, p, geo, check=mode, errors=e_ref, backend="torch")
    got = kvwrite.slot_mapping(bt, b, p, geo, check=mode, errors=e, backend=backend)
    assert got.tolist() == want.tolist()
    expect = [13, 29, 11, -1, -1, -1, 22, 37 if mode == "off" else -1, -1, -1, -1]
    assert want.tolist() == expect
    if mode == "guard":
        assert e.tensor.tolist() == e_ref.tensor.tolist()
        err = e.error()
        assert (err.kind, err.token_index, err.count) == (KIND_BLOCK_PAGE, 3, 5)


@pytest.mark.parametrize("backend", ALL)
def test_slot_mapping_records_each_kind(backend):
    bt = _ids([[3, 1], [2, 0]])
    geo = PageGeometry(page_size=16, num_pages=4)
    for b, p, kind, target, limit in ((2, 0, KIND_BLOCK_ROW, 2, 2), (0, 40, KIND_BLOCK_INDEX, 2, 2),
                                      (0, -5, KIND_BLOCK_INDEX, -1, 2)):
        errors = ErrorBuffer(DEVICE)
        out = kvwrite.slot_mapping(bt, _ids([0, b]), _ids([17, p]), geo, check="guard", errors=errors,
                                   backend=backend)
        assert out.tolist() == [17, -1]
        err = errors.error()
        assert (err.kind, err.token_index, err.target, err.limit, err.batch, err.position) == (
            kind, 1, target, limit, b, p)
        with pytest.raises(OutOfBoundsWrite):
            kvwrite.slot_mapping(bt, _ids([0, b]), _ids([17, p]), geo, check="assert", backend=backend)
    bad = kvwrite.slot_mapping(_ids([[9]]), _ids([0]), _ids([3]), geo, check="guard", errors=errors, backend=backend)
    assert bad.tolist() == [-1]


# --- move_rows -------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ALL)
def test_move_rows_reads_every_source_first(backend):
    buf = CanaryBuffer({"cache": ((4, 4, 2, 8), torch.bfloat16)})
    ref, original = buf.clone(), buf.raw.clone()
    src, dst = _ids([1, 2, 3, -1, 7]), _ids([2, 3, 9, 4, -1])     # a chain: 3 <- 2 <- 1 (old rows)
    rows = ref["cache"].view(16, 2, 8)
    rows[torch.tensor([2, 3, 9])] = rows[torch.tensor([1, 2, 3])].clone()
    kvwrite.move_rows(buf["cache"], src, dst, backend=backend)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_move_rows_bad_locs(backend):
    cache = torch.randn(2, 4, 8, device=DEVICE)
    before = cache.clone()
    errors = ErrorBuffer(DEVICE)
    kvwrite.move_rows(cache, _ids([0, 9, 1]), _ids([1, 2, 8]), check="guard", errors=errors, backend=backend)
    want = before.clone().view(8, 8)
    want[1] = before.view(8, 8)[0]
    assert torch.equal(cache.view(8, 8), want)
    err = errors.error()
    assert err.op == "move_rows" and err.count == 2 and err.token_index == 1


# --- engine adapters -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ALL)
def test_vllm_swap_blocks_in_kernel_blocks(backend):
    """block_size_in_bytes smaller than the logical block (vLLM #30692): ids count kernel blocks."""
    from kvwrite.compat import vllm

    buf = CanaryBuffer({"src": ((4, 16, 2, 8), torch.bfloat16), "dst": ((3, 16, 2, 8), torch.bfloat16)})
    original = buf.raw.clone()
    bsb = 8 * 2 * 8 * 2                                    # a kernel block: 8 of the 16 rows
    mapping = _ids([[1, 0], [6, 5], [7, -1], [0, 3]])
    want = buf["dst"].clone().view(torch.uint8).view(-1, bsb)
    src_bytes = buf["src"].view(torch.uint8).view(-1, bsb)
    for s, d in mapping.tolist():
        if s >= 0 and d >= 0:
            want[d] = src_bytes[s]
    vllm.swap_blocks(buf["src"], buf["dst"], bsb, mapping, backend=backend)
    assert torch.equal(buf["dst"].view(torch.uint8).view(-1, bsb), want)
    assert torch.equal(buf.raw[buf.canary_mask()], original[buf.canary_mask()])
    errors = ErrorBuffer(DEVICE)
    vllm.swap_blocks(buf["src"], buf["dst"], bsb, _ids([[8, 0], [0, 6]]), check="guard", errors=errors,
                     backend=backend)
    assert errors.error().count == 2 and errors.error().target == 8


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("starts", [False, True])
def test_vllm_cp_gather_cache(backend, starts):
    from kvwrite.compat import vllm

    cache = torch.randn(8, 4, 6, device=DEVICE).to(torch.float8_e4m3fn)
    bt = _ids([[3, 1, 7], [2, 0, 5]], torch.int32)
    cu = _ids([0, 5, 9], torch.int32)
    seq_starts = _ids([2, 1], torch.int32) if starts else None
    dst = torch.full((11, 6), 7, dtype=torch.uint8, device=DEVICE).view(torch.float8_e4m3fn)
    want = dst.clone()
    for b in range(2):
        for t in range(int(cu[b + 1] - cu[b])):
            p = t + (int(seq_starts[b]) if starts else 0)
            want[int(cu[b]) + t] = cache[int(bt[b, p // 4]), p % 4]
    vllm.cp_gather_cache(cache, dst, bt, cu, 2, seq_starts, backend=backend)
    assert torch.equal(dst.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("backend", ALL)
def test_sglang_move_kv_cache_every_layer(backend):
    from kvwrite.compat import sglang

    k = [torch.randn(12, 2, 4, device=DEVICE) for _ in range(2)]
    v = [torch.randn(12, 2, 4, device=DEVICE).to(torch.bfloat16) for _ in range(2)]
    tgt, src = _ids([5, 6, 7, -1]), _ids([6, 7, 1, 3])
    want = [b.clone() for b in k + v]
    for w in want:
        w[tgt[:3]] = w[src[:3]].clone()
    sglang.move_kv_cache(k, v, tgt, src, backend=backend)
    for got, w in zip(k + v, want):
        assert torch.equal(got, w)
    with pytest.raises(OutOfBoundsWrite, match="move_rows"):
        sglang.move_kv_cache(k[0], v[0], _ids([12]), _ids([0]), check="assert", backend=backend)


# --- the configurator's pools ----------------------------------------------------------------------

@pytest.mark.parametrize("variant, kv", [("mha", "auto"), ("mla", "fp8_e4m3"), ("dsa", "fp8_ds_mla")])
def test_kvpool_page_moves_cover_every_layer(variant, kv):
    from config_models import TINY
    from kvwrite import KVCacheConfigurator, ParallelSpec

    conf = KVCacheConfigurator(TINY[variant], ParallelSpec(), page_size=4, kv_cache_dtype=kv, max_total_num_tokens=32)
    plan = conf.plan()
    scales = 1.0 if kv.startswith("fp8_e") else None
    a = plan.build(DEVICE, check="guard", scales=scales)
    b = plan.build(DEVICE, check="guard", scales=scales)
    names = [p.name for p in plan.pools]
    for layer in a.buffers[names[0]]:
        for t in layer.values():
            t.view(torch.uint8).copy_(torch.randint(0, 256, t.view(torch.uint8).shape, dtype=torch.uint8))
    pool = names[0] if len(names) > 1 else None
    src, dst = _ids([1, 3]), _ids([2, 0])
    a.copy_pages(b, src, dst, pool=pool)
    views_a, views_b = a.page_buffers(pool), b.page_buffers(pool)
    assert len(views_a) >= len(a.buffers[names[0]])
    for x, y in zip(views_a, views_b):
        assert torch.equal(y[2].view(torch.uint8), x[1].view(torch.uint8))
        assert torch.equal(y[0].view(torch.uint8), x[3].view(torch.uint8))
        assert not y[1].view(torch.uint8).any()
    lid = next(iter(a._index[names[0]]))
    rows = a.gather(lid, _ids([4, -1]), pool=pool)
    for name, r in rows.items():
        assert torch.equal(r[0].view(torch.uint8), a._views(names[0], a.layer(names[0], lid))[name][1, 0].view(torch.uint8))
    a.move_rows(_ids([4]), _ids([8]), pool=pool)
    for x in a.page_buffers(pool):
        assert torch.equal(x[2, 0].view(torch.uint8), x[1, 0].view(torch.uint8))
    a.copy_pages(b, _ids([99]), _ids([0]), pool=pool)
    assert a.errors.error() is not None and a.errors.error().kind == KIND_SRC_PAGE


def test_page_ops_trace_and_pass_opcheck():
    """torch.compile(fullgraph=True, inductor) traces the four page moves (same results as eager)
    and torch.library.opcheck passes their schemas, fake kernels and mutation annotations."""
    from torch.library import opcheck

    src, sp, dp = torch.randn(8, 4, 2, 8), _ids([1, 2, 5]).cpu(), _ids([0, 3, 7]).cpu()
    cache, loc = torch.randn(4, 4, 2, 8), torch.tensor([1, 5, -1])
    bt, b, pos, geo = torch.tensor([[1, 2], [3, 0]]), torch.tensor([0, 1]), torch.tensor([5, 2]), PageGeometry(4, 4)

    def f(dst, rows):
        kvwrite.copy_pages(src, dst, sp, dp, backend="torch")
        kvwrite.move_rows(rows, torch.tensor([0, 9]), torch.tensor([14, 3]), backend="torch")
        return kvwrite.gather(cache, loc, backend="torch") * 2, kvwrite.slot_mapping(bt, b, pos, geo, backend="torch") + 1

    d1, d2 = torch.zeros(4, 8, 2, 8), torch.zeros(4, 8, 2, 8)
    r1, r2 = cache.clone(), cache.clone()
    got, want = torch.compile(f, fullgraph=True)(d1, r1), f(d2, r2)
    assert all(torch.equal(x, y) for x, y in zip(got, want)) and torch.equal(d1, d2) and torch.equal(r1, r2)
    assert not torch.equal(r1, cache)
    for op, args in ((torch.ops.kvwrite.copy_pages.default, (src, torch.zeros(4, 8, 2, 8), sp, dp, "off", None, "torch")),
                     (torch.ops.kvwrite.gather.default, (cache, loc, torch.zeros(3, 2, 8), "off", None, "torch",
                                                         None, None, None)),
                     (torch.ops.kvwrite.slot_mapping.default, (bt, b, pos, torch.zeros(2, dtype=torch.int64), 4, 4,
                                                               "off", None, "torch")),
                     (torch.ops.kvwrite.move_rows.default, (cache.clone(), torch.tensor([0, 9]),
                                                            torch.tensor([14, 3]), "off", None, "torch"))):
        opcheck(op, args)


@pytest.mark.skipif("cpu" not in BACKENDS or DEVICE.type != "cpu", reason="the cpu backend (C++ extension) is unavailable")
@pytest.mark.parametrize("check", ["off", "guard"])
def test_page_moves_run_in_cpp(monkeypatch, check):
    """The four page moves are declared ops: on the cpu backend a call the C++ matcher accepts runs
    from C++ (no Python validation, nothing handed to the Python twin) with the torch backend's
    bytes and record; guard with one pair (N = 1) too, its bad ids recorded by the kernels."""
    from kvwrite.ops import _library, spec

    def calls(backend, errors, pools):
        src, dst, cache = pools
        kvwrite.copy_pages(src, dst, _ids([3, 0, 5] if check == "off" else [3]), _ids([1, 2, 0] if check == "off"
                                                                                       else [7]),
                           check=check, errors=errors, backend=backend)
        rows = kvwrite.gather(cache, _ids([5, -1, 9]), check=check, errors=errors, backend=backend)
        kvwrite.move_rows(cache, _ids([5, 1, 9] if check == "off" else [40]), _ids([2, 3, 7] if check == "off"
                                                                                   else [0]),
                          check=check, errors=errors, backend=backend)
        slots = kvwrite.slot_mapping(_ids([[3, 1], [0, 2]]), _ids([0, 1, -1]), _ids([5, 2, 0]), PageGeometry(4, 4),
                                     check=check, errors=errors, backend=backend)
        return rows, slots

    def pools():
        g = torch.Generator().manual_seed(7)
        return torch.randn(6, 4, 2, 8, generator=g), torch.zeros(3, 4, 2, 8), torch.randn(4, 4, 2, 8, generator=g)

    want_pools, want_errors = pools(), ErrorBuffer()
    want = calls("torch", want_errors, want_pools)
    got_pools, got_errors = pools(), ErrorBuffer()
    forwarded = dict(_library.FORWARDED)

    def no_python(*args, **kwargs):
        raise AssertionError("the Python validation ran")

    monkeypatch.setattr(spec.Op, "match", no_python)
    got = calls("cpu", got_errors, got_pools)
    monkeypatch.undo()
    assert _library.FORWARDED == forwarded
    for a, b in zip(got + got_pools, want + want_pools):
        assert torch.equal(a, b)
    assert torch.equal(got_errors.tensor, want_errors.tensor)
    assert (got_errors.error() is None) == (check == "off")
