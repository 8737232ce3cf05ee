"""kvwrite.compat.vllm against an independent torch re-statement of vLLM's cache kernels
(csrc/cache_kernels.cu: block_idx = slot // block_size, block_offset = slot % block_size, slot < 0
skipped; fp8 = cvt_fp8(x / scale, SATFINITE)), every kv_cache_dtype vLLM takes, every backend,
canary-padded caches, bad slots in assert and guard."""
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
from kvwrite.compat import vllm

ALL = ["torch", *BACKENDS]
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
FMAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
ROOT = Path(__file__).resolve().parents[1]
NB, BS, H, D = 5, 4, 2, 16   # blocks, block_size, heads, head_dim


def skip_device_assert(backend, mode):
    """A device assert kills the CUDA context: kernel backends' assert mode on a GPU is covered by
    test_store_kv.py::test_device_assert_in_subprocess."""
    if mode == "assert" and DEVICE.type == "cuda" and backend != "torch":
        pytest.skip("device assert on a GPU: see test_store_kv.py::test_device_assert_in_subprocess")


def vllm_fp8(x: torch.Tensor, scale: float, fmt: torch.dtype) -> torch.Tensor:
    """vLLM's scaled_convert: fp32 x / scale, saturated to the format's finite range, RNE."""
    return (x.float() / scale).clamp(-FMAX[fmt], FMAX[fmt]).to(fmt).view(torch.uint8)


def slots(gen, n, capacity, pad=(1,)):
    s = torch.randperm(capacity, generator=gen)[:n]
    for i in pad:
        s[i] = -1
    return s.to(DEVICE)


def values(shape, dtype, gen):
    return (torch.randn(shape, generator=gen) * 4).to(dtype).to(DEVICE)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t


def flash_reference(key, value, kc, vc, slot_mapping, kv_cache_dtype, ks, vs):
    """reshape_and_cache_flash restated: per token, per head, per element (tiny shapes)."""
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = s // kc.shape[1], s % kc.shape[1]
        for src, dst, sc in ((key, kc, ks), (value, vc, vs)):
            if kv_cache_dtype == "auto" or src.dtype in FMAX:
                _bytes(dst)[b, o] = _bytes(src[i])
            else:
                _bytes(dst)[b, o] = vllm_fp8(src[i], float(sc.reshape(-1)[0]), FP8[kv_cache_dtype])


