"""rope_store_kv / rope_store_mla: the fused op against "rope (independent numpy fp32 oracle),
then store_kv / store_mla", bit for bit, canaries around every buffer; bad positions and locs."""
from __future__ import annotations

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
    if backend != "torch" and kind not in KERNEL_KINDS:
        with pytest.raises(kvwrite.BackendUnavailable):
            run_kv_case(c, case, check, backend)
        return
    run_kv_case(c, case, check, backend)


KERNEL_KINDS = ("same", "fp8_static")  # K/V formats the kernel backends store so far


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


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("fmt", MLA_FORMATS)
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_store_mla_matches_unfused(backend, fmt, check):
    n, hq, L, R, pps, num_pages, max_pos = 7, 3, 128, 32, 4, 4, 40
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    kv_c = (torch.randn(n, L, generator=gen) * 2).to(dtype)
    k_pe = (torch.randn(n, R, generator=gen) * 2).to(dtype)
    q_pe = (torch.randn(n, hq, R, generator=gen) * 2).to(dtype)
    ang = torch.rand(max_pos, R // 2, generator=gen) * 6
    cs = torch.cat([ang.cos(), ang.sin()], -1)
    pos = torch.randint(0, max_pos, (n,), generator=gen)
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
