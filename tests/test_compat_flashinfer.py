"""kvwrite.compat.flashinfer against an independent torch re-statement of FlashInfer's append
kernels (page.cuh: page_iter, entry = divmod(kv_indptr[b] * page_size + position, page_size);
page = kv_indices[page_iter]), every dtype FlashInfer's append dispatches, both layouts, both
cache forms, every backend, canary-padded."""
from __future__ import annotations

import zlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.compat import flashinfer as fi
from kvwrite.errors import KIND_TABLE_PAGE
from tables import random_table

ALL = ["torch", *BACKENDS]
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
ROOT = Path(__file__).resolve().parents[1]


def flashinfer_rows(t, pps):
    """(page, entry) of every token, as FlashInfer's kernel computes them (int32 inputs)."""
    b, pos = t.batch_indices.long(), t.positions.long()
    page_iter, entry = torch.div(t.kv_indptr.long()[b] * pps + pos, pps, rounding_mode="floor"), (
        t.kv_indptr.long()[b] * pps + pos) % pps
    return t.kv_indices.long()[page_iter], entry


def flashinfer_append(key, value, t, k_cache, v_cache, layout):
    """FlashInfer's append_paged_kv_cache, restated: a raw copy of each token's heads."""
    pps = k_cache.shape[1] if layout == "NHD" else k_cache.shape[2]
    page, entry = flashinfer_rows(t, pps)
    for src, dst in ((key, k_cache), (value, v_cache)):
        bits = lambda x: x.view(torch.uint8) if x.element_size() == 1 else x  # noqa: E731
        if layout == "NHD":
            bits(dst)[page, entry] = bits(src)
        else:
            bits(dst).transpose(1, 2)[page, entry] = bits(src)


def rand_values(shape, dtype, gen):
    if dtype in FP8:  # every bit pattern, NaNs included: the append is a byte copy
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)
    return (torch.randn(shape, generator=gen) * 3).to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("form", ["tuple", "5d"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, *FP8])
