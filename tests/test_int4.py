"""store_kv's int4 format (vLLM's INT4_PER_TOKEN_HEAD): every backend against the reference's
bytes (canaries around the pools), a scalar oracle of the documented formula, the check modes,
duplicates, loc_map / DCP, special values, the decoder's error bound, the vLLM adapters."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite import facts
from kvwrite.errors import DuplicateWrite
from kvwrite.reference import kv_int4 as ref

IMPLEMENTED = ["torch", *BACKENDS]


def pool(num_pages, pps, h, d, dv=None, seed=0):
    dv = d if dv is None else dv
    return CanaryBuffer({"k_cache": ((num_pages, pps, h, d // 2), torch.uint8),
                         "v_cache": ((num_pages, pps, h, dv // 2), torch.uint8),
                         "k_scale_cache": ((num_pages, pps, h), torch.float32),
                         "v_scale_cache": ((num_pages, pps, h), torch.float32)}, seed)


def store(p, k, v, loc, **kw):
    kvwrite.store_kv(k, v, p["k_cache"], p["v_cache"], loc, k_scale_cache=p["k_scale_cache"],
                     v_scale_cache=p["v_scale_cache"], **kw)


def both(backend, k, v, loc, shape, **kw):
    """(backend's pool, the reference's pool, the bytes before) for one call."""
    p = pool(*shape)
    original = p.raw.clone()
    twin = p.clone()
    store(p, k, v, loc, backend=backend, **kw)
    store(twin, k, v, loc, backend="torch", **kw)
    return p, twin, original


def oracle(x: torch.Tensor) -> tuple[list[int], int]:
    """Codes and stored scale bits of one head x [D], element by element (Python loop over fp32
    scalars: the module doc's steps, independent of the reference's tensor code)."""
    f32 = lambda a: torch.tensor(a, dtype=torch.float32)  # noqa: E731
    d = x.shape[0]
    b = d & -d
    signs = facts.int4_rht_signs(d)
    y = [f32(float(x[j])) * signs[j % b] for j in range(d)]
    h = 1
    while h < b:
        for run in range(0, d, 2 * h):
            for t in range(run, run + h):
                y[t], y[t + h] = y[t] + y[t + h], y[t] - y[t + h]
        h *= 2
    y = [t.to(x.dtype).float() for t in y]
    fin = [t for t in y if bool(torch.isfinite(t))]
    mn, mx = (min(fin), max(fin)) if fin else (f32(0.0), f32(0.0))
    scale = torch.maximum((mx - mn) / f32(15.0), f32(1e-6))
    zp = int(float(((-mn / scale).clamp(0, 15) + f32(0.5)).trunc()))
    inv = f32(1.0) / scale
    codes = [zp if bool(torch.isnan(t)) else int(float(((t * inv + f32(zp)).clamp(0, 15) + f32(0.5)).trunc()))
             for t in y]
    return codes, (int(scale.view(torch.int32)) & ~0xF) | zp


def test_reference_is_the_documented_formula():
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(2, 2, 48, generator=gen) * 2).bfloat16()
    x[1, 1] -= 5   # an all-negative-ish head: the zero point at its top
    packed, scale = ref.quantize_int4(x)
    for t in range(2):
        for h in range(2):
            codes, bits = oracle(x[t, h])
            assert packed[t, h].tolist() == [codes[j] | (codes[j + 1] << 4) for j in range(0, 48, 2)]
            assert int(scale[t, h].view(torch.int32)) == bits


def test_signs_are_one_prefix():
    """The C++ table holds the 512-element vector; every block's signs are its prefix."""
    full = facts.int4_rht_signs(facts.INT4_MAX_DIM)
    for b in (2, 16, 64, 128, 256):
        assert torch.equal(facts.int4_rht_signs(b), full[:b])
    assert set(full.tolist()) == {-1.0, 1.0}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,d,dv", [(torch.bfloat16, 64, 64), (torch.float16, 96, 32),
                                        (torch.float32, 16, 80)])
