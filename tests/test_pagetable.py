"""Page-table addressing (kvwrite.PageTable) in every op and backend: bytes equal the torch
reference and an independent placement; every bad batch / slot / page caught in assert and guard
with the exact token and fields; off mode skips without reading the tables out of bounds."""
from __future__ import annotations

import json
import re
import os
import subprocess
import sys

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite import PageTable
from kvwrite.errors import KIND_BATCH, KIND_TABLE_PAGE, KIND_TABLE_SLOT
from kvwrite.ops.indexer_k import row_bytes
from tables import placement, random_table

ALL = ["torch", *BACKENDS]
E4M3 = torch.float8_e4m3fn


def kv_pool(layout, num_pages, pps, h, d, dtype, seed=0):
    shape = (num_pages, pps, h, d) if layout == "NHD" else (num_pages, h, pps, d)
    return CanaryBuffer({"k_cache": (shape, dtype), "v_cache": (shape, dtype)}, seed)


def run_kv(backend, pool, k, v, table, layout="NHD", check="off", errors=None, **kw):
    kvwrite.store_kv(k, v, pool["k_cache"], pool["v_cache"], table, layout=layout, check=check,
                     errors=errors, backend=backend, **kw)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("layout,dtype,idx,cache", [
    ("NHD", torch.bfloat16, torch.int32, None), ("HND", torch.float16, torch.int64, None),
    ("NHD", torch.float32, torch.int64, None), ("HND", torch.bfloat16, torch.int32, E4M3)])