def test_append_paged_kv_cache_matches_flashinfer(backend, form, layout, dtype):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((form, layout, str(dtype))).encode()) % 1000)
    pps, pages, h, d = 4, 10, 2, 16
    t, _ = random_table(gen, 3, pps, pages, 9)
    n = t.positions.shape[0]
    qkv = rand_values((n, 4 * h, d), dtype, gen)  # key/value: strided views of a fused projection
    key, value = qkv[:, h:2 * h], qkv[:, 2 * h:3 * h]
    page_shape = (pps, h, d) if layout == "NHD" else (h, pps, d)
    if form == "tuple":
        pool = CanaryBuffer({"k": ((pages, *page_shape), dtype), "v": ((pages, *page_shape), dtype)}, 7)
        caches = lambda p: ((p["k"], p["v"]), p["k"], p["v"])  # noqa: E731
    else:
        pool = CanaryBuffer({"kv": ((pages, 2, *page_shape), dtype)}, 7)
        caches = lambda p: (p["kv"], p["kv"][:, 0], p["kv"][:, 1])  # noqa: E731
    ref, original = pool.clone(), pool.raw.clone()
    last = torch.ones(3, dtype=torch.int32, device=DEVICE)
    errs = kvwrite.ErrorBuffer(DEVICE)
    fi.append_paged_kv_cache(key, value, t.batch_indices, t.positions, caches(pool)[0], t.kv_indices,
                             t.kv_indptr, last, layout, check="guard", errors=errs, backend=backend)
    _, rk, rv = caches(ref)
    flashinfer_append(key, value, t, rk, rv, layout)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("widths", [(512, 64), (96, 32), (16, 8)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("one_buffer", [False, True])
def test_append_paged_mla_kv_cache_any_width(backend, widths, dtype, one_buffer):
    lora, rope = widths
    gen = torch.Generator().manual_seed(lora + rope)
    pps, pages = 2, 8
    t, _ = random_table(gen, 2, pps, pages, 5, torch.int64)
    n = t.positions.shape[0]
    ckv, kpe = rand_values((n, lora), dtype, gen), rand_values((n, rope), dtype, gen)
    if one_buffer:  # SGLang's FlashInfer MLA backend: two views of one [P, page, L + R] buffer
        pool = CanaryBuffer({"kv": ((pages, pps, lora + rope), dtype)}, 3)
        views = lambda p: (p["kv"][..., :lora], p["kv"][..., lora:])  # noqa: E731
    else:
        pool = CanaryBuffer({"ckv": ((pages, pps, lora), dtype), "kpe": ((pages, pps, rope), dtype)}, 3)
        views = lambda p: (p["ckv"], p["kpe"])  # noqa: E731
    ref, original = pool.clone(), pool.raw.clone()
    fi.append_paged_mla_kv_cache(ckv, kpe, t.batch_indices, t.positions, *views(pool), t.kv_indices,
                                 t.kv_indptr, torch.ones(2, dtype=torch.int32, device=DEVICE),
                                 check="assert", backend=backend)
    page, entry = flashinfer_rows(t, pps)
    rc, rp = views(ref)
    raw = lambda x: x.view(torch.uint8) if dtype in FP8 else x  # noqa: E731
    raw(rc)[page, entry] = raw(ckv)
    raw(rp)[page, entry] = raw(kpe)
    assert_same_bytes(pool, ref, original)


def test_get_batch_indices_positions():
    # FlashInfer's documented example
    b, p = fi.get_batch_indices_positions(torch.tensor([0, 1, 3, 6, 10], dtype=torch.int32, device=DEVICE),
                                          torch.tensor([5, 5, 5, 5], device=DEVICE), 10)
    assert b.dtype == p.dtype == torch.int32
    assert b.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert p.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]
    # random ragged appends (empty requests included) against a loop; padding past the end
    gen = torch.Generator().manual_seed(3)
    for _ in range(5):
        appended = torch.randint(0, 5, (6,), generator=gen)
        lens = appended + torch.randint(0, 9, (6,), generator=gen)
        indptr = torch.cat([torch.zeros(1, dtype=torch.int64), appended.cumsum(0)])
        nnz = int(indptr[-1]) + 3
        b, p = fi.get_batch_indices_positions(indptr.to(DEVICE), lens.to(DEVICE), nnz)
        want_b, want_p = [], []
        for r in range(6):
            for j in range(int(indptr[r]), int(indptr[r + 1])):
                want_b.append(r)
                want_p.append(int(lens[r]) - (int(indptr[r + 1]) - j))
        assert b.tolist() == want_b + [-1] * 3 and p.tolist() == want_p + [-1] * 3
    # seq lens: (pages - 1) * page_size + last page length
    assert fi.get_seq_lens(torch.tensor([0, 3, 4, 4]), torch.tensor([13, 8, 0]), 16).tolist() == [45, 8, 0]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("check", ["assert", "guard"])
def test_bad_page_table_caught(backend, check):
    """A kv_indices entry past the pool (the DCP draft-pool bug class, via a page table): caught with the
    token, batch, position, slot and page; guard writes every other token."""
    if check == "assert" and DEVICE.type == "cuda" and backend != "torch":
        pytest.skip("a device assert kills the CUDA context (test_pagetable's subprocess test)")
    pps, pages, h, d = 4, 6, 1, 8
    key = torch.randn(4, h, d).to(DEVICE)
    batch = torch.tensor([0, 0, 1, 1], dtype=torch.int32, device=DEVICE)
    pos = torch.tensor([0, 5, 0, 1], dtype=torch.int32, device=DEVICE)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32, device=DEVICE)
    indices = torch.tensor([2, 6, 4], dtype=torch.int32, device=DEVICE)  # page 6 of a 6-page pool
    pool = CanaryBuffer({"kv": ((pages, 2, pps, h, d), torch.float32)}, 1)
    original = pool.raw.clone()
    errs = kvwrite.ErrorBuffer(DEVICE)
    last = torch.tensor([2, 2], dtype=torch.int32, device=DEVICE)
    call = lambda: fi.append_paged_kv_cache(key, key, batch, pos, pool["kv"], indices, indptr, last,  # noqa: E731
                                            check=check, errors=errs, backend=backend)
    if check == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as info:
            call()
        err = info.value
        assert torch.equal(pool.raw, original)
    else:
        call()
        err = errs.error()
        good = CanaryBuffer({"kv": ((pages, 2, pps, h, d), torch.float32)}, 1)
        for i, page, row in ((0, 2, 0), (2, 4, 0), (3, 4, 1)):
            good["kv"][page, :, row] = key[i]
        assert torch.equal(pool.raw, good.raw)
    assert (err.token_index, err.kind, err.batch, err.position, err.table_slot, err.table_page) == (
        1, KIND_TABLE_PAGE, 0, 5, 1, 6)
    assert "maps to page 6 = kv_indices[1]" in str(err)


def test_argument_errors():
    k = torch.randn(2, 1, 8, device=DEVICE)
    idx = torch.zeros(2, dtype=torch.int32, device=DEVICE)
    indptr = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    last = torch.ones(1, dtype=torch.int32, device=DEVICE)
    cache = torch.zeros(2, 2, 4, 1, 8, device=DEVICE)
    cases = [
        (dict(paged_kv_cache=cache, kv_layout="NDH"), ValueError, "kv_layout must be one of"),
        (dict(paged_kv_cache=torch.zeros(2, 3, 4, 1, 8, device=DEVICE)), ValueError, "dim 1 must be 2"),
        (dict(paged_kv_cache=[cache[:, 0]]), TypeError, "paged_kv_cache must be a (k_cache, v_cache)"),
        (dict(paged_kv_cache=cache.to(torch.float8_e4m3fn)), TypeError, "FlashInfer appends values already"),
        (dict(paged_kv_cache=cache, kv_last_page_len=torch.ones(2, dtype=torch.int32, device=DEVICE)),
         ValueError, "kv_indptr must have len(kv_last_page_len) + 1"),
        (dict(paged_kv_cache=cache, check="strict"), ValueError, "check must be one of"),
    ]
    for kw, exc, text in cases:
        args = dict(append_key=k, append_value=k, batch_indices=idx, positions=idx, kv_indices=idx,
                    kv_indptr=indptr, kv_last_page_len=last)
        args.update(kw)
        with pytest.raises(exc) as info:
            fi.append_paged_kv_cache(**args)
        assert text in str(info.value)


def test_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "flashinfer_append.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "OutOfBoundsWrite" in out.stdout and "bytes match" in out.stdout