def test_backends_equal_reference(backend, dtype, d, dv):
    gen = torch.Generator().manual_seed(1)
    n, h, pps, pages = 9, 3, 4, 4
    k = (torch.randn(n, h, d, generator=gen) * 3).to(dtype).to(DEVICE)
    v = (torch.randn(n, h, dv, generator=gen)).to(dtype).to(DEVICE)
    k[2] = 0   # an all-zero token: scale 1e-6, zero point 0
    loc = paged_locs(n, pages * pps, pps, gen, 0.2)
    p, twin, original = both(backend, k, v, loc, (pages, pps, h, d, dv))
    assert_same_bytes(p, twin, original)
    assert not torch.equal(p.raw, original)


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_hnd_layout_and_strided_rows(backend):
    gen = torch.Generator().manual_seed(2)
    n, h, d, pps, pages = 5, 2, 32, 4, 2
    kv = torch.randn(n, 2 * h, d, generator=gen).bfloat16().to(DEVICE)
    k, v = kv[:, :h], kv[:, h:]   # strided heads
    loc = torch.tensor([3, -1, 7, 0, 4], device=DEVICE)
    nhd, hnd = pool(pages, pps, h, d), CanaryBuffer({
        "k_cache": ((pages, h, pps, d // 2), torch.uint8), "v_cache": ((pages, h, pps, d // 2), torch.uint8),
        "k_scale_cache": ((pages, pps, h), torch.float32), "v_scale_cache": ((pages, pps, h), torch.float32)})
    store(nhd, k, v, loc, backend="torch")
    store(hnd, k, v, loc, backend=backend, layout="HND")
    for name in ("k_cache", "v_cache"):
        assert torch.equal(hnd[name].transpose(1, 2)[loc[loc >= 0] // pps, loc[loc >= 0] % pps],
                           nhd[name][loc[loc >= 0] // pps, loc[loc >= 0] % pps])
    for name in ("k_scale_cache", "v_scale_cache"):
        assert torch.equal(hnd[name].view(torch.int32)[loc[loc >= 0] // pps, loc[loc >= 0] % pps],
                           nhd[name].view(torch.int32)[loc[loc >= 0] // pps, loc[loc >= 0] % pps])


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_round_trip_error_bound(backend):
    """Decoded rows lie within half a step (the head's scale) of the input, plus the rotated
    values' rounding to bf16 (half an ulp of the largest, carried back by the inverse rotation)."""
    gen = torch.Generator().manual_seed(4)
    n, h, d, pps, pages = 6, 2, 128, 4, 2
    k = (torch.randn(n, h, d, generator=gen) * 2).bfloat16().to(DEVICE)
    v = torch.randn(n, h, d, generator=gen).bfloat16().to(DEVICE)
    loc = torch.tensor([0, 1, 2, 5, 6, 7], device=DEVICE)
    p = pool(pages, pps, h, d)
    store(p, k, v, loc, backend=backend)
    for x, cache, sc in ((k, "k_cache", "k_scale_cache"), (v, "v_cache", "v_scale_cache")):
        back = kvwrite.dequant_kv_int4(p[cache], p[sc], loc)
        step = (p[sc].view(torch.int32) & ~0xF).view(torch.float32)[loc // pps, loc % pps]   # [n, h]
        top = ref.rht(x.float()).abs().amax(-1)
        bound = step * 0.5 * (1 + 1e-5) + top * 2.0 ** -8 + 1e-6
        err = (back - x.float()).abs().amax(-1)
        assert bool((err <= bound).all()), (err / bound).max()
        assert float((back - x.float()).abs().mean()) < 0.2 * float(x.float().abs().mean())


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("mode", ["off", "assert", "guard"])
def test_check_modes(backend, mode):
    """A loc past the pool and one < -1: assert raises before any write; guard skips them,
    records the first and writes the rest as the reference does; off skips negative locs."""
    gen = torch.Generator().manual_seed(5)
    n, h, d, pps, pages = 5, 2, 16, 4, 2
    k, v = torch.randn(2, n, h, d, generator=gen).bfloat16().to(DEVICE)
    loc = torch.tensor([0, 9, -1, 3, -4], device=DEVICE)
    p = pool(pages, pps, h, d)
    original = p.raw.clone()
    errs = kvwrite.ErrorBuffer(DEVICE)
    if mode == "assert":
        with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1"):
            store(p, k, v, loc, check="assert", backend=backend)
        assert torch.equal(p.raw, original)
        return
    if mode == "off":
        loc = torch.tensor([0, -7, -1, 3, -4], device=DEVICE)
    store(p, k, v, loc, check=mode, errors=errs, backend=backend)
    good = p.clone()
    good.raw.copy_(original)
    store(good, k, v, torch.tensor([0, -1, -1, 3, -1], device=DEVICE), backend="torch")
    assert_same_bytes(p, good, original)
    if mode == "guard":
        err = errs.error()
        assert (err.token_index, err.loc, err.count) == (1, 9, 2)


@pytest.mark.parametrize("backend", IMPLEMENTED)
@pytest.mark.parametrize("mode", ["assert", "guard"])
def test_duplicate_loc(backend, mode):
    """Two tokens on one row: guard keeps the lower token's codes and scale and records the
    later; assert raises DuplicateWrite before any write."""
    gen = torch.Generator().manual_seed(6)
    h, d = 2, 16
    k, v = torch.randn(2, 4, h, d, generator=gen).bfloat16().to(DEVICE)
    k[1] *= 50
    loc = torch.tensor([3, 3, 0, -1], device=DEVICE)
    p = pool(1, 4, h, d)
    original = p.raw.clone()
    if mode == "assert":
        with pytest.raises(DuplicateWrite):
            store(p, k, v, loc, check="assert", backend=backend)
        assert torch.equal(p.raw, original)
        return
    errs = kvwrite.ErrorBuffer(DEVICE)
    store(p, k, v, loc, check="guard", errors=errs, backend=backend)
    err = errs.error()
    assert isinstance(err, DuplicateWrite) and (err.token_index, err.first_token) == (1, 0)
    good = p.clone()
    good.raw.copy_(original)
    store(good, k, v, torch.tensor([3, -1, 0, -1], device=DEVICE), backend="torch")
    assert_same_bytes(p, good, original)


@pytest.mark.parametrize("backend", BACKENDS)
def test_loc_map_and_dcp(backend):
    gen = torch.Generator().manual_seed(7)
    n, h, d, pps, pages = 6, 2, 32, 4, 2
    k, v = torch.randn(2, n, h, d, generator=gen).bfloat16().to(DEVICE)
    loc_map = torch.tensor([5, -1, 2, 7, 0, 1, 6, 3], dtype=torch.int32, device=DEVICE)
    loc = torch.tensor([0, 1, 2, 3, -1, 6], device=DEVICE)
    p, twin, original = both(backend, k, v, loc, (pages, pps, h, d), loc_map=loc_map)
    assert_same_bytes(p, twin, original)
    loc = torch.tensor([0, 1, 2, 3, 9, 14], device=DEVICE)
    for rank in (0, 1):
        p, twin, original = both(backend, k, v, loc, (pages, pps, h, d), dcp_rank=rank, dcp_size=2)
        assert_same_bytes(p, twin, original)


def special_rows(n, h, d, gen, dtype=torch.bfloat16):
    x = torch.randn(n, h, d, generator=gen)
    x[0, 0, 0] = float("nan")
    x[0, 1, 3] = float("inf")
    x[1, 0, 5] = float("-inf")
    x[1, 1] = 0.0
    x[2, 0, 7] = 1e-40   # an fp32 subnormal: read as zero
    return x.to(dtype).to(DEVICE)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,d", [(torch.bfloat16, 96), (torch.float16, 32), (torch.float32, 48)])
def test_special_values_equal_reference(backend, dtype, d):
    gen = torch.Generator().manual_seed(8)
    k = special_rows(4, 2, d, gen, dtype)
    v = special_rows(4, 2, d, gen, dtype)
    if dtype == torch.float16:
        k[3, 0, :] = 60000.0   # rotated values overflow fp16: inf, saturated
    loc = torch.tensor([0, 1, 2, 3], device=DEVICE)
    p, twin, original = both(backend, k, v, loc, (1, 4, 2, d))
    assert_same_bytes(p, twin, original)


def test_special_value_policy():
    """NaN poisons its rotation block: those codes are the zero point (read back as 0); the
    other blocks keep their range; a head with no finite value has scale 1e-6, zero point 0."""
    d = 96   # three blocks of 32
    x = torch.randn(2, 1, d, generator=torch.Generator().manual_seed(9)).bfloat16()
    x[0, 0, 40] = float("nan")           # block 1
    x[1, 0, 0] = float("nan")
    x[1, 0, 32] = float("nan")
    x[1, 0, 64] = float("nan")           # every block
    packed, scale = ref.quantize_int4(x)
    bits = scale.view(torch.int32)
    zp = int(bits[0, 0]) & 0xF
    lo, hi = packed[0, 0] & 0xF, packed[0, 0] >> 4
    codes = torch.stack([lo, hi], -1).flatten()
    assert bool((codes[32:64] == zp).all())
    assert int(bits[1, 0]) == (int(torch.tensor(1e-6).view(torch.int32)) & ~0xF)
    assert bool((packed[1, 0] == 0).all())
    back = ref.decode_int4(packed, scale)
    assert bool(torch.isfinite(back).all())
    finite = ref.decode_int4(*ref.quantize_int4(torch.where(torch.isnan(x), 0, x)))
    assert float((back[0, 0, :32] - finite[0, 0, :32]).abs().max()) < 1.0


def test_argument_errors():
    k = torch.randn(2, 2, 16, device=DEVICE)
    p = pool(1, 4, 2, 16)
    loc = torch.tensor([0, 1], device=DEVICE)
    kc, vc, ks, vs = p["k_cache"], p["v_cache"], p["k_scale_cache"], p["v_scale_cache"]
    with pytest.raises(ValueError, match="k_cache must have shape .*D / 2"):
        kvwrite.store_kv(k, k, torch.zeros(1, 4, 2, 16, dtype=torch.uint8, device=DEVICE), vc, loc,
                         k_scale_cache=ks, v_scale_cache=vs)
    with pytest.raises(ValueError, match="even head dims"):
        kvwrite.store_kv(torch.randn(2, 2, 15, device=DEVICE), torch.randn(2, 2, 15, device=DEVICE), kc, vc,
                         loc, k_scale_cache=ks, v_scale_cache=vs)
    with pytest.raises(ValueError, match="needs k_scale_cache and v_scale_cache"):
        kvwrite.store_kv(k, k, kc, vc, loc)
    with pytest.raises(ValueError, match="one scale per token-head"):
        kvwrite.store_kv(k, k, kc, vc, loc, k_scale_cache=ks[..., 0], v_scale_cache=vs[..., 0])
    with pytest.raises(ValueError, match="k_scale/v_scale do not apply"):
        kvwrite.store_kv(k, k, kc, vc, loc, k_scale=torch.ones(()), v_scale=torch.ones(()),
                         k_scale_cache=ks, v_scale_cache=vs)
    with pytest.raises(TypeError, match="k_cache must have dtype in .*got torch.uint8"):  # no fused int4
        kvwrite.rope_store_kv(torch.zeros(2, dtype=torch.int64, device=DEVICE), k.clone(), k, k,
                              torch.randn(8, 16, device=DEVICE), kc, vc, loc, k_scale_cache=ks, v_scale_cache=vs)


def _vllm_inline_caches(blocks, bs, h, d):
    """vLLM's Triton-attention per-token-head allocation for int4: one uint8 buffer
    [blocks, H, bs, 2 * (D / 2 + 4)] ([K | K scale | V | V scale] a head and slot), its K/V views
    (transpose, split) and the fp32 scale views over the inline bytes."""
    half = d // 2 + 4
    kv = torch.zeros(blocks, h, bs, 2 * half, dtype=torch.uint8, device=DEVICE)
    key_cache, value_cache = kv.transpose(1, 2).split(half, dim=-1)
    f32 = torch.tensor([], dtype=torch.float32, device=DEVICE).set_(kv.untyped_storage())
    st = [s // 4 for s in kv.stride()]
    ks = torch.as_strided(f32, (blocks, bs, h), (st[0], st[2], st[1]), d // 8)
    vs = torch.as_strided(f32, (blocks, bs, h), (st[0], st[2], st[1]), (half + d // 2) // 4)
    return kv, key_cache, value_cache, ks, vs


@pytest.mark.parametrize("backend", IMPLEMENTED)
def test_vllm_adapters_int4(backend):
    """vLLM's per-token-head writer with INT4_PER_TOKEN_HEAD and its reshape_and_cache_int4,
    on separate caches and on vLLM's inline-scale layout: the bytes of store_kv's int4 format."""
    from kvwrite.compat import vllm as adapters

    gen = torch.Generator().manual_seed(10)
    n, h, d, bs, blocks = 5, 2, 32, 4, 3
    key, value = torch.randn(2, n, h, d, generator=gen).bfloat16().to(DEVICE)
    slots = torch.tensor([7, -1, 0, 11, 4], device=DEVICE)
    p = pool(blocks, bs, h, d)
    store(p, key, value, slots, backend="torch")
    for entry in ("per_token_head", "int4"):
        kv, kc, vc, ks, vs = _vllm_inline_caches(blocks, bs, h, d)
        if entry == "int4":
            adapters.reshape_and_cache_int4(key, value, kc, vc, slots, k_scale_cache=ks, v_scale_cache=vs,
                                            backend=backend)
        else:
            adapters.triton_reshape_and_cache_flash_per_token_head_quant(key, value, kc, vc, ks, vs, slots, 4,
                                                                         backend=backend)
        written = (slots[slots >= 0] // bs, slots[slots >= 0] % bs)
        for mine, theirs in ((kc, p["k_cache"]), (vc, p["v_cache"])):
            assert torch.equal(mine[..., :d // 2][written], theirs[written])
        for mine, theirs in ((ks, p["k_scale_cache"]), (vs, p["v_scale_cache"])):
            assert torch.equal(mine.view(torch.int32)[written], theirs.view(torch.int32)[written])
            assert int((mine != 0).sum()) == written[0].numel() * h   # nothing else written
        assert int((kv != 0).sum()) <= written[0].numel() * h * (2 * (d // 2) + 8)
    errs = kvwrite.ErrorBuffer(DEVICE)
    kv, kc, vc, ks, vs = _vllm_inline_caches(blocks, bs, h, d)
    adapters.triton_reshape_and_cache_flash_per_token_head_quant(
        key, value, kc, vc, ks, vs, torch.tensor([7, 12, 0, 11, 4], device=DEVICE), 4, check="guard", errors=errs,
        backend=backend)
    err = errs.error()
    assert (err.token_index, err.loc) == (1, 12)
    with pytest.raises(TypeError, match="needs uint8 caches"):
        adapters.triton_reshape_and_cache_flash_per_token_head_quant(
            key, value, kc.view(torch.int8), vc, ks, vs, slots, "int4_per_token_head")
