"""Duplicate rows (kvwrite.ops.claims, csrc/kvwrite/claims.h): two tokens of one call that
resolve to one pool row (the same loc twice; two locs loc_map or a page table sends to one row;
the same virtual loc under DCP), two page-move pairs with one dst page. Every store and page move,
every backend: guard keeps the lowest token's bytes, skips and records the rest (KIND_DUPLICATE:
token, loc, row, page, first writer); assert writes nothing and raises DuplicateWrite; off does
not look. Bytes are compared with the torch reference run in off mode on the locs the rule keeps
(later duplicates as padding -1), canaries included."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.errors import KIND_DUPLICATE, DuplicateWrite
from kvwrite.facts import FP4_RECORDS, KV_DIM, indexer_row_bytes, kv_page_bytes

ALL = ["torch", *BACKENDS]
PAGES, PPS = 2, 4                                  # every pool: 2 pages of 4 rows (capacity 8)
LOC = [3, 6, 3, -1, 6]                             # tokens 2 and 4 repeat tokens 0 and 1
KEPT = [3, 6, -1, -1, -1]                          # what the first-writer rule stores
N = len(LOC)
E4M3 = torch.float8_e4m3fn


def _t(x, dtype=torch.int64):
    return torch.tensor(x, dtype=dtype, device=DEVICE)


def _rand(*shape, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=gen) * 2).to(dtype).to(DEVICE)


def _cos_sin(width, positions=16):
    ang = torch.arange(positions)[:, None] * (0.1 * torch.arange(1, width // 2 + 1))[None, :]
    return torch.cat([ang.cos(), ang.sin()], 1).to(DEVICE)


# Each case: (pool specs, call(pool, loc, **kw) storing N tokens at `loc`).
def _kv(**extra):
    k, v = _rand(N, 2, 16), _rand(N, 2, 16, seed=1)
    return lambda p, loc, **kw: kvwrite.store_kv(k, v, p["k"], p["v"], loc, **extra, **kw)


CASES = {
    "store_kv": ({"k": ((PAGES, PPS, 2, 16), torch.bfloat16), "v": ((PAGES, PPS, 2, 16), torch.bfloat16)}, _kv()),
    "store_kv-fp8": ({"k": ((PAGES, PPS, 2, 16), E4M3), "v": ((PAGES, PPS, 2, 16), E4M3)},
                     _kv(k_scale=_t([0.5], torch.float32), v_scale=_t([0.25], torch.float32))),
    "store_kv-int8-token": (
        {"k": ((PAGES, PPS, 2, 16), torch.int8), "v": ((PAGES, PPS, 2, 16), torch.int8),
         "ks": ((PAGES, PPS), torch.float32), "vs": ((PAGES, PPS), torch.float32)},
        lambda p, loc, **kw: kvwrite.store_kv(_rand(N, 2, 16), _rand(N, 2, 16, seed=1), p["k"], p["v"], loc,
                                              k_scale_cache=p["ks"], v_scale_cache=p["vs"], **kw)),
    "store_kv-fp8-head": (
        {"k": ((PAGES, PPS, 2, 16), E4M3), "v": ((PAGES, PPS, 2, 16), E4M3),
         "ks": ((PAGES, PPS, 2), torch.float32), "vs": ((PAGES, PPS, 2), torch.float32)},
        lambda p, loc, **kw: kvwrite.store_kv(_rand(N, 2, 16), _rand(N, 2, 16, seed=1), p["k"], p["v"], loc,
                                              k_scale_cache=p["ks"], v_scale_cache=p["vs"], **kw)),
    "store_kv_head_major": (
        {"k": ((PAGES, 2, 2, PPS, 8), torch.bfloat16), "v": ((PAGES, 2, 16, PPS), torch.bfloat16)},
        lambda p, loc, **kw: kvwrite.store_kv_head_major(_rand(N, 2, 16), _rand(N, 2, 16, seed=1), p["k"],
                                                         p["v"], loc, **kw)),
    "store_mla": ({"c": ((PAGES, PPS, 48), torch.bfloat16)},
                  lambda p, loc, **kw: kvwrite.store_mla(_rand(N, 32), _rand(N, 16, seed=1), p["c"], loc, **kw)),
    "store_mla-fp8_ds_mla": (
        {"c": ((PAGES, PPS, 656), torch.uint8)},
        lambda p, loc, **kw: kvwrite.store_mla(_rand(N, 512), _rand(N, 64, seed=1), p["c"], loc,
                                               kv_cache_dtype="fp8_ds_mla", **kw)),
    "store_mla-nvfp4": (
        {"c": ((PAGES, PPS, 24), torch.uint8), "s": ((PAGES, PPS, 3), E4M3)},
        lambda p, loc, **kw: kvwrite.store_mla(_rand(N, 32), _rand(N, 16, seed=1), p["c"], loc,
                                               kv_cache_dtype="nvfp4", scale_cache=p["s"], **kw)),
    "store_indexer_k": ({"c": ((PAGES, PPS * 132), torch.uint8)},
                        lambda p, loc, **kw: kvwrite.store_indexer_k(_rand(N, 128), p["c"], loc, **kw)),
    "store_kv_nvfp4": (
        {"k": ((PAGES, PPS, 1, 8), torch.uint8), "v": ((PAGES, PPS, 1, 8), torch.uint8),
         "ks": ((PAGES, PPS, 1, 1), E4M3), "vs": ((PAGES, PPS, 1, 1), E4M3)},
        lambda p, loc, **kw: kvwrite.store_kv_nvfp4(_rand(N, 1, 16), _rand(N, 1, 16, seed=1), p["k"], p["v"],
                                                    p["ks"], p["vs"], loc, **kw)),
    "store_dsv4_kv": ({"c": ((PAGES, kv_page_bytes(PPS)), torch.uint8)},
                      lambda p, loc, **kw: kvwrite.store_dsv4_kv(_rand(N, KV_DIM), p["c"], loc, page_size=PPS, **kw)),
    "store_dsv4_indexer_k-fp8": (
        {"c": ((PAGES, PPS * indexer_row_bytes(128)), torch.uint8)},
        lambda p, loc, **kw: kvwrite.store_dsv4_indexer_k(_rand(N, 128), p["c"], loc, **kw)),
    "store_dsv4_indexer_k-mxfp4": (
        {"c": ((PAGES, PPS * indexer_row_bytes(128, "mxfp4")), torch.uint8)},
        lambda p, loc, **kw: kvwrite.store_dsv4_indexer_k(_rand(N, 128), p["c"], loc, fmt="mxfp4", **kw)),
    **{f"store_dsv4_kv_fp4-{fmt}": (
        {"c": ((PAGES, PPS * FP4_RECORDS[fmt].token_bytes), torch.uint8)},
        lambda p, loc, fmt=fmt, **kw: kvwrite.store_dsv4_kv_fp4(_rand(N, KV_DIM), p["c"], loc, fmt=fmt, **kw))
       for fmt in ("nvfp4", "mxfp4", "nvfp4_v41")},
    "rope_store_dsv4_kv_fp4": (
        {"c": ((PAGES, PPS * FP4_RECORDS["nvfp4"].token_bytes), torch.uint8)},   # q: test_dsv4_fp4
        lambda p, loc, **kw: kvwrite.rope_store_dsv4_kv_fp4(_t([1, 2, 3, 4, 5]), _rand(N, KV_DIM), _cos_sin(64),
                                                            p["c"], loc, q=_rand(N, 2, 64, seed=2), **kw)),
    "store_rows": ({"c": ((PAGES * PPS, 24), torch.float32)},
                   lambda p, loc, **kw: kvwrite.store_rows(_rand(N, 24, dtype=torch.float32), p["c"], loc, **kw)),
    "rope_store_kv": (
        {"k": ((PAGES, PPS, 2, 16), torch.bfloat16), "v": ((PAGES, PPS, 2, 16), torch.bfloat16),
         "q": ((N, 2, 16), torch.bfloat16)},
        lambda p, loc, **kw: kvwrite.rope_store_kv(_t([1, 2, 3, 4, 5]), p["q"], _rand(N, 2, 16), _rand(N, 2, 16, seed=1),
                                                   _cos_sin(16), p["k"], p["v"], loc, **kw)),
    "rope_store_mla": (
        {"c": ((PAGES, PPS, 48), torch.bfloat16), "q": ((N, 2, 16), torch.bfloat16)},
        lambda p, loc, **kw: kvwrite.rope_store_mla(_t([1, 2, 3, 4, 5]), p["q"], _rand(N, 32), _rand(N, 16, seed=1),
                                                    _cos_sin(16), p["c"], loc, **kw)),
}


def _expected(case, kept, seed=3, backend="torch", **kw):
    """The pool after the call with the kept locs, off mode, on the torch reference. (The Triton
    rope_store_mla rotates q differently from the reference in the last bf16 bit for some
    values, with or without duplicates: that case takes the same backend's off-mode run.)"""
    specs, call = CASES[case]
    want = CanaryBuffer(specs, seed)
    call(want, _t(kept), check="off", backend=backend if case == "rope_store_mla" else "torch", **kw)
    return want


def _check_record(err, op, token, first, loc, row, count):
    assert isinstance(err, DuplicateWrite) and err.kind == KIND_DUPLICATE
    assert (err.op, err.token_index, err.first_token, err.loc, err.row, err.count) == (op, token, first, loc, row, count)
    assert (err.page, err.offset) == divmod(row, PPS if op != "store_rows" else 1)
    assert f"which token {first} of the same call already writes" in str(err)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", list(CASES))
def test_guard_keeps_the_first_writer_and_records_the_rest(case, backend):
    specs, call = CASES[case]
    p = CanaryBuffer(specs, 3)
    original = p.raw.clone()
    errors = kvwrite.ErrorBuffer(DEVICE)
    call(p, _t(LOC), check="guard", errors=errors, backend=backend)
    assert_same_bytes(p, _expected(case, KEPT, backend=backend), original)
    op = case.split("-")[0]
    _check_record(errors.error(), op, 2, 0, 3, 3, 2)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", list(CASES))
def test_assert_raises_before_any_write(case, backend):
    if DEVICE.type == "cuda":
        pytest.skip("a device assert ends the CUDA context (bench/gpu_check.sh runs it in a subprocess)")
    specs, call = CASES[case]
    p = CanaryBuffer(specs, 3)
    original = p.raw.clone()
    with pytest.raises(DuplicateWrite) as info:
        call(p, _t(LOC), check="assert", backend=backend)
    op = case.split("-")[0]
    _check_record(info.value, op, 2, 0, 3, 3, 2)
    assert torch.equal(p.raw, original), "assert mode wrote before failing (a rope store's q included)"


@pytest.mark.parametrize("backend", ALL)
def test_off_mode_does_not_look(backend, monkeypatch):
    """Off mode runs no pre-pass (a dispatch in off mode never calls it) and records nothing."""
    import kvwrite.ops._common as common

    def boom(*a, **k):
        raise AssertionError("the duplicate pre-pass ran in off mode")

    monkeypatch.setattr(common, "claim", boom)
    specs, call = CASES["store_kv"]
    p = CanaryBuffer(specs, 3)
    errors = kvwrite.ErrorBuffer(DEVICE)
    call(p, _t(LOC), check="off", errors=errors, backend=backend)
    assert errors.error() is None


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("locs, token, count", [([3, 3, 99], 1, 2), ([99, 3, 3], 0, 2), ([3, 3, 3, 99], 1, 3)])
def test_lowest_bad_or_duplicate_token_wins(backend, locs, token, count):
    specs, call = CASES["store_kv"]
    k, v = _rand(len(locs), 2, 16), _rand(len(locs), 2, 16, seed=1)
    p = CanaryBuffer(specs, 3)
    errors = kvwrite.ErrorBuffer(DEVICE)
    kvwrite.store_kv(k, v, p["k"], p["v"], _t(locs), check="guard", errors=errors, backend=backend)
    err = errors.error()
    assert (err.token_index, err.count) == (token, count)
    assert isinstance(err, DuplicateWrite) == (locs[token] == 3)
    want = CanaryBuffer(specs, 3)
    kvwrite.store_kv(k, v, want["k"], want["v"], _t([3] + [-1] * (len(locs) - 1)) if locs[0] == 3
                     else _t([-1, 3] + [-1] * (len(locs) - 2)), check="off", backend="torch")
    assert torch.equal(p.raw, want.raw)
    if DEVICE.type == "cpu":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as info:
            kvwrite.store_kv(k, v, p["k"], p["v"], _t(locs), check="assert", backend=backend)
        assert info.value.token_index == token


@pytest.mark.parametrize("backend", ALL)
def test_loc_map_sends_two_locs_to_one_row(backend):
    loc_map = _t([5, 2, 5, 7, -1])
    specs, call = CASES["store_kv"]
    p = CanaryBuffer(specs, 3)
    original = p.raw.clone()
    errors = kvwrite.ErrorBuffer(DEVICE)
    loc = _t([0, 1, 2, 3, 4])
    call(p, loc, check="guard", errors=errors, backend=backend, loc_map=loc_map)
    assert_same_bytes(p, _expected("store_kv", [0, 1, -1, 3, -1], loc_map=loc_map), original)
    err = errors.error()
    _check_record(err, "store_kv", 2, 0, 2, 5, 1)   # the caller's loc 2, the mapped row 5
    assert "local row 5" in str(err)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", ["store_kv", "store_dsv4_kv"])
def test_dcp_the_owning_rank_sees_the_duplicate(backend, case):
    """Virtual loc 9 twice, dcp_size 2: a duplicate on the rank that owns it, nothing on the other
    (store_kv shards tokens: rank 9 % 2; DeepSeek V4 shards pages: page 9 // 4 = 2 -> rank 0)."""
    loc = [9, 4, 9, -1, 6]
    owner = 1 if case == "store_kv" else 0
    for rank in (0, 1):
        specs, call = CASES[case]
        p = CanaryBuffer(specs, 3)
        original = p.raw.clone()
        errors = kvwrite.ErrorBuffer(DEVICE)
        call(p, _t(loc), check="guard", errors=errors, backend=backend, dcp_rank=rank, dcp_size=2)
        kept = [9, 4, -1, -1, 6]
        assert_same_bytes(p, _expected(case, kept, dcp_rank=rank, dcp_size=2), original)
        err = errors.error()
        if rank != owner:
            assert err is None
            continue
        row = 9 // 2 if case == "store_kv" else (9 // PPS // 2) * PPS + 9 % PPS
        _check_record(err, case, 2, 0, 9, row, 1)


@pytest.mark.parametrize("backend", ALL)
def test_page_table_two_requests_share_a_page(backend):
    """Request 1's first page is request 0's page 1: token 1 (batch 1, position 1) lands on row 5,
    which token 0 (batch 0, position 1) writes."""
    table = kvwrite.PageTable(batch_indices=_t([0, 1, 0]), positions=_t([1, 1, 4]),
                              kv_indptr=_t([0, 2, 3]), kv_indices=_t([1, 0, 1]))
    k, v = _rand(3, 2, 16), _rand(3, 2, 16, seed=1)
    specs, _ = CASES["store_kv"]
    p = CanaryBuffer(specs, 3)
    original = p.raw.clone()
    errors = kvwrite.ErrorBuffer(DEVICE)
    kvwrite.store_kv(k, v, p["k"], p["v"], table, check="guard", errors=errors, backend=backend)
    want = CanaryBuffer(specs, 3)
    kvwrite.store_kv(k, v, want["k"], want["v"], _t([5, -1, 0]), check="off", backend="torch")
    assert_same_bytes(p, want, original)
    err = errors.error()
    _check_record(err, "store_kv", 1, 0, 5, 5, 1)
    assert (err.batch, err.position) == (1, 1)


def _pools(seed=3):
    return CanaryBuffer({"src": ((4, 2, 1, 8), torch.float32), "dst": ((3, 2, 1, 8), torch.float32)}, seed)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["guard", "assert"])
