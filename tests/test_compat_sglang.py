"""kvwrite.compat.sglang against an independent torch re-statement of SGLang's pool stores
(memory_pool.py: `buffer[loc] = cache` after `cache.div_(scale)` and `.to(dtype)` when the input
dtype differs from the pool's, `.view(store_dtype)` for uint8-stored fp8 pools; MLA rows =
concat(nope, rope); the NSA indexer page = page_size * 128 fp8 bytes then page_size fp32
scales), every pool dtype, every backend, canary-padded buffers, bad locs in assert and guard."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.compat import sglang

ALL = ["torch", *BACKENDS]
E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
ROOT = Path(__file__).resolve().parents[1]
PS, SIZE, H, D = 4, 16, 2, 16   # page_size, pool size (tokens); buffers have SIZE + PS rows


def skip_device_assert(backend, mode):
    """A device assert kills the CUDA context: kernel backends' assert mode on a GPU is covered by
    test_store_kv.py::test_device_assert_in_subprocess."""
    if mode == "assert" and DEVICE.type == "cuda" and backend != "torch":
        pytest.skip("device assert on a GPU: see test_store_kv.py::test_device_assert_in_subprocess")


def sglang_locs(gen, n):
    """Distinct rows of [0, SIZE + PS): loc 0 (the padding page) included, never -1 (SGLang pads
    with the padding page; torch indexing would wrap -1 to the last row)."""
    locs = torch.randperm(SIZE + PS - 1, generator=gen)[:n] + 1
    locs[1] = 0
    return locs.to(DEVICE)


def values(shape, dtype, gen, scale=4.0):
    return (torch.randn(shape, generator=gen) * scale).to(dtype).to(DEVICE)


def sglang_set_kv(k_buffer, v_buffer, loc, cache_k, cache_v, pool_dtype, store_dtype, k_scale, v_scale):
    """MHATokenToKVPool.set_kv_buffer restated."""
    cache_k, cache_v = cache_k.clone(), cache_v.clone()
    if cache_k.dtype != pool_dtype:
        if k_scale is not None:
            cache_k.div_(k_scale)
        if v_scale is not None:
            cache_v.div_(v_scale)
        cache_k, cache_v = cache_k.to(pool_dtype), cache_v.to(pool_dtype)
    if store_dtype != pool_dtype:
        cache_k, cache_v = cache_k.view(store_dtype), cache_v.view(store_dtype)
    k_buffer[loc] = cache_k
    v_buffer[loc] = cache_v


# (pool dtype, store dtype, input dtype, k_scale, v_scale): scales exact in the input dtype
# (powers of two) unless the input is fp32, values within the fp8 range.
KV_CASES = [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, None, None),
    (torch.float16, torch.float16, torch.float16, None, None),
    (torch.float32, torch.float32, torch.float32, None, None),
    (torch.float16, torch.float16, torch.float32, None, None),     # cast
    (E4M3, torch.uint8, torch.bfloat16, None, None),
    (E4M3, torch.uint8, torch.bfloat16, 2.0, 0.5),
    (E4M3, E4M3, torch.float32, 0.37, 1.3),
    (E5M2, torch.uint8, torch.float16, 0.25, 4.0),
    (E5M2, E5M2, torch.float32, 0.7, None),
    (E4M3, torch.uint8, E4M3, None, None),                        # fp8 input: stored as it is
]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("pool_dtype,store_dtype,in_dtype,k_scale,v_scale", KV_CASES)
def test_set_kv_buffer_matches_sglang(backend, pool_dtype, store_dtype, in_dtype, k_scale, v_scale):
    gen = torch.Generator().manual_seed(31)
    n = 6
    buf = CanaryBuffer({"k": ((SIZE + PS, H, D), store_dtype), "v": ((SIZE + PS, H, D), store_dtype)}, seed=1)
    if in_dtype in (E4M3, E5M2):
        k = torch.randint(0, 256, (n, H, D), dtype=torch.uint8, generator=gen).view(in_dtype).to(DEVICE)
        v = torch.randint(0, 256, (n, H, D), dtype=torch.uint8, generator=gen).view(in_dtype).to(DEVICE)
    else:
        k, v = values((n, H, D), in_dtype, gen), values((n, H, D), in_dtype, gen)
    loc = sglang_locs(gen, n)
    original, ref = buf.raw.clone(), buf.clone()
    dtype = pool_dtype if store_dtype == torch.uint8 else None
    sglang.set_kv_buffer(buf["k"], buf["v"], loc, k, v, PS, k_scale, v_scale, dtype=dtype, backend=backend)
    sglang_set_kv(ref["k"], ref["v"], loc, k, v, pool_dtype, store_dtype, k_scale, v_scale)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_set_kv_buffer_tensor_scale(backend):
    gen = torch.Generator().manual_seed(3)
    k, v = values((4, H, D), torch.float32, gen), values((4, H, D), torch.float32, gen)
    buf = CanaryBuffer({"k": ((SIZE + PS, H, D), torch.uint8), "v": ((SIZE + PS, H, D), torch.uint8)}, seed=2)
    loc = sglang_locs(gen, 4)
    ks, vs = torch.tensor([0.3], device=DEVICE), torch.tensor(0.9, device=DEVICE)
    original, ref = buf.raw.clone(), buf.clone()
    sglang.set_kv_buffer(buf["k"], buf["v"], loc, k, v, PS, ks, vs, dtype=E4M3, backend=backend)
    sglang_set_kv(ref["k"], ref["v"], loc, k, v, E4M3, torch.uint8, ks, vs)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_set_kv_buffer_documented_difference_saturates(backend):
    """Past e5m2's range SGLang's `.to(fp8)` gives inf; kvwrite saturates to 57344. (torch's
    e4m3fn cast saturates too: there the two agree.)"""
    k = torch.full((1, H, D), 1e5, dtype=torch.bfloat16, device=DEVICE)
    kb = torch.zeros(SIZE + PS, H, D, dtype=torch.uint8, device=DEVICE)
    vb, ref_k, ref_v = kb.clone(), kb.clone(), kb.clone()
    loc = torch.tensor([5], device=DEVICE)
    sglang.set_kv_buffer(kb, vb, loc, k, k, PS, dtype=E5M2, backend=backend)
    sglang_set_kv(ref_k, ref_v, loc, k, k, E5M2, torch.uint8, None, None)
    assert torch.isinf(ref_k[5].view(E5M2).float()).all()
    assert (kb[5].view(E5M2).float() == 57344.0).all()


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_set_kv_buffer_bad_loc(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(8)
    k, v = values((4, H, D), torch.bfloat16, gen), values((4, H, D), torch.bfloat16, gen)
    kb = torch.zeros(SIZE + PS, H, D, dtype=torch.bfloat16, device=DEVICE)
    vb = kb.clone()
    loc = torch.tensor([3, SIZE + PS, 0, -1], device=DEVICE)  # SGLang #33348: one page past the pool
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            sglang.set_kv_buffer(kb, vb, loc, k, v, PS, check="assert", backend=backend)
        assert exc.value.token_index == 1 and exc.value.page == (SIZE + PS) // PS
        return
    sglang.set_kv_buffer(kb, vb, loc, k, v, PS, check="guard", errors=errors, backend=backend)
    err = errors.error()
    assert err.token_index == 1 and err.loc == SIZE + PS and err.count == 1
    assert torch.equal(kb[3], k[0]) and torch.equal(kb[0], k[2])


def test_set_kv_buffer_argument_errors():
    kb = torch.zeros(SIZE + PS, H, D, dtype=torch.uint8)
    k = torch.zeros(2, H, D)
    loc = torch.tensor([1, 2])
    with pytest.raises(TypeError, match="pass dtype="):
        sglang.set_kv_buffer(kb, kb, loc, k, k, PS)
    with pytest.raises(ValueError, match="page_size=3"):
        sglang.set_kv_buffer(kb, kb, loc, k, k, 3, dtype=E4M3)


# --- set_mla_kv_buffer ---------------------------------------------------------------------

R, ROPE = 32, 16


def sglang_set_mla(kv_buffer, loc, nope, rope, pool_dtype, store_dtype):
    """MLATokenToKVPool.set_mla_kv_buffer restated (buffer [rows, 1, R + rope]); its kernels skip
    loc 0 (`reserved_skip_index=0`)."""
    keep = loc != 0
    loc, nope, rope = loc[keep], nope[keep], rope[keep]
    if nope.dtype != pool_dtype:
        nope, rope = nope.to(pool_dtype), rope.to(pool_dtype)
    if store_dtype != pool_dtype:
        nope, rope = nope.view(store_dtype), rope.view(store_dtype)
    kv_buffer[loc, :, :nope.shape[-1]] = nope.reshape(nope.shape[0], 1, -1)
    kv_buffer[loc, :, nope.shape[-1]:] = rope.reshape(rope.shape[0], 1, -1)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("rope_arg", ["empty", "none"])
def test_set_mla_kv_buffer_without_rope_writes_loc0_as_sglang(backend, rope_arg):
    """SGLang's no-rope MLA kernel (`set_mla_kv_buffer_kernel_norope`) takes no skip index: loc 0
    is written (the 12 rope_dim-0 cases of bench/peers/sglang_diff.py); with rope it is skipped."""
    gen = torch.Generator().manual_seed(43)
    n = 5
    buf = CanaryBuffer({"kv": ((SIZE + PS, 1, R), torch.bfloat16)}, seed=5)
    nope = values((n, R), torch.bfloat16, gen)
    loc = sglang_locs(gen, n)
    assert int(loc[1]) == 0
    original, ref = buf.raw.clone(), buf.clone()
    rope = nope[:, :0] if rope_arg == "empty" else None
    sglang.set_mla_kv_buffer(buf["kv"], loc, nope, rope, PS, backend=backend)
    ref["kv"][loc, 0] = nope
    assert_same_bytes(buf, ref, original)
    assert torch.equal(buf["kv"][0, 0], nope[1])


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("three_d", [True, False])
@pytest.mark.parametrize("pool_dtype,store_dtype,in_dtype", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16), (torch.float16, torch.float16, torch.float16),
    (torch.float32, torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16, torch.float32),
    (E4M3, torch.uint8, torch.bfloat16), (E5M2, E5M2, torch.float16), (E4M3, torch.uint8, E4M3),
])
def test_set_mla_kv_buffer_matches_sglang(backend, three_d, pool_dtype, store_dtype, in_dtype):
    gen = torch.Generator().manual_seed(41)
    n = 5
    buf = CanaryBuffer({"kv": ((SIZE + PS, 1, R + ROPE), store_dtype)}, seed=4)
    if in_dtype in (E4M3, E5M2):
        nope = torch.randint(0, 256, (n, R), dtype=torch.uint8, generator=gen).view(in_dtype).to(DEVICE)
        rope = torch.randint(0, 256, (n, ROPE), dtype=torch.uint8, generator=gen).view(in_dtype).to(DEVICE)
    else:
        nope, rope = values((n, R), in_dtype, gen), values((n, ROPE), in_dtype, gen)
    if three_d:
        nope, rope = nope[:, None], rope[:, None]
    loc = sglang_locs(gen, n)
    original, ref = buf.raw.clone(), buf.clone()
    dtype = pool_dtype if store_dtype == torch.uint8 else None
    sglang.set_mla_kv_buffer(buf["kv"], loc, nope, rope, PS, dtype=dtype, backend=backend)
    sglang_set_mla(ref["kv"], loc, nope, rope, pool_dtype, store_dtype)
    assert_same_bytes(buf, ref, original)
    assert int(loc[1]) == 0 and bool((buf["kv"][0].view(torch.uint8) == original[
        buf.offsets["kv"]:buf.offsets["kv"] + buf["kv"][0].numel() * buf["kv"].element_size()]).all())


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_set_mla_kv_buffer_bad_loc(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(9)
    nope, rope = values((3, 1, R), torch.bfloat16, gen), values((3, 1, ROPE), torch.bfloat16, gen)
    kv = torch.zeros(SIZE + PS, 1, R + ROPE, dtype=torch.bfloat16, device=DEVICE)
    loc = torch.tensor([2, 1, -5], device=DEVICE)
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            sglang.set_mla_kv_buffer(kv, loc, nope, rope, PS, check="assert", backend=backend)
        assert exc.value.token_index == 2 and exc.value.loc == -5
        return
    sglang.set_mla_kv_buffer(kv, loc, nope, rope, PS, check="guard", errors=errors, backend=backend)
    err = errors.error()
    assert err.token_index == 2 and err.loc == -5 and err.count == 1


# --- set_index_k_buffer --------------------------------------------------------------------

def sglang_set_index_k(buffer, loc, index_k, page_size, scale_fmt):
    """The NSA indexer page restated: page = loc // page_size holds page_size * 128 fp8 bytes
    (token o at o * 128), then page_size fp32 scales (token o at page_size * 128 + o * 4); one
    scale per 128 values, max(amax, 1e-4) / 448 (ue8m0: 2^ceil(log2))."""
    for i, s in enumerate(loc.tolist()):
        if s < 0:
            continue
        p, o = s // page_size, s % page_size
        x = index_k[i].float()
        sc = torch.clamp(x.abs().max(), min=1e-4) / 448.0
        if scale_fmt == "ue8m0":
            sc = torch.exp2(torch.ceil(torch.log2(sc)))
        buffer[p, o * 128:(o + 1) * 128] = (x / sc).clamp(-448, 448).to(E4M3).view(torch.uint8)
        at = page_size * 128 + o * 4
        buffer[p, at:at + 4] = sc.reshape(1).view(torch.uint8)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_set_index_k_buffer_matches_sglang(backend, scale_fmt, dtype):
    gen = torch.Generator().manual_seed(51)
    n = 5
    buf = CanaryBuffer({"i": (((SIZE + PS) // PS, PS * 132), torch.uint8)}, seed=6)
    k = values((n, 128), dtype, gen)
    k[2] = 0  # the amax floor
    loc = sglang_locs(gen, n)
    original, ref = buf.raw.clone(), buf.clone()
    sglang.set_index_k_buffer(buf["i"], loc, k, PS, scale_fmt, backend=backend)
    sglang_set_index_k(ref["i"], loc, k, PS, scale_fmt)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_set_index_k_buffer_bad_loc(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(10)
    k = values((3, 128), torch.bfloat16, gen)
    ib = torch.zeros((SIZE + PS) // PS, PS * 132, dtype=torch.uint8, device=DEVICE)
    loc = torch.tensor([0, 7, SIZE + PS + 1], device=DEVICE)
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            sglang.set_index_k_buffer(ib, loc, k, PS, check="assert", backend=backend)
        assert exc.value.token_index == 2 and exc.value.loc == SIZE + PS + 1
        return
    sglang.set_index_k_buffer(ib, loc, k, PS, check="guard", errors=errors, backend=backend)
    err = errors.error()
    assert err.token_index == 2 and err.count == 1


def test_set_index_k_buffer_shape_error():
    with pytest.raises(ValueError, match="page_size"):
        sglang.set_index_k_buffer(torch.zeros(5, 4 * 130, dtype=torch.uint8), torch.tensor([1]),
                                  torch.zeros(1, 128), PS)


def test_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "sglang_store.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "bytes match" in out.stdout and "OutOfBoundsWrite" in out.stdout
