"""rope_store_kv / rope_store_mla: the fused op against "rope (independent numpy fp32 oracle),
then store_kv / store_mla", bit for bit, canaries around every buffer; bad positions and locs."""
from __future__ import annotations

import zlib
import numpy as np
import pytest
import torch

import kvwrite
from conftest import KERNEL_BACKENDS
from helpers import CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite.ops.mla import ds_mla_row_bytes

IMPLEMENTED = ["torch", *KERNEL_BACKENDS]  # every backend vs the numpy oracle + the reference store
f32 = np.float32


def np_rope(x, pos, cos_sin, rotary_dim, neox, w=None, eps=1e-6):
    """Per token-head numpy float32 oracle of the documented arithmetic (kvwrite.reference.rope)."""
    x = x.float().numpy().astype(f32)
    cs = cos_sin.float().numpy().astype(f32)
    out = x.copy()
    half = rotary_dim // 2
    for i in range(x.shape[0]):
        for h in range(x.shape[1]):
            y = x[i, h].copy()
            if w is not None:
                p = 1
                while p < len(y):
                    p *= 2
                s = np.zeros(p, f32)
                s[:len(y)] = y * y
                while len(s) > 1:
                    s = (s[0::2] + s[1::2]).astype(f32)
                inv = f32(1.0) / np.sqrt(f32(s[0] / f32(len(y))) + f32(eps))
                y = ((y * inv).astype(f32) * w.float().numpy()).astype(f32)
            z = y.copy()
            c, sn = cs[int(pos[i]), :half], cs[int(pos[i]), half:]
            ia = np.arange(half) if neox else np.arange(0, rotary_dim, 2)
            ib = ia + half if neox else ia + 1
            z[ia] = (y[ia] * c).astype(f32) - (y[ib] * sn).astype(f32)
            z[ib] = (y[ib] * c).astype(f32) + (y[ia] * sn).astype(f32)
            out[i, h] = z
    return torch.from_numpy(out)


KV_CASES = [  # dtype, Hq, H, D, rotary_dim, neox, norm, cos dtype fp32?, cache
    (torch.bfloat16, 4, 2, 64, 64, True, True, True, "same"),
    (torch.float16, 2, 1, 80, 32, False, True, False, "same"),
    (torch.float32, 3, 3, 32, 16, True, False, True, "same"),
    (torch.bfloat16, 2, 2, 64, 32, True, True, True, "fp8_static"),
    (torch.bfloat16, 2, 2, 64, 64, False, False, True, "int8_static"),
    (torch.bfloat16, 4, 2, 64, 64, True, True, True, "int8_token"),
    (torch.float16, 2, 2, 32, 32, False, True, True, "e4m3_head"),
    (torch.bfloat16, 2, 2, 48, 16, True, True, True, "e5m2_token"),
    # bf16 without a norm: the cpu backend's AVX-512 RoPE lanes (rope_bf16_512), partial rotary
    (torch.bfloat16, 1, 1, 96, 64, False, False, False, "same"),
    (torch.bfloat16, 1, 2, 80, 32, True, False, True, "same"),
]


def cache_spec(kind, dtype):
    return {"same": (dtype, None), "fp8_static": (torch.float8_e4m3fn, None), "int8_static": (torch.int8, None),
            "int8_token": (torch.int8, "token"), "e4m3_head": (torch.float8_e4m3fn, "head"),
            "e5m2_token": (torch.float8_e5m2, "token")}[kind]


def kv_pool(num_pages, pps, h, d, cdtype, scales, n, hq, dtype, seed):
    specs = {"k_cache": ((num_pages, pps, h, d), cdtype), "v_cache": ((num_pages, pps, h, d), cdtype),
             "q": ((n, hq, d), dtype)}
    if scales:
        shape = (num_pages, pps) if scales == "token" else (num_pages, pps, h)
        specs.update(k_scale_cache=(shape, torch.float32), v_scale_cache=(shape, torch.float32))
    return CanaryBuffer(specs, seed)