def test_copy_pages_one_dst_page_twice(backend, mode):
    p = _pools()
    original = p.raw.clone()
    errors = kvwrite.ErrorBuffer(DEVICE)
    src, dst = _t([0, 1, 2]), _t([2, 0, 2])
    if mode == "assert":
        if DEVICE.type == "cuda":
            pytest.skip("a device assert ends the CUDA context")
        with pytest.raises(DuplicateWrite, match="pair 2 writes dst page 2 .* which pair 0"):
            kvwrite.copy_pages(p["src"], p["dst"], src, dst, check="assert", backend=backend)
        assert torch.equal(p.raw, original)
        return
    kvwrite.copy_pages(p["src"], p["dst"], src, dst, check="guard", errors=errors, backend=backend)
    want = _pools()
    kvwrite.copy_pages(want["src"], want["dst"], src, _t([2, 0, -1]), check="off", backend="torch")
    assert_same_bytes(p, want, original)
    err = errors.error()
    assert isinstance(err, DuplicateWrite)
    assert (err.op, err.token_index, err.first_token, err.row, err.count) == ("copy_pages", 2, 0, 2, 1)


@pytest.mark.parametrize("backend", ALL)
def test_move_rows_one_dst_row_twice(backend):
    pool = CanaryBuffer({"c": ((2, 4, 1, 8), torch.float32)}, 3)
    original = pool.raw.clone()
    errors = kvwrite.ErrorBuffer(DEVICE)
    kvwrite.move_rows(pool["c"], _t([0, 1, 2]), _t([5, 6, 5]), check="guard", errors=errors, backend=backend)
    want = CanaryBuffer({"c": ((2, 4, 1, 8), torch.float32)}, 3)
    kvwrite.move_rows(want["c"], _t([0, 1]), _t([5, 6]), check="off", backend="torch")
    assert_same_bytes(pool, want, original)
    err = errors.error()
    assert (type(err), err.op, err.token_index, err.first_token, err.row) == (DuplicateWrite, "move_rows", 2, 0, 5)
    assert "dst row 5" in str(err)


def test_torch_twin_first_writers():
    from kvwrite.reference.claims import first_writers

    row = _t([7, 3, 7, 5, 3, 7, 1])
    write = _t([1, 1, 1, 0, 1, 1, 1], torch.bool)
    dup, first = first_writers(row, write)
    assert dup.tolist() == [False, False, True, False, True, True, False]
    assert [int(f) for f, w in zip(first, write) if w] == [0, 1, 0, 1, 0, 6]
