"""check="off", decided (README "Off mode"): every negative loc is skipped on every backend; a
loc past the pool raises before any write on the torch backend and is skipped on the cpu
backend (never a write outside the cache tensor). The GPU backends (triton, cuda) write it
unchecked on a GPU, as the peers do; the Triton interpreter skips it like the cpu backend (an
unchecked store there writes host memory)."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes

ALL = ["torch", *BACKENDS]
H, D = 2, 16


def kv(n, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, H, D, generator=gen).to(DEVICE), torch.randn(n, H, D, generator=gen).to(DEVICE))


def pool(seed=0):
    return CanaryBuffer({"k": ((3, 4, H, D), torch.bfloat16), "v": ((3, 4, H, D), torch.bfloat16)}, seed)


def store(p, k, v, loc, backend, **kw):
    kvwrite.store_kv(k.bfloat16(), v.bfloat16(), p["k"], p["v"], loc, check="off", backend=backend, **kw)


@pytest.mark.parametrize("backend", ALL)
def test_every_negative_loc_is_skipped(backend):
    k, v = kv(6)
    loc = torch.tensor([-1, 4, -5, -(2 ** 40), 11, -2], device=DEVICE)
    p = pool()
    original = p.raw.clone()
    store(p, k, v, loc, backend)
    want = pool()
    keep = loc >= 0
    store(want, k[keep], v[keep], loc[keep], "torch")   # the same call without the negatives
    assert_same_bytes(p, want, original)


@pytest.mark.parametrize("backend", ALL)
def test_negative_loc_map_entries_are_skipped(backend):
    k, v = kv(4)
    loc_map = torch.tensor([3, -1, -7, 0, 9], device=DEVICE)
    loc = torch.tensor([0, 1, 2, 3], device=DEVICE)
    p = pool()
    original = p.raw.clone()
    store(p, k, v, loc, backend, loc_map=loc_map)
    want = pool()
    store(want, k[[0, 3]], v[[0, 3]], torch.tensor([3, 0], device=DEVICE), "torch")
    assert_same_bytes(p, want, original)


def test_torch_backend_raises_past_the_pool_before_any_write():
    k, v = kv(3)
    p = pool()
    original = p.raw.clone()
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 2 writes loc 12 into page 3, but the pool "
                       "has pages \\[0, 3\\) of 4 rows"):
        store(p, k, v, torch.tensor([0, 5, 12], device=DEVICE), "torch")
    assert torch.equal(p.raw, original), "nothing written: K was not stored before V failed"


@pytest.mark.parametrize("op", ["store_mla", "store_indexer_k", "store_kv_nvfp4"])
def test_torch_backend_other_ops_raise_past_the_pool_without_writing(op):
    n = 2
    loc = torch.tensor([1, 8], device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    if op == "store_mla":
        c = CanaryBuffer({"c": ((2, 4, 656), torch.uint8)})
        call = lambda: kvwrite.store_mla(torch.randn(n, 512, generator=gen), torch.randn(n, 64, generator=gen),  # noqa: E731
                                         c["c"], loc, kv_cache_dtype="fp8_ds_mla", backend="torch")
    elif op == "store_indexer_k":
        c = CanaryBuffer({"c": ((2, 4 * 132), torch.uint8)})
        call = lambda: kvwrite.store_indexer_k(torch.randn(n, 128, generator=gen), c["c"], loc,  # noqa: E731
                                               backend="torch")
    else:
        c = CanaryBuffer({"kc": ((2, 4, 1, 8), torch.uint8), "vc": ((2, 4, 1, 8), torch.uint8),
                          "ks": ((2, 4, 1, 1), torch.float8_e4m3fn), "vs": ((2, 4, 1, 1), torch.float8_e4m3fn)})
        x = torch.randn(n, 1, 16, generator=gen)
        call = lambda: kvwrite.store_kv_nvfp4(x, x, c["kc"], c["vc"], c["ks"], c["vs"], loc,  # noqa: E731
                                              backend="torch")
    original = c.raw.clone()
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=f"{op}: token 1 writes loc 8"):
        call()
    assert torch.equal(c.raw, original)


HOST_SKIPS = [b for b in BACKENDS if b == "cpu" or (b == "triton" and DEVICE.type == "cpu")]


@pytest.mark.skipif(not HOST_SKIPS, reason="needs the cpu backend or the Triton interpreter")
@pytest.mark.parametrize("backend", HOST_SKIPS)
@pytest.mark.parametrize("mapped", [False, True])
def test_host_backends_skip_a_loc_past_the_pool(mapped, backend):
    k, v = kv(4)
    loc = torch.tensor([2, 12, 7, 1 << 40], device=DEVICE)
    kw = {}
    if mapped:  # the same rows reached through an SWA loc_map
        kw["loc_map"] = loc.clone()
        loc = torch.arange(4, device=DEVICE)
    p = pool()
    original = p.raw.clone()
    store(p, k, v, loc, backend, **kw)   # no exception, no byte outside the pool's rows changed
    want = pool()
    store(want, k[[0, 2]], v[[0, 2]], torch.tensor([2, 7], device=DEVICE), "torch")
    assert_same_bytes(p, want, original)


@pytest.mark.skipif(DEVICE.type != "cpu" or "triton" not in BACKENDS, reason="the Triton interpreter")
def test_interpreter_skips_a_page_table_page_past_the_pool():
    k, v = kv(3)
    table = kvwrite.PageTable(positions=torch.tensor([1, 5, 2]), batch_indices=torch.tensor([0, 0, 1]),
                              kv_indptr=torch.tensor([0, 2, 3]),
                              kv_indices=torch.tensor([2, 1 << 40, 3]))
    p = pool()
    original = p.raw.clone()
    store(p, k, v, table, "triton")   # page 1 << 40 and page 3 (of 3) are past the pool: skipped
    want = pool()
    store(want, k[:1], v[:1], torch.tensor([9]), "torch")
    assert_same_bytes(p, want, original)