def kv_buffer(kv_cache_dtype, dtype, layout, typed_u8, seed):
    """A canary-padded packed K/V buffer and its (key_cache, value_cache) [NB, BS, H, D] views."""
    cdt = dtype if kv_cache_dtype == "auto" else (torch.uint8 if typed_u8 else FP8[kv_cache_dtype])
    shape = (NB, 2, BS, H, D) if layout == "NHD" else (NB, 2, H, BS, D)
    buf = CanaryBuffer({"kv": (shape, cdt)}, seed=seed)

    def views(b):
        kv = b["kv"]
        if layout == "HND":
            kv = kv.transpose(2, 3)  # vLLM's HND allocation: a stride-permuted [NB, 2, BS, H, D] view
        return kv[:, 0], kv[:, 1]
    return buf, views


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
@pytest.mark.parametrize("kv_cache_dtype,dtype,typed_u8", [
    ("auto", torch.float32, False), ("auto", torch.float16, False), ("auto", torch.bfloat16, False),
    ("fp8", torch.bfloat16, True), ("fp8_e4m3", torch.float16, False), ("fp8_e5m2", torch.float32, True),
    ("fp8_e5m2", torch.bfloat16, False), ("fp8_e4m3", torch.float8_e4m3fn, True),
])
def test_reshape_and_cache_flash_matches_vllm(backend, layout, kv_cache_dtype, dtype, typed_u8):
    gen = torch.Generator().manual_seed(7)
    n = 6
    if dtype in FMAX:
        key = torch.randint(0, 256, (n + 2, H, D), dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)
        value = torch.randint(0, 256, (n + 2, H, D), dtype=torch.uint8, generator=gen).view(dtype).to(DEVICE)
    else:  # two padding rows past slot_mapping (vLLM stores slot_mapping.shape[0] tokens)
        key, value = values((n + 2, H, D), dtype, gen), values((n + 2, H, D), dtype, gen)
        key[0, 0, :3] = torch.tensor([1e6, -1e6, 0.0])  # saturates in e4m3 / e5m2
    ks = torch.tensor([0.37], device=DEVICE)
    vs = torch.tensor([1.9], device=DEVICE)
    sm = slots(gen, n, NB * BS)
    buf, views = kv_buffer(kv_cache_dtype, dtype, layout, typed_u8, seed=3)
    original, ref = buf.raw.clone(), buf.clone()
    vllm.reshape_and_cache_flash(key, value, *views(buf), sm, kv_cache_dtype, ks, vs, backend=backend)
    flash_reference(key, value, *views(ref), sm, kv_cache_dtype, ks, vs)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_reshape_and_cache_flash_auto_ignores_scales(backend):
    gen = torch.Generator().manual_seed(1)
    key, value = values((3, H, D), torch.bfloat16, gen), values((3, H, D), torch.bfloat16, gen)
    buf, views = kv_buffer("auto", torch.bfloat16, "NHD", False, seed=5)
    original, ref = buf.raw.clone(), buf.clone()
    sm = slots(gen, 3, NB * BS, pad=())
    empty = torch.empty(0, device=DEVICE)  # vLLM passes [] scales for "auto"
    vllm.reshape_and_cache_flash(key, value, *views(buf), sm, "auto", empty, empty, backend=backend)
    flash_reference(key, value, *views(ref), sm, "auto", None, None)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_reshape_and_cache_flash_bad_slots(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(2)
    key, value = values((5, H, D), torch.float16, gen), values((5, H, D), torch.float16, gen)
    sm = slots(gen, 5, NB * BS, pad=(0,))
    sm[2] = -2                 # not vLLM's padding -1: reported (off mode skips it, like vLLM)
    sm[4] = NB * BS + 3        # past the pool
    buf, views = kv_buffer("auto", torch.float16, "NHD", False, seed=9)
    original = buf.raw.clone()
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            vllm.reshape_and_cache_flash(key, value, *views(buf), sm, "auto", None, None,
                                         check="assert", backend=backend)
        assert exc.value.token_index == 2 and exc.value.loc == -2
        return
    vllm.reshape_and_cache_flash(key, value, *views(buf), sm, "auto", None, None, check="guard",
                                 errors=errors, backend=backend)
    err = errors.error()
    assert err is not None and err.token_index == 2 and err.loc == -2 and err.count == 2
    # the good tokens are written, the bad ones are not
    ref = buf.clone()
    ref.raw.copy_(original)
    good = sm.clone()
    good[2] = good[4] = -1
    flash_reference(key, value, *views(ref), good, "auto", None, None)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_reshape_and_cache_flash_off_skips_every_negative_slot(backend):
    gen = torch.Generator().manual_seed(4)
    key, value = values((4, H, D), torch.float32, gen), values((4, H, D), torch.float32, gen)
    sm = slots(gen, 4, NB * BS, pad=(1,))
    sm[3] = -7
    buf, views = kv_buffer("auto", torch.float32, "NHD", False, seed=11)
    original, ref = buf.raw.clone(), buf.clone()
    vllm.reshape_and_cache_flash(key, value, *views(buf), sm, "auto", None, None, check="off", backend=backend)
    flash_reference(key, value, *views(ref), sm, "auto", None, None)
    assert_same_bytes(buf, ref, original)


def test_reshape_and_cache_flash_argument_errors():
    key = torch.zeros(2, H, D, device=DEVICE)
    kc = torch.zeros(NB, BS, H, D, dtype=torch.uint8, device=DEVICE)
    sm = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        vllm.reshape_and_cache_flash(key, key, kc, kc, sm, "int8", one, one)
    with pytest.raises(TypeError, match="key_cache"):
        vllm.reshape_and_cache_flash(key, key, kc.view(torch.float8_e5m2), kc.view(torch.float8_e5m2), sm,
                                     "fp8_e4m3", one, one)
    with pytest.raises(ValueError, match="slot_mapping has 3 entries"):
        vllm.reshape_and_cache_flash(key, key, kc, kc, torch.zeros(3, dtype=torch.int64), "fp8", one, one)


# --- concat_and_cache_mla ------------------------------------------------------------------

L, R = 128, 16


def mla_reference(kv_c, k_pe, cache, slot_mapping, kv_cache_dtype, scale, pow2=True):
    """concat_and_cache_mla / concat_and_cache_ds_mla restated per token (ds_mla: vLLM >= 0.31's
    power-of-two tile scales, or `pow2=False`: older releases' amax / 448 floored at FLT_MIN)."""
    bs = cache.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = s // bs, s % bs
        if kv_cache_dtype == "auto":
            cache[b, o] = torch.cat([kv_c[i], k_pe[i]])
        elif kv_cache_dtype in ("fp8", "fp8_e4m3"):
            row = torch.cat([kv_c[i], k_pe[i]])
            cache.view(torch.uint8)[b, o] = vllm_fp8(row, float(scale.reshape(-1)[0]), torch.float8_e4m3fn)
        else:  # fp8_ds_mla: per 128-tile fp8 + fp32 scales, then k_pe's own 16-bit values
            out = cache.view(torch.uint8)[b, o]
            x = kv_c[i].float()
            tiles = x.shape[0] // 128
            for t in range(tiles):
                tile = x[t * 128:(t + 1) * 128]
                if pow2:   # exp2f(ceilf(log2f(fmaxf(amax / 448, 1e-4f))))
                    sc = torch.exp2(torch.ceil(torch.log2(torch.clamp(tile.abs().max() / 448.0, min=1e-4))))
                else:
                    sc = torch.clamp(tile.abs().max() / 448.0, min=torch.finfo(torch.float32).tiny)
                out[t * 128:(t + 1) * 128] = vllm_fp8(tile, float(sc), torch.float8_e4m3fn)
                out[L + 4 * t:L + 4 * t + 4] = sc.reshape(1).view(torch.uint8)
            rope = out[L + 4 * tiles:]
            rope[:] = 0    # NoPE (k_pe [N, 0]): the reserved rope bytes are zeroed
            rope[:2 * k_pe.shape[1]] = k_pe[i].contiguous().view(torch.uint8)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kv_cache_dtype,dtype,typed_u8", [
    ("auto", torch.float32, False), ("auto", torch.float16, False), ("auto", torch.bfloat16, False),
    ("fp8", torch.bfloat16, True), ("fp8_e4m3", torch.float16, False), ("fp8_ds_mla", torch.bfloat16, True),
    ("fp8_ds_mla", torch.float16, True),
])
def test_concat_and_cache_mla_matches_vllm(backend, kv_cache_dtype, dtype, typed_u8):
    gen = torch.Generator().manual_seed(13)
    n = 5
    width = L + L // 128 * 4 + 2 * R if kv_cache_dtype == "fp8_ds_mla" else L + R
    cdt = dtype if kv_cache_dtype == "auto" else (torch.uint8 if typed_u8 else torch.float8_e4m3fn)
    buf = CanaryBuffer({"c": ((NB, BS, width), cdt)}, seed=17)
    kv_c, k_pe = values((n + 1, L), dtype, gen), values((n + 1, R), dtype, gen)
    scale = torch.tensor([0.05], device=DEVICE)
    sm = slots(gen, n, NB * BS, pad=(2,))
    original, ref = buf.raw.clone(), buf.clone()
    vllm.concat_and_cache_mla(kv_c, k_pe, buf["c"], sm, kv_cache_dtype, scale, backend=backend)
    mla_reference(kv_c, k_pe, ref["c"], sm, kv_cache_dtype, scale)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("version,pow2,nope", [("0.11.0", False, False), ("0.30.0", False, False),
                                               ("0.31.0", True, False), ("0.32.0", True, True)])
