"""int8 / fp8 caches with static and dynamic (per-token, per-token-head) scales; dequant_kv."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite.ops import kv_quant as q

QDTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
IMPLEMENTED = ["torch"]  # the backends of kvwrite.ops.kv_quant.IMPLS available so far


def pool(num_pages, pps, h, d, dtype, scales, seed=0):
    specs = {"k_cache": ((num_pages, pps, h, d), dtype), "v_cache": ((num_pages, pps, h, d), dtype)}
    if scales is not None:
        shape = (num_pages, pps) if scales == "token" else (num_pages, pps, h)
        specs.update(k_scale_cache=(shape, torch.float32), v_scale_cache=(shape, torch.float32))
    return CanaryBuffer(specs, seed)


def naive(k, loc, dtype, per_head, pps):
    """Token-by-token oracle in Python floats of the documented formula."""
    qmax = q.QMAX[dtype]
    out = {}
    for i, l in enumerate(loc.tolist()):
        if l < 0:
            continue
        x = k[i].float()
        amax = x.abs().amax(-1) if per_head else x.abs().amax().expand(x.shape[0])
        s = torch.maximum(amax / qmax, torch.tensor(1e-6))
        y = x / s[:, None]
        if dtype == torch.int8:
            c = y.clamp(-128, 127).round().to(torch.int8)
        else:
            c = y.clamp(-qmax, qmax).to(dtype)
        out[l] = (c, s if per_head else s[:1])
    return out


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("dtype", QDTYPES)
@pytest.mark.parametrize("scales", ["token", "head"])
def test_dynamic_matches_formula(backend, dtype, scales):
    h, d, pps, num_pages, n = 3, 32, 4, 4, 11
    gen = torch.Generator().manual_seed(5)
    k = (torch.randn(n, h, d, generator=gen) * 3).bfloat16()
    k[2] = 0  # an all-zero token: the 1e-6 floor
    v = (torch.randn(n, h, d, generator=gen) * 3).bfloat16()
    loc = paged_locs(n, num_pages * pps, pps, gen, 0.2)
    p = pool(num_pages, pps, h, d, dtype, scales)
    original = p.raw.clone()
    kvwrite.store_kv(k, v, p["k_cache"], p["v_cache"], loc, k_scale_cache=p["k_scale_cache"],
                     v_scale_cache=p["v_scale_cache"], backend=backend)
    twin = p.clone()
    twin.raw.copy_(original)
    expect = naive(k, loc, dtype, scales == "head", pps)
    kc, ks = twin["k_cache"], twin["k_scale_cache"]
    for l, (c, s) in expect.items():
        kc[l // pps, l % pps] = c
        ks[l // pps, l % pps] = s if scales == "head" else s[0]
    vexp = naive(v, loc, dtype, scales == "head", pps)
    for l, (c, s) in vexp.items():
        twin["v_cache"][l // pps, l % pps] = c
        twin["v_scale_cache"][l // pps, l % pps] = s if scales == "head" else s[0]
    assert_same_bytes(p, twin, original)
    # dequant: within half a step of the input
    live = loc[loc >= 0]
    back = kvwrite.dequant_kv(p["k_cache"], live, scale_cache=p["k_scale_cache"])
    step = kvwrite.dequant_kv(torch.ones_like(p["k_cache"], dtype=torch.float32), live,
                              scale_cache=p["k_scale_cache"]) if dtype == torch.int8 else None
    if step is not None:
        assert bool(((back - k[loc >= 0].float()).abs() <= step * 0.5 + 1e-7).all())


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_static_int8(backend):
    h, d = 2, 16
    k = torch.tensor([[[1000.0, -1000.0, 0.25, 0.75] * 4] * h])
    kc = torch.zeros(1, 1, h, d, dtype=torch.int8)
    s = torch.tensor([0.5, 2.0])
    kvwrite.store_kv(k, k, kc, kc.clone(), torch.tensor([0]), k_scale=s, v_scale=s, backend=backend)
    assert kc[0, 0, 0, :4].tolist() == [127, -128, 0, 2]  # 0.5 -> 0, 1.5 -> 2 (ties to even)
    assert kc[0, 0, 1, :4].tolist() == [127, -128, 0, 0]  # 0.125 -> 0, 0.375 -> 0
    assert torch.equal(kvwrite.dequant_kv(kc, torch.tensor([0]), scale=s)[0], kc[0, 0].float() * s[:, None])


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_dynamic_bad_locs(backend, mode):
    h, d, pps, num_pages = 1, 16, 4, 2
    k = torch.randn(5, h, d)
    loc = torch.tensor([0, 9, -1, 3, 8])
    p = pool(num_pages, pps, h, d, torch.int8, "token")
    original = p.raw.clone()
    kw = dict(k_scale_cache=p["k_scale_cache"], v_scale_cache=p["v_scale_cache"], backend=backend)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1"):
            kvwrite.store_kv(k, k, p["k_cache"], p["v_cache"], loc, check="assert", **kw)
        assert torch.equal(p.raw[p.canary_mask()], original[p.canary_mask()])
        return
    errs = kvwrite.ErrorBuffer()
    kvwrite.store_kv(k, k, p["k_cache"], p["v_cache"], loc, check="guard", errors=errs, **kw)
    err = errs.error()
    assert (err.token_index, err.loc, err.count) == (1, 9, 2)
    good = pool(num_pages, pps, h, d, torch.int8, "token")
    kvwrite.store_kv(k, k, good["k_cache"], good["v_cache"], torch.tensor([0, -1, -1, 3, -1]),
                     k_scale_cache=good["k_scale_cache"], v_scale_cache=good["v_scale_cache"], backend="torch")
    assert_same_bytes(p, good, original)


def test_bad_arguments_name_the_argument():
    k = torch.randn(2, 2, 16)
    kc = torch.zeros(1, 4, 2, 16, dtype=torch.int8)
    loc = torch.tensor([0, 1])
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        kvwrite.store_kv(k, k, kc, kc.clone(), loc)
    with pytest.raises(ValueError, match="k_scale_cache"):
        kvwrite.store_kv(k, k, kc, kc.clone(), loc, k_scale_cache=torch.zeros(1, 3),
                         v_scale_cache=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="go together"):
        kvwrite.store_kv(k, k, kc, kc.clone(), loc, k_scale_cache=torch.zeros(1, 4))
    with pytest.raises(TypeError, match="int8 or fp8"):
        kvwrite.store_kv(k, k, torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 2, 16), loc,
                         k_scale_cache=torch.zeros(1, 4), v_scale_cache=torch.zeros(1, 4))


def test_vllm_per_token_quant_adapter_matches_store_kv():
    from kvwrite.compat.vllm import reshape_and_cache_flash_per_token_quant

    gen = torch.Generator().manual_seed(2)
    k, v = torch.randn(6, 2, 16, generator=gen).half(), torch.randn(6, 2, 16, generator=gen).half()
    slots = torch.tensor([3, -1, 0, 7, 5, 2])
    a, b = pool(2, 4, 2, 16, torch.int8, "head"), pool(2, 4, 2, 16, torch.int8, "head")
    reshape_and_cache_flash_per_token_quant(k, v, a["k_cache"], a["v_cache"], a["k_scale_cache"],
                                            a["v_scale_cache"], slots)
    kvwrite.store_kv(k, v, b["k_cache"], b["v_cache"], slots, k_scale_cache=b["k_scale_cache"],
                     v_scale_cache=b["v_scale_cache"], backend="torch")
    assert torch.equal(a.raw, b.raw)


@pytest.mark.parametrize("kv", ["int8", "int8_per_token", "fp8_per_token", "int8_per_token_head",
                                "fp8_per_token_head"])
def test_configurator_sizes_scale_buffers_and_stores(kv):
    spec = kvwrite.ModelSpec.from_preset("llama-3.1-8b")
    cfg = kvwrite.KVCacheConfigurator(spec, kvwrite.ParallelSpec(), page_size=16, memory_bytes=64 << 20,
                                      kv_cache_dtype=kv)
    sp = cfg.plan().pools[0]
    shapes = {b.name: tuple(b.shape) for b in sp.buffers}
    pages = sp.geometry.num_pages
    per_head = kv.endswith("_head")
    if kv == "int8":
        assert set(shapes) == {"k", "v"}
    else:
        assert shapes["k_scale_cache"] == ((pages, 16, 8) if per_head else (pages, 16))
    # bytes per token over 32 layers: codes (+ fp32 scales) fit the budget
    cell = 32 * 2 * (8 * 128 + (4 * (8 if per_head else 1) if kv != "int8" else 0))
    assert (pages - 1) * 16 <= (64 << 20) // cell and pages * 16 * cell <= (64 << 20) + 16 * cell
    scales = {"k_scale": torch.tensor(0.05), "v_scale": torch.tensor(0.05)} if kv == "int8" else None
    pool = cfg.build("cpu", scales=scales)
    gen = torch.Generator().manual_seed(0)
    k, v = torch.randn(3, 8, 128, generator=gen).bfloat16(), torch.randn(3, 8, 128, generator=gen).bfloat16()
    loc = torch.tensor([0, 5, 17])
    pool.store(0, loc, k, v)
    b = pool.layer(sp.name, 0)
    twin = {n: torch.zeros_like(t) for n, t in b.items()}
    extra = ({"k_scale": scales["k_scale"], "v_scale": scales["v_scale"]} if scales else
             {"k_scale_cache": twin["k_scale_cache"], "v_scale_cache": twin["v_scale_cache"]})
    kvwrite.store_kv(k, v, twin["k"], twin["v"], loc, backend="torch", **extra)
    for n in b:
        assert torch.equal(b[n].view(torch.uint8), twin[n].view(torch.uint8)), n