def test_store_kv_table_matches_reference(backend, layout, dtype, idx, cache):
    gen = torch.Generator().manual_seed(11)
    pps, num_pages, h, d = 4, 12, 2, 16
    table, _ = random_table(gen, 3, pps, num_pages, 11, idx)
    n = table.positions.shape[0]
    k = (torch.randn(n, h, d, generator=gen) * 3).to(dtype).to(DEVICE)
    v = (torch.randn(n, h, d, generator=gen) * 3).to(dtype).to(DEVICE)
    scales = {} if cache is None else dict(k_scale=torch.tensor([0.5], device=DEVICE),
                                            v_scale=torch.tensor([0.25], device=DEVICE))
    pool = kv_pool(layout, num_pages, pps, h, d, cache or dtype)
    ref, original = pool.clone(), pool.raw.clone()
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_kv(backend, pool, k, v, table, layout, "guard", errs, **scales)
    run_kv("torch", ref, k, v, table, layout, "off", **scales)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None
    if cache is None:  # the reference against FlashInfer's formula, token by token
        kc = ref["k_cache"] if layout == "NHD" else ref["k_cache"].transpose(1, 2)
        for i, page, row in placement(table, pps):
            assert torch.equal(kc[page, row], k[i])


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla", "nvfp4"])
def test_store_mla_table_matches_reference(backend, fmt):
    gen = torch.Generator().manual_seed(5)
    pps, num_pages, lora, rope = 2, 10, 128, 16
    table, _ = random_table(gen, 3, pps, num_pages, 6)
    n = table.positions.shape[0]
    kv_c = torch.randn(n, lora, generator=gen).to(torch.bfloat16).to(DEVICE)
    k_pe = torch.randn(n, rope, generator=gen).to(torch.bfloat16).to(DEVICE)
    width, dtype = {"auto": (lora + rope, torch.bfloat16), "fp8_ds_mla": (lora + 4 + 2 * rope, torch.uint8),
                    "nvfp4": ((lora + rope) // 2, torch.uint8)}[fmt]
    specs = {"kv_cache": ((num_pages, pps, width), dtype)}
    if fmt == "nvfp4":
        specs["scale_cache"] = ((num_pages, pps, (lora + rope) // 16), E4M3)
    pool = CanaryBuffer(specs, 3)
    ref, original = pool.clone(), pool.raw.clone()
    for be, buf in ((backend, pool), ("torch", ref)):
        extra = dict(scale_cache=buf["scale_cache"]) if fmt == "nvfp4" else {}
        kvwrite.store_mla(kv_c, k_pe, buf["kv_cache"], table, kv_cache_dtype=fmt, check="assert", backend=be,
                          **extra)
    assert_same_bytes(pool, ref, original)
    if fmt == "auto":
        for i, page, row in placement(table, pps):
            assert torch.equal(ref["kv_cache"][page, row], torch.cat([kv_c[i], k_pe[i]]))


@pytest.mark.parametrize("backend", ALL)
def test_store_indexer_k_and_nvfp4_table_match_reference(backend):
    gen = torch.Generator().manual_seed(8)
    pps, num_pages, d = 2, 8, 128
    table, _ = random_table(gen, 2, pps, num_pages, 6, torch.int64)
    n = table.positions.shape[0]
    x = torch.randn(n, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    pool = CanaryBuffer({"cache": ((num_pages, pps * row_bytes(d, 128)), torch.uint8)}, 1)
    ref, original = pool.clone(), pool.raw.clone()
    for be, buf in ((backend, pool), ("torch", ref)):
        kvwrite.store_indexer_k(x, buf["cache"], table, check="guard", backend=be)
    assert_same_bytes(pool, ref, original)

    h = 2
    k = torch.randn(n, h, 32, generator=gen).to(torch.bfloat16).to(DEVICE)
    shape = lambda w: (num_pages, pps, h, w)  # noqa: E731
    pool = CanaryBuffer({"k": (shape(16), torch.uint8), "v": (shape(16), torch.uint8),
                         "ks": (shape(2), E4M3), "vs": (shape(2), E4M3)}, 2)
    ref, original = pool.clone(), pool.raw.clone()
    for be, buf in ((backend, pool), ("torch", ref)):
        kvwrite.store_kv_nvfp4(k, k * 2, buf["k"], buf["v"], buf["ks"], buf["vs"], table,
                               check="assert", backend=be)
    assert_same_bytes(pool, ref, original)


# A fixed table (page size 4, 8 pages, 3 requests of 5, 3 and 8 tokens on pages [6, 1], [4],
# [0, 3]) and six tokens: (batch, position) -> (page, row):
# (0,3)->(6,3) (0,4)->(1,0) (1,2)->(4,2) (2,0)->(0,0) (2,5)->(3,1) (2,7)->(3,3).
PPS, PAGES, H, D = 4, 8, 2, 8
GOOD = dict(batch=[0, 0, 1, 2, 2, 2], pos=[3, 4, 2, 0, 5, 7], indices=[6, 1, 4, 0, 3], indptr=[0, 2, 3, 5])
# name: (edits, expected (token, kind, batch, position, slot, page, target, limit, count), off ok)
# `off ok`: whether off mode stays inside the pool (a page beyond it is written in off mode).
BAD = {
    "batch_beyond": (dict(batch={2: 3}), (2, KIND_BATCH, 3, 2, None, None, 3, 3, 1), True),
    "batch_negative": (dict(batch={4: -1}), (4, KIND_BATCH, -1, 5, None, None, -1, 3, 1), True),
    "slot_past_request": (dict(pos={2: 5}), (2, KIND_TABLE_SLOT, 1, 5, 3, None, 3, 3, 1), True),
    "slot_past_indices": (dict(pos={5: 8}), (5, KIND_TABLE_SLOT, 2, 8, 5, None, 5, 5, 1), True),
    "indptr_past_indices": (dict(pos={5: 8}, indptr={3: 6}), (5, KIND_TABLE_SLOT, 2, 8, 5, None, 5, 5, 1), True),
    "position_negative": (dict(pos={1: -1}), (1, KIND_TABLE_SLOT, 0, -1, -1, None, -1, 2, 1), True),
    "position_before_request": (dict(pos={3: -1}), (3, KIND_TABLE_SLOT, 2, -1, 2, None, 2, 5, 1), True),
    "page_beyond": (dict(indices={1: 8}), (1, KIND_TABLE_PAGE, 0, 4, 1, 8, 8, 8, 1), False),
    "page_negative": (dict(indices={3: -1}), (3, KIND_TABLE_PAGE, 2, 0, 3, -1, -1, 8, 1), True),
    "two_bad": (dict(batch={4: 7}, indices={0: 9}), (0, KIND_TABLE_PAGE, 0, 3, 0, 9, 9, 8, 2), False),
}
BAIT_INDPTR = (0, 0)    # kv_indptr[-1], kv_indptr[B + 1]: would address page kv_indices[0]
BAIT_INDICES = (5, 7)   # kv_indices[-1], kv_indices[len]: unused pages of the pool


def bad_table(edits, idx=torch.int32):
    """The fixed table with `edits`; kv_indptr and kv_indices are slices of bigger tensors whose
    neighbours are valid-looking bait, so a resolver reading them out of bounds writes a page
    the reference never writes."""
    vals = {k: list(v) for k, v in GOOD.items()}
    for name, changes in edits.items():
        for i, x in changes.items():
            vals[name][i] = x
    indptr = torch.tensor([BAIT_INDPTR[0], *vals["indptr"], BAIT_INDPTR[1]], dtype=idx, device=DEVICE)[1:-1]
    indices = torch.tensor([BAIT_INDICES[0], *vals["indices"], BAIT_INDICES[1]], dtype=idx, device=DEVICE)[1:-1]
    return PageTable(torch.tensor(vals["batch"], dtype=idx, device=DEVICE),
                     torch.tensor(vals["pos"], dtype=idx, device=DEVICE), indices, indptr)


def fields(err):
    return (err.token_index, err.kind, err.batch, err.position, err.table_slot, err.table_page,
            err.target, err.limit, err.count)


def kv_inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    n = len(GOOD["batch"])
    return (torch.randn(n, H, D, generator=gen).to(DEVICE), torch.randn(n, H, D, generator=gen).to(DEVICE))


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_table_assert(backend, case):
    if DEVICE.type == "cuda" and backend != "torch":
        pytest.skip("a device assert kills the CUDA context: test_table_device_assert_in_subprocess")
    edits, want, _ = BAD[case]
    k, v = kv_inputs()
    pool = kv_pool("NHD", PAGES, PPS, H, D, torch.float32)
    original = pool.raw.clone()
    with pytest.raises(kvwrite.OutOfBoundsWrite) as info:
        run_kv(backend, pool, k, v, bad_table(edits), check="assert")
    assert fields(info.value) == want
    assert torch.equal(pool.raw, original)  # assert fails before any write
    kind_words = {KIND_BATCH: "batch index", KIND_TABLE_SLOT: "page-table slot", KIND_TABLE_PAGE: "maps to page"}
    assert kind_words[want[1]] in str(info.value) and f"token {want[0]}" in str(info.value)


def table_values(edits):
    vals = {k: list(v) for k, v in GOOD.items()}
    for name, changes in edits.items():
        for i, x in changes.items():
            vals[name][i] = x
    return vals


def expected_pool(original, k, v, edits, mode):
    """Independent oracle: the pool after the store, token by token. guard: every token with a
    valid batch, slot inside its request and page inside the pool; off: every token whose batch
    and slot lie inside kv_indptr / kv_indices and whose page is not negative."""
    vals = table_values(edits)
    indptr, indices = vals["indptr"], vals["indices"]
    pool = kv_pool("NHD", PAGES, PPS, H, D, torch.float32)
    pool.raw.copy_(original)
    for i, (b, p) in enumerate(zip(vals["batch"], vals["pos"])):
        if not 0 <= b < len(indptr) - 1:
            continue
        slot = indptr[b] + p // PPS
        hi = len(indices) if mode == "off" else min(indptr[b + 1], len(indices))
        lo = 0 if mode == "off" else max(indptr[b], 0)
        if not lo <= slot < hi:
            continue
        page = indices[slot]
        if page < 0 or (mode != "off" and page >= PAGES):
            continue
        pool["k_cache"][page, p % PPS], pool["v_cache"][page, p % PPS] = k[i], v[i]
    return pool


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", list(BAD))
def test_bad_table_guard_skips_and_records(backend, case):
    edits, want, _ = BAD[case]
    k, v = kv_inputs()
    pool = kv_pool("NHD", PAGES, PPS, H, D, torch.float32)
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    run_kv(backend, pool, k, v, bad_table(edits), check="guard", errors=errs)
    run_kv("torch", ref, k, v, bad_table(edits), check="guard", errors=ref_errs)
    assert_same_bytes(pool, ref, original)
    assert fields(errs.error()) == want == fields(ref_errs.error())
    assert torch.equal(errs.tensor, ref_errs.tensor)
    assert torch.equal(ref.raw, expected_pool(original, k, v, edits, "guard").raw)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", [c for c, (_, _, off_ok) in BAD.items() if off_ok])
def test_bad_table_off_never_reads_tables_out_of_bounds(backend, case):
    """Off mode: tokens whose batch index or slot would read kv_indptr / kv_indices out of bounds
    are skipped, so the bait around them (pages 5 and 7, or slot 0) is never used; a negative
    page is skipped. Nothing is recorded."""
    edits, _, _ = BAD[case]
    k, v = kv_inputs()
    pool = kv_pool("NHD", PAGES, PPS, H, D, torch.float32)
    ref, original = pool.clone(), pool.raw.clone()
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_kv(backend, pool, k, v, bad_table(edits), check="off", errors=errs)
    run_kv("torch", ref, k, v, bad_table(edits), check="off")
    assert_same_bytes(pool, ref, original)
    assert torch.equal(ref.raw, expected_pool(original, k, v, edits, "off").raw)
    assert errs.error() is None
    for page in BAIT_INDICES:  # pages only an out-of-bounds kv_indices read would name
        assert torch.equal(pool["k_cache"][page], ref.clone()["k_cache"][page])
        expect = kv_pool("NHD", PAGES, PPS, H, D, torch.float32)
        expect.raw.copy_(original)
        assert torch.equal(pool["k_cache"][page], expect["k_cache"][page])


@pytest.mark.parametrize("backend", ALL)
def test_bad_table_store_mla_guard(backend):
    """The MLA store resolves the same table: a page beyond the pool is KIND_TABLE_PAGE."""
    edits, want, _ = BAD["page_beyond"]
    n = len(GOOD["batch"])
    gen = torch.Generator().manual_seed(2)
    kv_c, k_pe = torch.randn(n, 16, generator=gen).to(DEVICE), torch.randn(n, 8, generator=gen).to(DEVICE)
    pool = CanaryBuffer({"kv_cache": ((PAGES, PPS, 24), torch.float32)}, 4)
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    for be, buf, e in ((backend, pool, errs), ("torch", ref, ref_errs)):
        kvwrite.store_mla(kv_c, k_pe, buf["kv_cache"], bad_table(edits, torch.int64), check="guard",
                          errors=e, backend=be)
    assert_same_bytes(pool, ref, original)
    assert fields(errs.error()) == want == fields(ref_errs.error())
    assert errs.error().loc == 8 * PPS + 0 and errs.error().page == 8 and errs.error().num_pages == PAGES


def test_table_argument_errors():
    k, v = kv_inputs()
    pool = kv_pool("NHD", PAGES, PPS, H, D, torch.float32)
    good = bad_table({})
    cases = [
        (dict(loc=PageTable(good.batch_indices[:3], good.positions, good.kv_indices, good.kv_indptr)),
         ValueError, "batch_indices must have one entry per token"),
        (dict(loc=PageTable(good.batch_indices, good.positions.float(), good.kv_indices, good.kv_indptr)),
         TypeError, "positions must have dtype"),
        (dict(loc=PageTable(good.batch_indices, good.positions, good.kv_indices[None], good.kv_indptr)),
         ValueError, "kv_indices must be 1-D"),
        (dict(loc=PageTable(good.batch_indices, good.positions, good.kv_indices, good.kv_indptr[:0])),
         ValueError, "kv_indptr must have batch_size + 1 >= 1"),
        (dict(loc=good, loc_map=torch.arange(4, device=DEVICE)), ValueError, "does not combine with loc_map"),
        (dict(loc=good, dcp_size=2), ValueError, "does not combine"),
    ]
    for kw, exc, text in cases:
        with pytest.raises(exc, match=re.escape(text)):
            kvwrite.store_kv(k, v, pool["k_cache"], pool["v_cache"], **kw)


def test_table_compile_variants():
    """The page-table variants of store_kv / store_mla compile for sm_80 and sm_90 (off, assert
    with __assertfail, guard)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-m", "kvwrite.kernels.compile_check", "--family", "store_kv",
                          "--family", "store_mla", "--match", "+table", "--cc", "80", "90"], env=env,
                         capture_output=True, text=True, timeout=900)
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert out.returncode == 0 and rows and all(r["ok"] for r in rows), (rows, out.stderr[-2000:])
    assert {(r["family"], r["check"], r["cc"]) for r in rows} == {
        (f, c, cc) for f in ("store_kv", "store_mla") for c in (0, 1, 2) for cc in (80, 90)}
    assert all(r["assertfail"] == (r["check"] == 1) for r in rows)


@pytest.mark.skipif(DEVICE.type != "cuda", reason="device asserts exist on a GPU only")
@pytest.mark.parametrize("backend", BACKENDS)
def test_table_device_assert_in_subprocess(backend):
    """On a GPU, a page-table entry past the pool fires the device-side assert: the process dies."""
    code = f"""
import torch, kvwrite
kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
k = torch.ones(2, 2, 64, dtype=torch.bfloat16, device="cuda")
i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device="cuda")
t = kvwrite.PageTable(i32(0, 0), i32(0, 17), i32(1, 4), i32(0, 2))
kvwrite.store_kv(k, k, kc, kc.clone(), t, check="assert", backend="{backend}")
torch.cuda.synchronize()
print("NOT REACHED")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "NOT REACHED" not in out.stdout
    assert "assert" in (out.stderr + out.stdout).lower(), out.stderr[-2000:]