def make_kv_inputs(c, seed, n=9, max_pos=50):
    dtype, hq, h, d, rd, neox, norm, cos32, kind = c
    gen = torch.Generator().manual_seed(seed)
    q = (torch.randn(n, hq, d, generator=gen) * 2).to(dtype)
    k = (torch.randn(n, h, d, generator=gen) * 2).to(dtype)
    v = (torch.randn(n, h, d, generator=gen) * 2).to(dtype)
    ang = torch.rand(max_pos, rd // 2, generator=gen) * 6
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    cs = cs if cos32 else cs.to(dtype)
    pos = torch.randint(0, max_pos, (n,), generator=gen)
    qw = (torch.rand(d, generator=gen) + 0.5).to(dtype) if norm else None
    kw = (torch.rand(d, generator=gen) + 0.5).to(dtype) if norm else None
    return q, k, v, cs, pos, qw, kw


def store_kwargs(p, kind, h):
    cdtype, scales = cache_spec(kind, None)
    kw = {}
    if scales:
        kw = dict(k_scale_cache=p["k_scale_cache"], v_scale_cache=p["v_scale_cache"])
    elif kind.endswith("static"):
        kw = dict(k_scale=torch.full((h,), 0.05), v_scale=torch.tensor(0.07))
    return kw


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("case", range(len(KV_CASES)))
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_store_kv_matches_unfused(backend, case, check):
    c = KV_CASES[case]
    dtype, hq, h, d, rd, neox, norm, cos32, kind = c
    run_kv_case(c, case, check, backend)


def run_kv_case(c, case, check, backend):
    dtype, hq, h, d, rd, neox, norm, cos32, kind = c
    n, pps, num_pages = 9, 4, 4
    q, k, v, cs, pos, qw, kw = make_kv_inputs(c, case)
    gen = torch.Generator().manual_seed(case + 100)
    loc = paged_locs(n, num_pages * pps, pps, gen, 0.25)
    cdtype, scales = cache_spec(kind, dtype)
    p = kv_pool(num_pages, pps, h, d, cdtype, scales, n, hq, dtype, case)
    p["q"].copy_(q)
    ref, original = p.clone(), p.raw.clone()
    errs = kvwrite.ErrorBuffer()
    kvwrite.rope_store_kv(pos, p["q"], k, v, cs, p["k_cache"], p["v_cache"], loc, is_neox=neox,
                          rotary_dim=rd, q_norm_weight=qw, k_norm_weight=kw, check=check,
                          errors=errs, backend=backend, **store_kwargs(p, kind, h))
    assert errs.error() is None
    # unfused: the numpy oracle's rope, rounded once to the dtype, then store_kv
    ref["q"].copy_(np_rope(q, pos, cs, rd, neox, qw).to(dtype))
    k_rot = np_rope(k, pos, cs, rd, neox, kw).to(dtype)
    kvwrite.store_kv(k_rot, v, ref["k_cache"], ref["v_cache"], loc, backend="torch",
                     **store_kwargs(ref, kind, h))
    assert_same_bytes(p, ref, original)


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("mode", ["off", "assert", "guard"])
def test_rope_store_kv_bad_positions_and_locs(backend, mode):
    c = (torch.bfloat16, 2, 2, 32, 32, True, True, True, "same")
    n, pps, num_pages, max_pos = 6, 4, 2, 50
    q, k, v, cs, pos, qw, kw = make_kv_inputs(c, 3, n, max_pos)
    pos[1], pos[4] = max_pos, -3             # bad positions
    loc = torch.tensor([0, 1, 2, 100, 5, -1])  # token 3: loc beyond the pool
    p = kv_pool(num_pages, pps, 2, 32, torch.bfloat16, None, n, 2, torch.bfloat16, 1)
    p["q"].copy_(q)
    original = p.raw.clone()
    errs = kvwrite.ErrorBuffer()
    args = (pos, p["q"], k, v, cs, p["k_cache"], p["v_cache"])
    kw_ = dict(q_norm_weight=qw, k_norm_weight=kw, backend=backend)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1 .*position 50") as info:
            kvwrite.rope_store_kv(*args, loc, check="assert", **kw_)
        assert info.value.kind == kvwrite.errors.KIND_POSITION and info.value.count == 3
        assert torch.equal(p.raw[p.canary_mask()], original[p.canary_mask()])
        return
    if mode == "off":
        loc = torch.tensor([0, 1, 2, 3, 5, -1])  # off mode: in-pool locs; bad positions still skipped
    kvwrite.rope_store_kv(*args, loc, check=mode, errors=errs, **kw_)
    # expected: tokens with bad positions neither written nor rotated; others as unfused
    good = torch.tensor([i not in (1, 4) for i in range(n)])
    ref = p.clone()
    ref.raw.copy_(original)
    qr = np_rope(q[good], pos[good], cs, 32, True, qw).to(torch.bfloat16)
    ref["q"][good] = qr
    keep = torch.where(good & (loc < num_pages * pps), loc, -1)
    k_rot = k.clone()
    k_rot[good] = np_rope(k[good], pos[good], cs, 32, True, kw).to(torch.bfloat16)
    kvwrite.store_kv(k_rot, v, ref["k_cache"], ref["v_cache"], keep, backend="torch")
    assert_same_bytes(p, ref, original)
    if mode == "guard":
        err = errs.error()
        assert (err.token_index, err.count, err.kind, err.target, err.limit) == (1, 3, kvwrite.errors.KIND_POSITION, 50, 50)
        assert "position 50" in str(err)
    else:
        assert errs.error() is None


MLA_FORMATS = ["auto", "fp8", "fp8_e5m2", "fp8_ds_mla", "nvfp4"]


def mla_inputs(gen, n, hq, L, R, max_pos, dtype):
    """rope_store_mla's inputs: kv_c [n, L], k_pe [n, R], q_pe [n, hq, R], a cos/sin cache, positions."""
    kv_c = (torch.randn(n, L, generator=gen) * 2).to(dtype)
    k_pe = (torch.randn(n, R, generator=gen) * 2).to(dtype)
    q_pe = (torch.randn(n, hq, R, generator=gen) * 2).to(dtype)
    ang = torch.rand(max_pos, R // 2, generator=gen) * 6
    return kv_c, k_pe, q_pe, torch.cat([ang.cos(), ang.sin()], -1), torch.randint(0, max_pos, (n,), generator=gen)


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("fmt", MLA_FORMATS)
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_store_mla_matches_unfused(backend, fmt, check):
    n, hq, L, R, pps, num_pages, max_pos = 7, 3, 128, 32, 4, 4, 40
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    kv_c, k_pe, q_pe, cs, pos = mla_inputs(gen, n, hq, L, R, max_pos, dtype)
    loc = paged_locs(n, num_pages * pps, pps, gen, 0.25)
    name = {"fp8": "fp8_e4m3"}.get(fmt, fmt)
    fm = kvwrite.ops.mla.FORMATS[name]
    width = fm.row_width(L, R)
    specs = {"kv_cache": ((num_pages, pps, width), fm.cache_dtype(dtype)), "q": ((n, hq, R), dtype)}
    if fm.takes_scale_cache:
        specs["scale_cache"] = ((num_pages, pps, (L + R) // 16), torch.float8_e4m3fn)
    p = CanaryBuffer(specs, 2)
    p["q"].copy_(q_pe)
    ref, original = p.clone(), p.raw.clone()
    extra = lambda b: ({"scale": torch.tensor(0.03)} if fm.takes_scale else {}) | (  # noqa: E731
        {"scale_cache": b["scale_cache"]} if fm.takes_scale_cache else {})
    errs = kvwrite.ErrorBuffer()
    kvwrite.rope_store_mla(pos, p["q"], kv_c, k_pe, cs, p["kv_cache"], loc, kv_cache_dtype=fmt,
                           check=check, errors=errs, backend=backend, **extra(p))
    assert errs.error() is None
    ref["q"].copy_(np_rope(q_pe, pos, cs, R, False).to(dtype))
    k_rot = np_rope(k_pe[:, None], pos, cs, R, False)[:, 0].to(dtype)
    kvwrite.store_mla(kv_c, k_rot, ref["kv_cache"], loc, kv_cache_dtype=name, backend="torch", **extra(ref))
    assert_same_bytes(p, ref, original)


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_rope_store_mla_bad_position_guard(backend):
    n, L, R = 3, 128, 16
    kv_c, k_pe = torch.randn(n, L), torch.randn(n, R)
    q_pe = torch.randn(n, 2, R)
    q0 = q_pe.clone()
    cs = torch.randn(10, R)
    cache = torch.zeros(2, 4, ds_mla_row_bytes(L, R), dtype=torch.uint8)
    errs = kvwrite.ErrorBuffer()
    kvwrite.rope_store_mla(torch.tensor([1, 10, 2]), q_pe, kv_c, k_pe, cs, cache, torch.tensor([0, 1, 2]),
                           kv_cache_dtype="fp8_ds_mla", check="guard", errors=errs, backend=backend)
    err = errs.error()
    assert (err.op, err.token_index, err.target, err.count) == ("rope_store_mla", 1, 10, 1)
    assert torch.equal(q_pe[1], q0[1]) and not torch.equal(q_pe[0], q0[0])
    assert bool((cache[0, 1] == 0).all()) and bool((cache[0, 0] != 0).any())


def test_bad_arguments_name_the_argument():
    q, k = torch.randn(2, 2, 32), torch.randn(2, 1, 32)
    kc = torch.zeros(1, 4, 1, 32)
    loc, pos = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="rotary_dim"):
        kvwrite.rope_store_kv(pos, q, k, k, torch.randn(4, 7), kc, kc.clone(), loc)
    with pytest.raises(ValueError, match="positions"):
        kvwrite.rope_store_kv(torch.tensor([0]), q, k, k, torch.randn(4, 16), kc, kc.clone(), loc)
    with pytest.raises(ValueError, match="q_norm_weight"):
        kvwrite.rope_store_kv(pos, q, k, k, torch.randn(4, 16), kc, kc.clone(), loc, q_norm_weight=torch.ones(5))
    with pytest.raises(ValueError, match="cos_sin_cache"):
        kvwrite.rope_store_kv(pos, q, k, k, torch.randn(4, 16), kc, kc.clone(), loc, rotary_dim=8)


# ---- every kernel backend against the reference: addressing variants, bad locs, errors --------

def _addressing(variant, n, num_pages, pps, gen, bad):
    """(loc kwargs for the store, capacity of the virtual loc space) of one addressing variant;
    `bad`: mix in out-of-range locs (guard / assert tests)."""
    cap = num_pages * pps
    if variant == "table":
        nb = 2
        kv_indices = torch.randperm(num_pages, generator=gen)[:4].to(torch.int32)
        if bad:
            kv_indices[1] = num_pages + 3
        kv_indptr = torch.tensor([0, 2, 4], dtype=torch.int32)
        batch = torch.randint(0, nb, (n,), generator=gen).to(torch.int32)
        tpos = torch.randint(0, 2 * pps, (n,), generator=gen).to(torch.int32)
        return dict(loc=kvwrite.PageTable(batch, tpos, kv_indices, kv_indptr))
    if variant == "loc_map":
        m = torch.randperm(cap, generator=gen)[: cap - 2]
        m = torch.cat([m, torch.tensor([-1, cap + 5 if bad else 0])])
        loc = torch.randint(-1, m.shape[0] + (3 if bad else 0), (n,), generator=gen)
        return dict(loc=loc, loc_map=m)
    if variant == "dcp":
        loc = torch.randperm(2 * cap, generator=gen)[:n]
        if bad:
            loc[2] = 2 * cap + 1
        return dict(loc=loc, dcp_rank=1, dcp_size=2)
    loc = paged_locs(n, cap, pps, gen, 0.25)
    if bad:
        loc[1] = cap + 7
    return dict(loc=loc)


KV_VARIANTS = ["plain", "loc_map", "dcp", "table", "hnd", "qkv_view", "fp8_head_scale",
               "int8_static", "int8_token", "e4m3_head", "e5m2_token_hnd"]
QUANT_VARIANTS = {  # variant -> (cache dtype, scale caches: None / "token" / "head", static scales)
    "fp8_head_scale": (torch.float8_e4m3fn, None, True), "int8_static": (torch.int8, None, True),
    "int8_token": (torch.int8, "token", False), "e4m3_head": (torch.float8_e4m3fn, "head", False),
    "e5m2_token_hnd": (torch.float8_e5m2, "token", False)}


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("variant", KV_VARIANTS)
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_store_kv_kernels_match_reference(backend, variant, check):
    n, hq, h, d, pps, num_pages, max_pos = 7, 2, 2, 48, 4, 3, 30
    gen = torch.Generator().manual_seed(zlib.crc32(variant.encode()) % 1000)  # stable across processes
    dtype = torch.float16 if variant == "dcp" else torch.bfloat16
    cdt, scales, static = QUANT_VARIANTS.get(variant, (None, None, False))
    if variant == "qkv_view":  # q, k, v: column views of one fused qkv buffer
        qkv = (torch.randn(n, (hq + 2 * h) * d, generator=gen) * 3).to(dtype)
        q0 = qkv[:, :hq * d].view(n, hq, d)
        k = qkv[:, hq * d:(hq + h) * d].view(n, h, d)
        v = qkv[:, (hq + h) * d:].view(n, h, d)
    else:
        q0 = (torch.randn(n, hq, d, generator=gen) * 3).to(dtype)
        k = (torch.randn(n, h, d, generator=gen) * 3).to(dtype)
        v = (torch.randn(n, h, 32, generator=gen) * 3).to(dtype)
    rd = 32 if variant in ("loc_map", "table") else d
    ang = torch.rand(max_pos, rd // 2, generator=gen) * 6
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    if variant == "dcp":
        cs = cs.to(dtype)
    pos = torch.randint(0, max_pos, (n,), generator=gen)
    if check == "guard":
        pos[3] = max_pos + 2
    qw = torch.rand(d, generator=gen) + 0.5
    kw = (torch.rand(d, generator=gen) + 0.5).to(dtype)
    layout = "HND" if variant.endswith("hnd") else "NHD"
    cdt = cdt or dtype
    shp = (num_pages, pps, h) if layout == "NHD" else (num_pages, h, pps)
    specs = {"k_cache": ((*shp, d), cdt), "v_cache": ((*shp, v.shape[2]), cdt), "q": ((n, hq, d), dtype)}
    if scales:
        sshape = (num_pages, pps) if scales == "token" else (num_pages, pps, h)
        specs.update(k_scale_cache=(sshape, torch.float32), v_scale_cache=(sshape, torch.float32))
    p = CanaryBuffer(specs, 5)
    p["q"].copy_(q0)
    ref, original = p.clone(), p.raw.clone()
    addr_kind = {"int8_token": "loc_map", "e4m3_head": "dcp", "int8_static": "table"}.get(variant, variant)
    addr = _addressing(addr_kind if addr_kind in ("loc_map", "dcp", "table") else "plain", n, num_pages,
                       pps, gen, check == "guard")
    static_scales = dict(k_scale=torch.rand(h, generator=gen) * 0.05 + 0.01, v_scale=torch.tensor([0.03]))
    errs = {}
    for b, buf in ((backend, p), ("torch", ref)):
        extra = static_scales if static else {}
        if scales:
            extra = dict(k_scale_cache=buf["k_scale_cache"], v_scale_cache=buf["v_scale_cache"])
        errs[b] = kvwrite.ErrorBuffer()
        kvwrite.rope_store_kv(pos, buf["q"], k, v, cs, buf["k_cache"], buf["v_cache"], is_neox=variant != "table",
                              rotary_dim=rd, q_norm_weight=qw, k_norm_weight=kw if variant != "loc_map" else None,
                              norm_eps=1e-5, layout=layout, check=check, errors=errs[b], backend=b,
                              **addr, **extra)
    assert_same_bytes(p, ref, original)
    assert torch.equal(errs[backend].tensor, errs["torch"].tensor)
    if check == "guard":  # a bad position (token 3) and bad locs were recorded
        assert errs["torch"].error().count >= 1


MLA_VARIANTS = [("auto", "table"), ("fp8", "loc_map"), ("fp8_ds_mla", "dcp"), ("nvfp4", "plain"),
                ("fp8_e5m2", "plain"), ("fp8_ds_mla+pow2+input", "plain"), ("fp8_ds_mla+input", "dcp")]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("fmt,variant", MLA_VARIANTS)
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_store_mla_kernels_match_reference(backend, fmt, variant, check):
    n, hq, L, R, pps, num_pages, max_pos = 6, 2, 128, 16, 4, 3, 20
    gen = torch.Generator().manual_seed(7)
    dtype = torch.float16 if variant == "dcp" else torch.bfloat16
    kv_c, k_pe, q_pe, cs, pos = mla_inputs(gen, n, hq, L, R, max_pos, dtype)
    if check == "guard":
        pos[4] = -1
    name = {"fp8": "fp8_e4m3"}.get(fmt, fmt)
    fm = kvwrite.ops.mla.FORMATS[name]
    specs = {"kv_cache": ((num_pages, pps, fm.row_width(L, R)), fm.cache_dtype(dtype)), "q": ((n, hq, R), dtype)}
    if fm.takes_scale_cache:
        specs["scale_cache"] = ((num_pages, pps, (L + R) // 16), torch.float8_e4m3fn)
    p = CanaryBuffer(specs, 9)
    p["q"].copy_(q_pe)
    ref, original = p.clone(), p.raw.clone()
    addr = _addressing(variant, n, num_pages, pps, gen, check == "guard")
    errs = {}
    for b, buf in ((backend, p), ("torch", ref)):
        extra = ({"scale": torch.tensor(0.02)} if fm.takes_scale else {}) | (
            {"scale_cache": buf["scale_cache"], "global_scale": torch.tensor([0.5])} if fm.takes_scale_cache else {})
        errs[b] = kvwrite.ErrorBuffer()
        kvwrite.rope_store_mla(pos, buf["q"], kv_c, k_pe, cs, buf["kv_cache"], is_neox=variant == "plain",
                               kv_cache_dtype=fmt, check=check, errors=errs[b], backend=b, **addr, **extra)
    assert_same_bytes(p, ref, original)
    assert torch.equal(errs[backend].tensor, errs["torch"].tensor)


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("op", ["kv", "mla"])
def test_rope_store_assert_raises_before_any_write(backend, op):
    """assert mode: a bad loc (and a bad position) raise OutOfBoundsWrite naming the first bad
    token; nothing around or inside the pool changes."""
    n, pps, num_pages = 5, 4, 2
    gen = torch.Generator().manual_seed(3)
    loc = torch.tensor([0, 3, 100, 5, -1])
    pos = torch.tensor([1, 2, 3, 40, 4])   # token 3: position outside a 10-row cos/sin cache
    cs = torch.randn(10, 16, generator=gen)
    if op == "kv":
        p = CanaryBuffer({"k_cache": ((num_pages, pps, 2, 16), torch.float32),
                          "v_cache": ((num_pages, pps, 2, 16), torch.float32), "q": ((n, 2, 16), torch.float32)}, 1)
        original = p.raw.clone()
        with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 2") as info:
            kvwrite.rope_store_kv(pos, p["q"], torch.randn(n, 2, 16), torch.randn(n, 2, 16), cs, p["k_cache"],
                                  p["v_cache"], loc, check="assert", backend=backend)
    else:
        p = CanaryBuffer({"kv_cache": ((num_pages, pps, 48), torch.float32), "q": ((n, 2, 16), torch.float32)}, 1)
        original = p.raw.clone()
        with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 2") as info:
            kvwrite.rope_store_mla(pos, p["q"], torch.randn(n, 32), torch.randn(n, 16), cs, p["kv_cache"], loc,
                                   check="assert", backend=backend)
    assert info.value.count == 2 and info.value.kind == kvwrite.errors.KIND_POOL
    assert torch.equal(p.raw, original)


@pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend (C++ extension) is unavailable")
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_store_kv_cpu_runs_in_cpp(monkeypatch, check):
    """Once the extension is loaded, a CPU call the C++ matcher accepts runs the kernel from C++
    (no Python validation, nothing handed to the Python twin: the same bytes); one it refuses
    gets Python's named error."""
    from kvwrite.ops import _library, spec

    n, hq, h, d = 3, 2, 2, 32
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(n, hq, d, generator=gen).bfloat16()
    k, v = torch.randn(n, h, d, generator=gen).bfloat16(), torch.randn(n, h, d, generator=gen).bfloat16()
    cs = torch.randn(8, d, generator=gen)
    pos, loc = torch.tensor([1, 7, 3]), torch.tensor([2, -1, 5])
    w = torch.rand(d, generator=gen) + 0.5
    caches = [torch.zeros(2, 4, h, d, dtype=torch.bfloat16) for _ in range(4)]
    qs = [q.clone(), q.clone()]
    errs = [kvwrite.ErrorBuffer(), kvwrite.ErrorBuffer()]
    kvwrite.rope_store_kv(pos, qs[0], k, v, cs, caches[0], caches[1], loc, q_norm_weight=w, k_norm_weight=w,
                          check=check, errors=errs[0], backend="torch")

    def no_python(*args, **kwargs):
        raise AssertionError("the Python validation ran")

    forwarded = dict(_library.FORWARDED)
    monkeypatch.setattr(spec.Op, "match", no_python)
    kvwrite.rope_store_kv(pos, qs[1], k, v, cs, caches[2], caches[3], loc, q_norm_weight=w, k_norm_weight=w,
                          check=check, errors=errs[1], backend="cpu")
    monkeypatch.undo()
    assert _library.FORWARDED == forwarded
    assert torch.equal(qs[0], qs[1]) and torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(TypeError, match="q must have dtype"):
        kvwrite.rope_store_kv(pos, q.float(), k, v, cs, caches[2], caches[3], loc, backend="cpu")
    with pytest.raises(ValueError, match="norm_eps"):
        kvwrite.rope_store_kv(pos, q, k, v, cs, caches[2], caches[3], loc, norm_eps=-1.0, backend="cpu")


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_rope_store_kv_quant_rule_is_store_kvs(backend):
    """quant_rule="vllm" (dynamic scales) stores the rotated k as store_kv stores it with that rule."""
    gen = torch.Generator().manual_seed(6)
    n, h, d = 4, 2, 32
    q, k, v = (torch.randn(n, h, d, generator=gen).bfloat16() for _ in range(3))
    cs, pos, loc = torch.randn(8, d, generator=gen), torch.tensor([1, 7, 3, 0]), torch.tensor([2, 9, 5, 12])
    got = [torch.zeros(4, 4, h, d, dtype=torch.int8) for _ in range(2)] + [torch.zeros(4, 4, h) for _ in range(2)]
    want = [t.clone() for t in got]
    kvwrite.rope_store_kv(pos, q.clone(), k, v, cs, got[0], got[1], loc, k_scale_cache=got[2], v_scale_cache=got[3],
                          quant_rule="vllm", backend=backend)
    k_rot = np_rope(k, pos, cs, d, True).to(torch.bfloat16)
    kvwrite.store_kv(k_rot, v, want[0], want[1], loc, k_scale_cache=want[2], v_scale_cache=want[3],
                     quant_rule="vllm", backend="torch")
    for a, b in zip(got, want):
        assert torch.equal(a, b) and a.any()
