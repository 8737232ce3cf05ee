"""int8 / fp8 caches with static and dynamic (per-token, per-token-head) scales; dequant_kv."""
from __future__ import annotations

import zlib
import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite import facts as q

QDTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
IMPLEMENTED = ["torch", *BACKENDS]  # the reference and every kernel backend on DEVICE


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
    k = (torch.randn(n, h, d, generator=gen) * 3).bfloat16().to(DEVICE)
    k[2] = 0  # an all-zero token: the 1e-6 floor
    v = (torch.randn(n, h, d, generator=gen) * 3).bfloat16().to(DEVICE)
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
    k = torch.tensor([[[1000.0, -1000.0, 0.25, 0.75] * 4] * h], device=DEVICE)
    kc = torch.zeros(1, 1, h, d, dtype=torch.int8, device=DEVICE)
    s = torch.tensor([0.5, 2.0], device=DEVICE)
    loc0 = torch.tensor([0], device=DEVICE)
    kvwrite.store_kv(k, k, kc, kc.clone(), loc0, k_scale=s, v_scale=s, backend=backend)
    assert kc[0, 0, 0, :4].tolist() == [127, -128, 0, 2]  # 0.5 -> 0, 1.5 -> 2 (ties to even)
    assert kc[0, 0, 1, :4].tolist() == [127, -128, 0, 0]  # 0.125 -> 0, 0.375 -> 0
    assert torch.equal(kvwrite.dequant_kv(kc, loc0, scale=s)[0], kc[0, 0].float() * s[:, None])


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_dynamic_bad_locs(backend, mode):
    h, d, pps, num_pages = 1, 16, 4, 2
    k = torch.randn(5, h, d, device=DEVICE)
    loc = torch.tensor([0, 9, -1, 3, 8], device=DEVICE)
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
    kvwrite.store_kv(k, k, good["k_cache"], good["v_cache"], torch.tensor([0, -1, -1, 3, -1], device=DEVICE),
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


# ---- every kernel backend against the reference, byte for byte -------------------------------

def special_rows(n, h, d, gen, dtype=torch.bfloat16):
    """Random rows with the special values of the policy mixed in: +-inf, NaN, a subnormal, -0,
    an all-zero token, a huge value (saturation against another head's scale)."""
    x = torch.randn(n, h, d, generator=gen) * 3
    x[0, 0, 1], x[0, -1, 2] = float("inf"), float("-inf")
    x[1, 0, 0] = float("nan")
    x[1, -1, 3] = 1e-39 if dtype == torch.float32 else 0.0
    x[2] = 0.0
    x[2, 0, 0] = -0.0
    x[3, 0, :] *= 1e4
    return x.to(dtype).to(DEVICE)


def quant_pool(num_pages, pps, h, dk, dv, dtype, scales, layout="NHD", seed=0):
    def shape(d):
        return (num_pages, pps, h, d) if layout == "NHD" else (num_pages, h, pps, d)
    specs = {"k_cache": (shape(dk), dtype), "v_cache": (shape(dv), dtype)}
    if scales in ("token", "head"):
        sshape = (num_pages, pps) if scales == "token" else (num_pages, pps, h)
        specs.update(k_scale_cache=(sshape, torch.float32), v_scale_cache=(sshape, torch.float32))
    return CanaryBuffer(specs, seed)


def run_both(backend, p, k, v, loc, scales, rule="rne", layout="NHD", **kw):
    """Store with `backend` into p and with the reference into a twin; bytes must be equal."""
    original = p.raw.clone()
    twin = p.clone()
    for pool, be in ((p, backend), (twin, "torch")):
        extra = {}
        if scales == "static":
            extra = dict(k_scale=torch.tensor([0.05, 0.11, 0.5], device=DEVICE)[:k.shape[1]],
                         v_scale=torch.tensor(0.07, device=DEVICE))
        else:
            extra = dict(k_scale_cache=pool["k_scale_cache"], v_scale_cache=pool["v_scale_cache"],
                         quant_rule=rule)
        kvwrite.store_kv(k, v, pool["k_cache"], pool["v_cache"], loc, layout=layout, backend=be,
                         **extra, **kw)
    assert_same_bytes(p, twin, original)


CASES = [(dt, sc, rule) for dt in QDTYPES for sc in ("token", "head", "static")
         for rule in ("rne", "vllm") if not (sc == "static" and (rule == "vllm" or dt != torch.int8))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,scales,rule", CASES)
def test_kernels_match_reference(backend, dtype, scales, rule):
    gen = torch.Generator().manual_seed(zlib.crc32(repr((str(dtype), scales, rule)).encode()) % 1000)
    h, dk, dv, pps, num_pages, n = 3, 12, 8, 4, 5, 9
    layout = "HND" if rule == "vllm" else "NHD"
    in_dtype = torch.float32 if scales == "head" else torch.bfloat16
    k, v = special_rows(n, h, dk, gen, in_dtype), special_rows(n, h, dv, gen, in_dtype)
    loc = paged_locs(n, num_pages * pps, pps, gen, 0.2)
    p = quant_pool(num_pages, pps, h, dk, dv, dtype, scales, layout, seed=3)
    run_both(backend, p, k, v, loc, scales, rule, layout)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("variant", ["loc_map", "dcp", "pagetable", "int32", "strided"])
def test_kernels_loc_variants(backend, variant):
    gen = torch.Generator().manual_seed(11)
    h, d, pps, num_pages, n = 2, 16, 4, 4, 8
    dtype, scales = (torch.int8, "head") if variant in ("loc_map", "pagetable") else (torch.float8_e4m3fn, "token")
    k, v = special_rows(n, h, d, gen), special_rows(n, h, d, gen)
    p = quant_pool(num_pages, pps, h, d, d, dtype, scales, seed=5)
    kw = {}
    loc = paged_locs(n, num_pages * pps, pps, gen, 0.25)
    if variant == "loc_map":
        loc = torch.tensor([0, 3, -1, 5, 7, 2, 6, 1], device=DEVICE)
        kw["loc_map"] = torch.tensor([4, -1, 9, 0, 15, 3, 12, 8], dtype=torch.int32, device=DEVICE)
    elif variant == "dcp":
        loc = torch.tensor([0, 1, 5, -1, 8, 13, 30, 31], device=DEVICE)
        kw.update(dcp_rank=1, dcp_size=2)
    elif variant == "pagetable":
        loc = kvwrite.PageTable(torch.tensor([0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.int32, device=DEVICE),
                                torch.tensor([0, 1, 0, 5, 3, 6, 2, 4], dtype=torch.int32, device=DEVICE),
                                torch.tensor([2, 0, 3, 1], dtype=torch.int32, device=DEVICE),
                                torch.tensor([0, 2, 4], dtype=torch.int32, device=DEVICE))
    elif variant == "int32":
        loc = loc.to(torch.int32)
    elif variant == "strided":
        k = special_rows(n, 2 * h, d, gen)[:, ::2]   # head stride 2 * d
    run_both(backend, p, k, v, loc, scales, **kw)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["off", "assert", "guard"])
def test_kernels_check_modes(backend, mode):
    """Bad locs (past the pool, < -1) in every mode: never written; guard records what the
    reference records; assert raises before any write; off skips negative locs (a loc past the
    pool is the caller's bug in off mode: not checked on the GPU backends)."""
    gen = torch.Generator().manual_seed(2)
    h, d, pps, num_pages = 2, 8, 4, 2
    k, v = special_rows(6, h, d, gen), special_rows(6, h, d, gen)
    loc = torch.tensor([1, 8, -1, 5, -3, 100], device=DEVICE)
    if mode == "off":
        loc = torch.tensor([1, -7, -1, 5, -3, 2], device=DEVICE)
    results = {}
    for be in (backend, "torch"):
        p = quant_pool(num_pages, pps, h, d, d, torch.int8, "token", seed=1)
        original = p.raw.clone()
        errs = kvwrite.ErrorBuffer(DEVICE)
        kw = dict(k_scale_cache=p["k_scale_cache"], v_scale_cache=p["v_scale_cache"], check=mode,
                  errors=errs, backend=be)
        if mode == "assert":
            with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1"):
                kvwrite.store_kv(k, v, p["k_cache"], p["v_cache"], loc, **kw)
            assert torch.equal(p.raw, original)
            continue
        kvwrite.store_kv(k, v, p["k_cache"], p["v_cache"], loc, **kw)
        results[be] = (p, original, errs.error() if mode == "guard" else None)
    if mode == "assert":
        return
    (p, original, err), (twin, _, ref_err) = results[backend], results["torch"]
    assert_same_bytes(p, twin, original)
    if mode == "guard":
        assert (err.token_index, err.loc, err.count) == (ref_err.token_index, ref_err.loc, ref_err.count) == (1, 8, 3)


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_duplicate_rows_keep_codes_and_scale_together(backend):
    """Two tokens to one row: the row holds one token's codes with that same token's scale."""
    gen = torch.Generator().manual_seed(4)
    h, d = 2, 8
    k, v = special_rows(4, h, d, gen), special_rows(4, h, d, gen)
    k[1] *= 100   # very different scales for the two writers of row 3
    loc = torch.tensor([3, 3, 0, -1], device=DEVICE)
    p = quant_pool(1, 4, h, d, d, torch.int8, "head", seed=2)
    kvwrite.store_kv(k, v, p["k_cache"], p["v_cache"], loc, k_scale_cache=p["k_scale_cache"],
                     v_scale_cache=p["v_scale_cache"], backend=backend)
    from kvwrite.reference.kv_quant import dynamic_scale, quantize
    pairs = []
    for i in (0, 1):
        s = dynamic_scale(k[i:i + 1], torch.int8, True)
        pairs.append((quantize(k[i:i + 1], s[..., None], torch.int8)[0], s[0]))
    got = (p["k_cache"][0, 3], p["k_scale_cache"][0, 3])
    assert any(torch.equal(got[0], c) and torch.equal(got[1], s) for c, s in pairs)


def vllm_formula(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-token-head store restated step by step in numpy float32 (one op, one rounding):
    scale = max(absmax / QMAX, 1e-6); y = x * (1 / scale); int8: trunc(clamp(y +- 0.5))."""
    import numpy as np

    a = x.float().cpu().numpy()
    qmax = np.float32(q.QMAX[dtype])
    amax = np.abs(a).max(axis=-1)
    scale = np.maximum(amax / qmax, np.float32(1e-6)).astype(np.float32)
    recip = (np.float32(1.0) / scale).astype(np.float32)
    y = (a * recip[..., None]).astype(np.float32)
    if dtype == torch.int8:
        t = np.where(y >= 0, y + np.float32(0.5), y - np.float32(0.5)).astype(np.float32)
        codes = torch.from_numpy(np.trunc(np.clip(t, -128, 127))).to(torch.int8)
    else:
        codes = torch.from_numpy(np.clip(y, -qmax, qmax)).to(dtype)
    return codes, torch.from_numpy(scale)


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
def test_vllm_rule_is_vllms_formula(backend, dtype):
    """quant_rule="vllm" equals vLLM's formula on finite inputs, incl. the values where it
    differs from kvwrite's RNE division: ties (0.5 -> 1, 2.5 -> 3, -0.5 -> -1) and the fp32
    sum 0.49999997 + 0.5 = 1.0 (-> 1, where RNE gives 0)."""
    gen = torch.Generator().manual_seed(9)
    h, d, n = 2, 16, 6
    x = torch.randn(n, h, d, generator=gen) * 2
    x[0, 0, :6] = torch.tensor([127.0, 0.5, 2.5, -0.5, 0.49999997, -2.5])   # scale 1: y = x
    x[0, 0, 6:] = 0.25
    x = x.to(DEVICE)
    p = quant_pool(2, 4, h, d, d, dtype, "head", seed=7)
    loc = torch.arange(n, device=DEVICE)
    kvwrite.store_kv(x, x, p["k_cache"], p["v_cache"], loc, k_scale_cache=p["k_scale_cache"],
                     v_scale_cache=p["v_scale_cache"], backend=backend, quant_rule="vllm")
    codes, scale = vllm_formula(x, dtype)
    got = p["k_cache"].flatten(0, 1)[:n].cpu()
    assert torch.equal(got.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(p["k_scale_cache"].flatten(0, 1)[:n].cpu(), scale)
    if dtype == torch.int8:
        assert got[0, 0, :6].tolist() == [127, 1, 3, -1, 1, -3]


def test_quant_rule_refused_outside_dynamic_modes():
    k = torch.randn(2, 2, 16, device=DEVICE)
    loc = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="quant_rule='vllm' applies only to dynamic scales"):
        kvwrite.store_kv(k, k, torch.zeros(1, 4, 2, 16, device=DEVICE), torch.zeros(1, 4, 2, 16, device=DEVICE),
                         loc, quant_rule="vllm")
    with pytest.raises(ValueError, match="quant_rule must be one of"):
        kc = torch.zeros(1, 4, 2, 16, dtype=torch.int8, device=DEVICE)
        kvwrite.store_kv(k, k, kc, kc.clone(), loc, k_scale_cache=torch.zeros(1, 4, device=DEVICE),
                         v_scale_cache=torch.zeros(1, 4, device=DEVICE), quant_rule="rtz")


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("mode", ["INT8_PER_TOKEN_HEAD", "FP8_PER_TOKEN_HEAD"])
def test_vllm_per_token_head_adapter(backend, mode):
    """vLLM's call and argument order: a uint8 cache for fp8 (viewed as e4m3fn), the enum's int
    value, slot_mapping shorter than key (padding rows), -1 skipped; bytes = vLLM's formula."""
    from kvwrite.compat.vllm import triton_reshape_and_cache_flash_per_token_head_quant as store

    gen = torch.Generator().manual_seed(3)
    h, d, blocks, bs = 2, 16, 2, 4
    key, value = (torch.randn(7, h, d, generator=gen).half().to(DEVICE) for _ in range(2))
    slots = torch.tensor([3, -1, 0, 7, 5, 2], device=DEVICE)
    dtype = torch.int8 if mode.startswith("INT8") else torch.uint8
    kc, vc = (torch.zeros(blocks, bs, h, d, dtype=dtype, device=DEVICE) for _ in range(2))
    ks, vs = (torch.full((blocks, bs, h), -1.0, device=DEVICE) for _ in range(2))
    store(key, value, kc, vc, ks, vs, slots, 2 if mode.startswith("INT8") else 3, backend=backend)
    fmt = torch.int8 if mode.startswith("INT8") else torch.float8_e4m3fn
    for x, cache, sc in ((key, kc, ks), (value, vc, vs)):
        codes, scale = vllm_formula(x[:6], fmt)
        for i, slot in enumerate(slots.tolist()):
            if slot < 0:
                continue
            assert torch.equal(cache[slot // bs, slot % bs].cpu().view(torch.uint8), codes[i].view(torch.uint8))
            assert torch.equal(sc[slot // bs, slot % bs].cpu(), scale[i])
    assert bool((ks[0, 1] == -1).all())   # slot 1 was never written


def test_vllm_per_token_head_mode_is_checked():
    """An unknown kv_quant_mode is refused by name (INT4_PER_TOKEN_HEAD is stored: test_int4.py)."""
    from kvwrite.compat.vllm import triton_reshape_and_cache_flash_per_token_head_quant as store

    k = torch.randn(1, 1, 16, device=DEVICE)
    kc = torch.zeros(1, 4, 1, 8, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(ValueError, match="kv_quant_mode must be"):
        store(k, k, kc, kc.clone(), torch.zeros(1, 4, 1, device=DEVICE), torch.zeros(1, 4, 1, device=DEVICE),
              torch.tensor([0], device=DEVICE), 1)