def test_concat_and_cache_ds_mla_follows_the_vllm_version(backend, version, pow2, nope):
    """fp8_ds_mla tile scales switch to powers of two at vLLM 0.31; fp16 k_pe keeps its bits;
    vLLM 0.32's NoPE call (k_pe [N, 0] into rows that reserve the rope bytes) zeroes them."""
    gen = torch.Generator().manual_seed(21)
    n = 6
    width = L + L // 128 * 4 + 2 * R
    buf = CanaryBuffer({"c": ((NB, BS, width), torch.uint8)}, seed=23)
    kv_c = values((n, L), torch.float16, gen) * torch.tensor([1e-6, 1e-3, 1, 3, 50, 1e3], device=DEVICE)[:, None].half()
    k_pe = values((n, 0 if nope else R), torch.float16, gen)
    sm = slots(gen, n, NB * BS, pad=(4,))
    original, ref = buf.raw.clone(), buf.clone()
    vllm.concat_and_cache_mla(kv_c, k_pe, buf["c"], sm, "fp8_ds_mla", None, backend=backend,
                              vllm_version=version)
    mla_reference(kv_c, k_pe, ref["c"], sm, "fp8_ds_mla", None, pow2=pow2)
    assert_same_bytes(buf, ref, original)
    assert vllm.ds_mla_scale(version) == ("pow2" if pow2 else "exact")
    assert vllm.ds_mla_scale() == "pow2"     # default: the newest release
    with pytest.raises(ValueError, match="vllm_version must be a version string"):
        vllm.ds_mla_scale("newest")


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_concat_and_cache_mla_bad_slot(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(3)
    kv_c, k_pe = values((4, L), torch.bfloat16, gen), values((4, R), torch.bfloat16, gen)
    cache = torch.zeros(NB, BS, L + R, dtype=torch.bfloat16, device=DEVICE)
    sm = slots(gen, 4, NB * BS, pad=())
    sm[3] = NB * BS
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            vllm.concat_and_cache_mla(kv_c, k_pe, cache, sm, "auto", None, check="assert", backend=backend)
        assert exc.value.token_index == 3 and exc.value.page == NB
        return
    vllm.concat_and_cache_mla(kv_c, k_pe, cache, sm, "auto", None, check="guard", errors=errors, backend=backend)
    err = errors.error()
    assert err.token_index == 3 and err.loc == NB * BS and err.count == 1


# --- indexer_k_quant_and_cache ---------------------------------------------------------------

def indexer_reference(k, cache, slot_mapping, qbs, scale_fmt):
    """indexer_k_quant_and_cache restated: block b at byte b * block_size * cache_stride; values at
    block_offset * head_dim + j, block scale at block_size * head_dim + (block_offset * head_dim + j)
    * 4 / qbs; scale = max(amax, 1e-4) / 448 (ue8m0: 2^ceil(log2))."""
    nb, bs, stride = cache.shape
    flat = cache.reshape(-1)
    d = k.shape[1]
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        blk, off = s // bs, s % bs
        base = blk * bs * stride
        for j in range(0, d, qbs):
            x = k[i, j:j + qbs].float()
            sc = torch.clamp(x.abs().max(), min=1e-4) / 448.0
            if scale_fmt == "ue8m0":
                sc = torch.exp2(torch.ceil(torch.log2(sc)))
            flat[base + off * d + j:base + off * d + j + qbs] = vllm_fp8(x, float(sc), torch.float8_e4m3fn)
            at = base + bs * d + (off * d + j) * 4 // qbs
            flat[at:at + 4] = sc.reshape(1).view(torch.uint8)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_indexer_k_quant_and_cache_matches_vllm(backend, scale_fmt, dtype):
    gen = torch.Generator().manual_seed(21)
    hd, qbs, n = 64, 32, 5
    buf = CanaryBuffer({"c": ((NB, BS, hd + hd * 4 // qbs), torch.uint8)}, seed=23)
    k = values((n, hd), dtype, gen)
    k[1, :qbs] = 0  # amax floor
    sm = slots(gen, n, NB * BS, pad=(3,))
    original, ref = buf.raw.clone(), buf.clone()
    vllm.indexer_k_quant_and_cache(k, buf["c"], sm, qbs, scale_fmt, backend=backend)
    indexer_reference(k, ref["c"], sm, qbs, scale_fmt)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_indexer_k_quant_and_cache_bad_slot(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(5)
    k = values((3, 64), torch.bfloat16, gen)
    cache = torch.zeros(NB, BS, 64 + 8, dtype=torch.uint8, device=DEVICE)
    sm = torch.tensor([0, -3, 5], device=DEVICE)
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            vllm.indexer_k_quant_and_cache(k, cache, sm, 32, "", check="assert", backend=backend)
        assert exc.value.token_index == 1 and exc.value.loc == -3
        return
    vllm.indexer_k_quant_and_cache(k, cache, sm, 32, "", check="guard", errors=errors, backend=backend)
    err = errors.error()
    assert err.token_index == 1 and err.loc == -3 and err.count == 1


def test_indexer_cache_shape_error():
    k = torch.zeros(2, 64, device=DEVICE)
    with pytest.raises(ValueError, match=r"\[num_blocks, block_size, 72\]"):
        vllm.indexer_k_quant_and_cache(k, torch.zeros(2, 4, 70, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64),
                                       32, None)


def test_example_runs():
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    out = subprocess.run([sys.executable, str(ROOT / "examples" / "vllm_store.py")], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "bytes match" in out.stdout and "OutOfBoundsWrite" in out.stdout


# --- reshape_and_cache (legacy head-major layout) -------------------------------------------

def legacy_reference(key, value, kc, vc, slot_mapping, kv_cache_dtype, ks, vs):
    """reshape_and_cache restated from vLLM's index arithmetic on contiguous caches:
    key  at ((block * H + h) * (D / x) + d / x) * block_size * x + offset * x + d % x,
    value at ((block * H + h) * D + d) * block_size + offset."""
    nb, h, dx, bs, x = kc.shape
    d = dx * x
    kflat, vflat = kc.reshape(-1), vc.reshape(-1)
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, o = s // bs, s % bs
        for hh in range(h):
            for dd in range(d):
                ka = ((b * h + hh) * dx + dd // x) * bs * x + o * x + dd % x
                va = ((b * h + hh) * d + dd) * bs + o
                for src, flat, at, sc in ((key, kflat, ka, ks), (value, vflat, va, vs)):
                    xv = src[i, hh, dd:dd + 1]
                    if kv_cache_dtype == "auto":
                        _bytes(flat)[at] = _bytes(xv)[0]
                    else:
                        _bytes(flat)[at] = vllm_fp8(xv, float(sc.reshape(-1)[0]), FP8[kv_cache_dtype])[0]


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kv_cache_dtype,dtype,typed_u8", [
    ("auto", torch.float32, False), ("auto", torch.float16, False), ("auto", torch.bfloat16, False),
    ("fp8", torch.bfloat16, True), ("fp8_e4m3", torch.float32, False), ("fp8_e5m2", torch.float16, True),
])
def test_reshape_and_cache_matches_vllm(backend, kv_cache_dtype, dtype, typed_u8):
    gen = torch.Generator().manual_seed(19)
    n = 5
    cdt = dtype if kv_cache_dtype == "auto" else (torch.uint8 if typed_u8 else FP8[kv_cache_dtype])
    x = 16 // torch.empty((), dtype=cdt).element_size()
    d = 32 if x == 16 else D
    buf = CanaryBuffer({"k": ((NB, H, d // x, BS, x), cdt), "v": ((NB, H, d, BS), cdt)}, seed=29)
    key, value = values((n + 1, H, d), dtype, gen), values((n + 1, H, d), dtype, gen)
    key[0, 1, :2] = torch.tensor([1e6, -1e6])  # saturates
    ks, vs = torch.tensor([0.6], device=DEVICE), torch.tensor([1.7], device=DEVICE)
    sm = slots(gen, n, NB * BS, pad=(2,))
    original, ref = buf.raw.clone(), buf.clone()
    vllm.reshape_and_cache(key, value, buf["k"], buf["v"], sm, kv_cache_dtype, ks, vs, backend=backend)
    legacy_reference(key, value, ref["k"], ref["v"], sm, kv_cache_dtype, ks, vs)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_reshape_and_cache_bad_slot(backend, mode):
    skip_device_assert(backend, mode)
    gen = torch.Generator().manual_seed(6)
    key, value = values((4, H, D), torch.float16, gen), values((4, H, D), torch.float16, gen)
    kc = torch.zeros(NB, H, D // 8, BS, 8, dtype=torch.float16, device=DEVICE)
    vc = torch.zeros(NB, H, D, BS, dtype=torch.float16, device=DEVICE)
    sm = torch.tensor([3, -1, NB * BS + 1, 0], device=DEVICE)
    errors = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite) as exc:
            vllm.reshape_and_cache(key, value, kc, vc, sm, "auto", None, None, check="assert", backend=backend)
        assert exc.value.token_index == 2 and exc.value.page == NB
        return
    vllm.reshape_and_cache(key, value, kc, vc, sm, "auto", None, None, check="guard", errors=errors,
                           backend=backend)
    err = errors.error()
    assert err.token_index == 2 and err.loc == NB * BS + 1 and err.count == 1
    assert torch.equal(kc[0, :, :, 3].reshape(H, D), key[0]) and torch.equal(vc[0, :, :, 0], value[3])


def test_reshape_and_cache_shape_error():
    key = torch.zeros(2, H, D, dtype=torch.float16)
    vc = torch.zeros(NB, H, D, BS, dtype=torch.float16)
    with pytest.raises(ValueError, match="x = 8"):
        vllm.reshape_and_cache(key, key, torch.zeros(NB, H, D // 4, BS, 4, dtype=torch.float16), vc,
                               torch.zeros(2, dtype=torch.int64), "auto", None, None)


# --- concat_and_cache_mla_grouped: every layer's MLA rows, caches found by address --------------

@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("shared", [False, True])
def test_concat_and_cache_mla_grouped_matches_per_layer_stores(kv_cache_dtype, shared):
    """vLLM 0.32's test: the grouped call writes what one concat_and_cache_mla per layer writes,
    pointers into one [layers, blocks, bs, L + R] buffer, last token padded, slot rows shared or not."""
    gen = torch.Generator().manual_seed(3)
    layers, n, nb, bs, lora, rope = 3, 6, 4, 8, 32, 16
    kv_c = torch.randn(layers, n, lora, generator=gen).bfloat16()
    k_pe = torch.randn(layers, n, rope, generator=gen).bfloat16()
    dtype = torch.bfloat16 if kv_cache_dtype == "auto" else torch.uint8
    caches = torch.zeros(layers, nb, bs, lora + rope, dtype=dtype)
    reference = torch.zeros_like(caches)
    scales = torch.linspace(0.05, 0.25, layers)
    sm = torch.stack([torch.randperm(nb * bs, generator=gen)[:n] for _ in range(layers)])
    sm[:, -1] = -1
    if shared:
        sm = sm[:1].expand(layers, -1)
    for layer in range(layers):
        vllm.concat_and_cache_mla(kv_c[layer], k_pe[layer], reference[layer], sm[layer], kv_cache_dtype,
                                  scales[layer], backend="torch")
    ptrs = torch.tensor([caches[layer].data_ptr() for layer in range(layers)])
    vllm.concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, sm, bs, caches.stride(1), caches.stride(2),
                                      None if kv_cache_dtype == "auto" else scales, kv_cache_dtype,
                                      check="off", backend="torch")
    assert torch.equal(caches, reference) and bool(caches.any())


def test_concat_and_cache_mla_grouped_checks_known_caches_and_refuses_unknown_ones():
    """Caches passed (or registered) are bounded: a slot one past the last block is skipped and
    recorded, every other byte of the buffer (canaries between the caches included) is what the
    per-layer stores write; an address kvwrite does not know is refused in guard mode."""
    layers, nb, bs, width = 2, 2, 4, 24
    kv_c, k_pe = torch.randn(layers, 3, 16).bfloat16(), torch.randn(layers, 3, 8).bfloat16()
    buf = CanaryBuffer({f"l{i}": ((nb, bs, width), torch.bfloat16) for i in range(layers)})
    twin = buf.clone()
    caches = [buf[f"l{i}"] for i in range(layers)]
    ptrs = torch.tensor([c.data_ptr() for c in caches])
    sm = torch.tensor([[0, 5, 7], [1, nb * bs, -1]])                  # layer 1: one past the last block
    for i, good in enumerate(([0, 5, 7], [1, -1, -1])):
        vllm.concat_and_cache_mla(kv_c[i], k_pe[i], twin[f"l{i}"], torch.tensor(good), "auto", None,
                                  backend="torch")
    errors = kvwrite.ErrorBuffer()
    with pytest.raises(ValueError, match=r"kv_cache_ptrs\[0\] = 0x[0-9a-f]+ is not a cache kvwrite knows"):
        vllm.concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, sm, bs, caches[0].stride(0), caches[0].stride(1),
                                          check="guard", errors=errors, backend="torch")
    vllm.concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, sm, bs, caches[0].stride(0), caches[0].stride(1),
                                      caches=caches, check="guard", errors=errors, backend="torch")
    err = errors.error()
    assert err is not None and err.token_index == 1 and err.loc == nb * bs and err.page == nb
    assert torch.equal(buf.raw, twin.raw)
    with pytest.raises(ValueError, match="kv_scales"):
        vllm.concat_and_cache_mla_grouped(kv_c, k_pe, ptrs, sm, bs, caches[0].stride(0), caches[0].stride(1),
                                          None, "fp8", caches=caches, backend="torch")
