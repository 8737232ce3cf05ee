"""store_kv layout "cpu_attn" (vLLM's CPU attention cache: key tile column-major, value tile
row-major per (block, head)) and `kvwrite.compat.vllm.cpu_attn_reshape_and_cache`, on every
backend against a per-element restatement of vLLM's `reshape_and_cache` (csrc/cpu/cpu_attn_vec.hpp),
with canaries around the packed `[blocks, H, 2 * bs, D]` buffer."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.compat import vllm

ALL = ["torch", *BACKENDS]
NB, H, BS, D = 4, 2, 8, 16


def restated(key, value, kv, slot_mapping, fp8=None, k_scale=1.0, v_scale=1.0):
    """vLLM's VEC reshape_and_cache per element on the packed `[NB, H, 2 * BS, D]` buffer: key
    (t, d) at tile offset d * BS + t of the first half, value (t, d) at t * D + d of the second."""
    flat = kv.view(NB, H, 2 * BS * D)
    for i, s in enumerate(slot_mapping.tolist()):
        if s < 0:
            continue
        b, t = divmod(s, BS)
        for h in range(H):
            for d in range(D):
                kx, vx = key[i, h, d], value[i, h, d]
                if fp8 is not None:   # kvwrite's fp8: saturate(x / scale), RNE
                    kx = (kx.float() / k_scale).clamp(-448, 448).to(fp8).view(torch.uint8)
                    vx = (vx.float() / v_scale).clamp(-448, 448).to(fp8).view(torch.uint8)
                flat[b, h, d * BS + t] = kx
                flat[b, h, BS * D + t * D + d] = vx


def packed(dtype, seed):
    return CanaryBuffer({"kv": ((NB, H, 2 * BS, D), dtype)}, seed=seed)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_store_kv_cpu_attn_layout(backend, dtype):
    gen = torch.Generator().manual_seed(7)
    n = 7
    key = (torch.randn(n + 2, H, D, generator=gen) * 3).to(dtype).to(DEVICE)
    value = (torch.randn(n + 2, H, D, generator=gen) * 3).to(dtype).to(DEVICE)
    sm = torch.randperm(NB * BS, generator=gen)[:n].to(DEVICE)
    sm[3] = -1
    buf = packed(dtype, 3)
    original, ref = buf.raw.clone(), buf.clone()
    kc, vc = buf["kv"].chunk(2, dim=2)
    kvwrite.store_kv(key[:n], value[:n], kc, vc, sm, layout="cpu_attn", backend=backend)
    restated(key, value, ref["kv"], sm)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_cpu_attn_reshape_and_cache_matches_vllm(backend, kv_cache_dtype):
    gen = torch.Generator().manual_seed(11)
    n = 6
    key = (torch.randn(n + 1, H, D, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    value = (torch.randn(n + 1, H, D, generator=gen) * 4).to(torch.bfloat16).to(DEVICE)
    sm = torch.randperm(NB * BS, generator=gen)[:n].to(DEVICE)
    sm[0] = -1
    fp8 = kv_cache_dtype != "auto"
    buf = packed(torch.uint8 if fp8 else torch.bfloat16, 5)
    original, ref = buf.raw.clone(), buf.clone()
    kc, vc = buf["kv"].chunk(2, dim=2)
    vllm.cpu_attn_reshape_and_cache(key, value, kc, vc, sm, "vec", 0.5 if fp8 else 1.0,
                                    0.25 if fp8 else 1.0, kv_cache_dtype, backend=backend)
    restated(key, value, ref["kv"], sm, torch.float8_e4m3fn if fp8 else None, 0.5, 0.25)
    assert_same_bytes(buf, ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_cpu_attn_bad_slot_in_guard_mode(backend):
    key = torch.ones(3, H, D, dtype=torch.bfloat16, device=DEVICE)
    buf = packed(torch.bfloat16, 6)
    original = buf.raw.clone()
    kc, vc = buf["kv"].chunk(2, dim=2)
    errors = kvwrite.ErrorBuffer(DEVICE)
    sm = torch.tensor([1, NB * BS + 5, 2], device=DEVICE)
    vllm.cpu_attn_reshape_and_cache(key, key, kc, vc, sm, "vec", check="guard", errors=errors,
                                    backend=backend)
    err = errors.error()
    assert err.token_index == 1 and err.loc == NB * BS + 5 and err.count == 1
    assert not bool(((buf.raw != original) & buf.canary_mask()).any())


def test_cpu_attn_refusals():
    key = torch.ones(2, H, D, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(NB, H, 2 * BS, D, dtype=torch.bfloat16, device=DEVICE)
    kc, vc = kv.chunk(2, dim=2)
    sm = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(NotImplementedError, match="isa='amx'"):
        vllm.cpu_attn_reshape_and_cache(key, key, kc, vc, sm, "amx")
    with pytest.raises(ValueError, match="isa must be one of"):
        vllm.cpu_attn_reshape_and_cache(key, key, kc, vc, sm, "avx")
    nhd = torch.zeros(NB, BS, H, D, dtype=torch.bfloat16, device=DEVICE).transpose(1, 2)
    with pytest.raises(ValueError, match="layout 'cpu_attn'"):
        kvwrite.store_kv(key, key, nhd, nhd, sm, layout="cpu_attn")


def test_cpu_attn_fast_path_errors_name_the_call():
    """The adapter's one-predicate path (C++ matcher) refuses as the named checks do: vLLM's call
    and argument named; int8 caches in this layout refused before any byte moves."""
    key = torch.ones(2, H, D, dtype=torch.bfloat16, device=DEVICE)
    kv = torch.zeros(NB, H, 2 * BS, D, dtype=torch.bfloat16, device=DEVICE)
    kc, vc = kv.chunk(2, dim=2)
    sm = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match=r"cpu_attn_reshape_and_cache: value_cache must have shape"):
        vllm.cpu_attn_reshape_and_cache(key, key, kc, vc[:, :1], sm, "vec")
    k8, v8 = torch.zeros(2, NB, H, BS, D, dtype=torch.int8, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    with pytest.raises(ValueError, match="layout 'cpu_attn' stores plain and fp8 caches only"):
        kvwrite.store_kv(key, key, k8, v8, sm, layout="cpu_attn", k_scale=one, v_scale=one)
    assert not kv.any() and not k8.any()
