"""The special-value policy (README "Special values"): every quantising op x every backend x
NaN, +-inf, finite overflow, -0, subnormals, bit-identical to the torch reference, and the
reference itself checked against the policy's rules."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import DEVICE, KERNEL_BACKENDS
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.reference.quant import FP8_NAN

NAN, INF = float("nan"), float("inf")
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)
MAX_CODE = {torch.float8_e4m3fn: 0x7E, torch.float8_e5m2: 0x7B, torch.float8_e4m3fnuz: 0x7F}
NEG_ZERO = {torch.float8_e4m3fn: 0x80, torch.float8_e5m2: 0x80, torch.float8_e4m3fnuz: 0x00}
MLA_NAME = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2",
            torch.float8_e4m3fnuz: "fp8_e4m3fnuz"}
SUB = 1e-40   # an fp32 (and bf16) subnormal
# One row of 16 values: every special value (index -> what it is), then ordinary values.
SPECIALS = [NAN, -NAN, INF, -INF, 1e6, -1e6, 0.0, -0.0, SUB, -SUB, 1e-30, -1e-30, 3.0, -0.75,
            0.40625, 100.0]
IDX = dict(nan=0, neg_nan=1, inf=2, neg_inf=3, over=4, neg_over=5, zero=6, neg_zero=7, sub=8,
           neg_sub=9, tiny=10, neg_tiny=11)


def special_rows(n: int, width: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """[n, width]: row i holds SPECIALS rotated by i (so every special value meets every
    position of a block), the rest random normals."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, width, generator=gen) * 3
    base = torch.tensor(SPECIALS, dtype=torch.float32)
    for i in range(n):
        x[i, :len(SPECIALS)] = base.roll(i)[:width]
    return x.to(dtype).to(DEVICE)


def check_fp8_codes(codes: torch.Tensor, x: torch.Tensor, dtype: torch.dtype, scale: float) -> None:
    """The policy, per element, for fp8 codes of saturate(x / scale) (reference output)."""
    x = x.float().cpu()
    codes = codes.cpu().to(torch.int32)
    y = x / scale
    nan, maxc, negz = FP8_NAN[dtype], MAX_CODE[dtype], NEG_ZERO[dtype]
    sign = 0x80
    assert bool((codes[torch.isnan(x)] == nan).all()), "NaN -> the one NaN code, any sign"
    big = (y.abs() > kvwrite.validate.FP8_MAX[dtype]) & ~torch.isnan(y)
    assert bool((codes[big & (y > 0)] == maxc).all()), "+inf / overflow -> +max"
    assert bool((codes[big & (y < 0)] == (maxc | sign)).all()), "-inf / overflow -> -max"
    sub = (x.abs() < torch.finfo(torch.float32).tiny) & (x != 0)
    negative = torch.signbit(x)
    assert bool((codes[sub & ~negative] == 0).all()), "subnormal -> +0"
    assert bool((codes[sub & negative] == negz).all()), "-subnormal -> -0 (fnuz: 0)"
    assert bool((codes[(x == 0) & negative] == negz).all()), "-0 -> 0x80 (fnuz: 0x00)"
    assert bool((codes[(x == 0) & ~negative] == 0).all())


def run_both(backend, pool, call):
    """call(pool, backend) on `pool` and on a clone with the torch backend; same bytes."""
    ref, original = pool.clone(), pool.raw.clone()
    call(pool, backend)
    call(ref, "torch")
    assert_same_bytes(pool, ref, original)
    return ref


# ----------------------------------------------------------------------------------------- fp8
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", FP8)
def test_store_kv_fp8(backend, dtype, cache):
    n, h, d = 4, 2, 16
    k = special_rows(n * h, d, dtype).reshape(n, h, d)
    v = special_rows(n * h, d, dtype, seed=1).flip(-1).reshape(n, h, d)
    pool = CanaryBuffer({"k": ((2, 4, h, d), cache), "v": ((2, 4, h, d), cache)})
    loc = torch.tensor([5, 0, 7, 2], device=DEVICE)
    ks = torch.tensor([0.5, 2.0], device=DEVICE)  # per head
    vs = torch.tensor(1.0, device=DEVICE)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale=ks, v_scale=vs, backend=b)

    ref = run_both(backend, pool, call)
    rows = ref["k"].view(torch.uint8).reshape(8, h, d)[loc.cpu()]
    for head, s in enumerate((0.5, 2.0)):
        check_fp8_codes(rows[:, head], k[:, head], cache, s)
    check_fp8_codes(ref["v"].view(torch.uint8).reshape(8, h, d)[loc.cpu()], v, cache, 1.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", FP8)
def test_store_mla_fp8(backend, cache):
    n, L, R = 3, 32, 16
    kv_c, k_pe = special_rows(n, L, torch.float32), special_rows(n, R, torch.float32, seed=2)
    pool = CanaryBuffer({"c": ((2, 2, L + R), cache)})
    loc = torch.tensor([3, 0, 1], device=DEVICE)
    scale = torch.tensor([0.25], device=DEVICE)

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype=MLA_NAME[cache], scale=scale,
                          backend=b)

    ref = run_both(backend, pool, call)
    rows = ref["c"].view(torch.uint8).reshape(4, L + R)[loc.cpu()]
    check_fp8_codes(rows, torch.cat([kv_c, k_pe], -1), cache, 0.25)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter's numpy divides by 0
@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_scale_gives_nan_codes_and_zero_scale_saturates(backend):
    k = special_rows(2, 16, torch.float32).reshape(2, 1, 16)
    pool = CanaryBuffer({"k": ((1, 2, 1, 16), torch.float8_e4m3fn),
                         "v": ((1, 2, 1, 16), torch.float8_e4m3fn)})
    loc = torch.tensor([0, 1], device=DEVICE)
    ks, vs = torch.tensor(NAN, device=DEVICE), torch.tensor(0.0, device=DEVICE)

    def call(p, b):
        kvwrite.store_kv(k, k, p["k"], p["v"], loc, k_scale=ks, v_scale=vs, backend=b)

    ref = run_both(backend, pool, call)
    assert bool((ref["k"].view(torch.uint8) == 0x7F).all())
    x = kvwrite.reference.quant.daz(k).reshape(2, 16)
    check_fp8_codes(ref["v"].view(torch.uint8).reshape(2, 16), torch.where(x == 0, NAN, x * INF),
                    torch.float8_e4m3fn, 1.0)  # x / 0: +-inf -> +-max, 0 / 0 -> NaN


# ---------------------------------------------------------------------------- scaled blocks
def tile_with(x: torch.Tensor, j: int, value: float) -> torch.Tensor:
    y = x.clone()
    y[..., j] = value
    return y


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ds_mla(backend, dtype):
    n, L, R = 6, 256, 8
    kv_c = (torch.randn(n, L, generator=torch.Generator().manual_seed(3)) * 2).to(dtype).to(DEVICE)
    kv_c[0, 5], kv_c[1, 130], kv_c[2, 7], kv_c[3, 200] = NAN, INF, -INF, -NAN
    kv_c[4, :128] = 0.0                        # an all-zero tile, with one -0
    kv_c[4, 3] = -0.0
    kv_c[5, :128] = SUB                        # a tile of subnormals and one tiny normal value
    kv_c[5, 9] = 2e-38
    kv_c[5, 128:144] = torch.tensor(SPECIALS, dtype=torch.float32).to(dtype)
    k_pe = special_rows(n, R, dtype, seed=4)
    row = kvwrite.ops.mla.ds_mla_row_bytes(L, R)
    pool = CanaryBuffer({"c": ((2, 4, row), torch.uint8)})
    loc = torch.arange(n, device=DEVICE)

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype="fp8_ds_mla", backend=b)

    ref = run_both(backend, pool, call)
    rows = ref["c"].reshape(8, row)[:n].cpu()
    codes, scales = rows[:, :L].reshape(n, 2, 128), rows[:, L:L + 8].contiguous().view(torch.float32)
    assert bool(torch.isfinite(scales).all()) and bool((scales > 0).all()), "scales always finite"
    # a NaN / inf in a tile: the tile's scale and its other codes are those of the tile without it
    x = kv_c.float().cpu()
    for t, j, code in ((0, 5, 0x7F), (1, 130, 0x7E), (2, 7, 0xFE), (3, 200, 0x7F)):
        clean = CanaryBuffer({"c": ((2, 4, row), torch.uint8)})
        kvwrite.store_mla(tile_with(kv_c[t:t + 1], j, 0.0), k_pe[t:t + 1], clean["c"], loc[:1],
                          kv_cache_dtype="fp8_ds_mla", backend="torch")
        want = clean["c"].reshape(8, row)[0].cpu()
        got = rows[t].clone()
        assert int(got[j]) == code
        got[j] = want[j]
        assert torch.equal(got, want)
    # all-zero tile: scale = FLT_MIN, -0 kept; subnormals read as zero (scale FLT_MIN would
    # otherwise turn them into nonzero codes)
    tiny = torch.finfo(torch.float32).tiny
    assert float(scales[4, 0]) == tiny and int(codes[4, 0, 3]) == 0x80 and int(codes[4, 0, 4]) == 0
    assert float(scales[5, 0]) == tiny
    assert bool((codes[5, 0, :9] == 0).all()) and int(codes[5, 0, 9]) != 0
    check_fp8_codes(codes[5, 1, :16], x[5, 128:144], torch.float8_e4m3fn, float(scales[5, 1]))
    # rope: bf16 copied bit-exactly, fp32 rounded with NaN -> 0x7FC0
    rope = rows[:, L + 8:].contiguous().view(torch.int16)
    if dtype == torch.bfloat16:
        assert torch.equal(rope, k_pe.cpu().view(torch.int16))
    else:
        assert bool((rope[torch.isnan(k_pe.cpu())] == 0x7FC0).all())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_indexer_k(backend, scale_fmt):
    n, d, qbs = 4, 64, 32
    k = special_rows(n, d, torch.float32, seed=5)
    k[3, 32:] = SUB  # a block of subnormals: amax floor 1e-4
    pool = CanaryBuffer({"c": ((2, 4 * (d + 8)), torch.uint8)})
    loc = torch.tensor([6, 1, 0, 3], device=DEVICE)

    def call(p, b):
        kvwrite.store_indexer_k(k, p["c"], loc, quant_block_size=qbs, scale_fmt=scale_fmt, backend=b)

    ref = run_both(backend, pool, call)
    c = ref["c"].cpu()
    lc = loc.cpu()
    data = c[:, :4 * d].reshape(8, d)[lc]
    scales = c[:, 4 * d:].reshape(8, 2 * 4)[lc].contiguous().view(torch.float32)
    x = k.cpu()
    amax = torch.where(torch.isfinite(x), x.abs(), 0.0).reshape(n, 2, qbs).amax(-1)
    want = torch.clamp(amax, min=1e-4) / 448.0
    if scale_fmt:
        want = kvwrite.reference.indexer_k.ue8m0(want)
    assert torch.equal(scales, want), "scale from the finite values only"
    for b in range(2):
        check_fp8_codes(data[:, b * qbs:(b + 1) * qbs], x[:, b * qbs:(b + 1) * qbs],
                        torch.float8_e4m3fn, scales[:, b:b + 1])


def nvfp4_check(packed: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, g) -> None:
    """Policy of NVFP4 blocks (reference output, [N, D/2] / [N, D/16] / [N, D])."""
    codes = torch.stack((packed.to(torch.int32) & 0xF, packed.to(torch.int32) >> 4), -1).reshape(x.shape)
    sc = scales.view(torch.uint8).to(torch.int32)
    xb = x.float().reshape(x.shape[0], -1, 16)
    nan_block = torch.isnan(xb).any(-1)
    assert bool((sc[nan_block] == 0x7F).all()) and bool((sc[~nan_block] != 0x7F).all())
    assert bool((codes[torch.isnan(x)] == 0).all()), "NaN elements: code 0, the scale carries it"
    finite = torch.where(torch.isfinite(xb), xb, 0.0)
    for i, blk in zip(*torch.nonzero(~torch.isfinite(xb).all(-1), as_tuple=True)):
        # the block quantised without its specials: same scale (unless NaN) and other codes
        want_p, want_s = kvwrite.reference.nvfp4.quantize_nvfp4(finite[i, blk][None], g)
        want = torch.stack((want_p.to(torch.int32) & 0xF, want_p.to(torch.int32) >> 4), -1).reshape(16)
        got = codes.reshape(xb.shape)[i, blk]
        special = ~torch.isfinite(xb[i, blk])
        assert torch.equal(got[~special], want[~special])
        inf = torch.isinf(xb[i, blk])
        if bool(want_s.float()[0, 0] != 0):
            assert bool((got[inf] == (7 | (torch.signbit(xb[i, blk][inf]).to(torch.int32) << 3))).all())
        if not bool(nan_block[i, blk]):
            assert int(sc[i, blk]) == int(want_s.view(torch.uint8)[0, 0])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("glob", [None, 0.5])
def test_store_kv_nvfp4(backend, dtype, glob):
    n, h, d = 4, 1, 48
    k = special_rows(n, d, dtype, seed=6).reshape(n, h, d)
    k[3, 0, 16:32] = 0.0           # a zero block with a -0 and an inf: signs kept, inf -> +-0
    k[3, 0, 17], k[3, 0, 18] = -0.0, INF
    v = special_rows(n, d, dtype, seed=7).flip(-1).reshape(n, h, d)
    g = None if glob is None else torch.tensor(glob, device=DEVICE)
    pool = CanaryBuffer({"kc": ((2, 2, h, d // 2), torch.uint8), "vc": ((2, 2, h, d // 2), torch.uint8),
                         "ks": ((2, 2, h, d // 16), torch.float8_e4m3fn),
                         "vs": ((2, 2, h, d // 16), torch.float8_e4m3fn)})
    loc = torch.tensor([1, 2, 0, 3], device=DEVICE)

    def call(p, b):
        kvwrite.store_kv_nvfp4(k, v, p["kc"], p["vc"], p["ks"], p["vs"], loc, k_global_scale=g,
                               v_global_scale=g, backend=b)

    ref = run_both(backend, pool, call)
    lc = loc.cpu()
    for x, c, s in ((k, "kc", "ks"), (v, "vc", "vs")):
        nvfp4_check(ref[c].cpu().reshape(4, -1)[lc], ref[s].cpu().reshape(4, -1)[lc],
                    x.cpu().reshape(n, d), None if g is None else g.cpu())
    zero_block = ref["kc"].cpu().reshape(4, -1)[3, 8:16].to(torch.int32)
    assert int(zero_block[0]) >> 4 == 8 and int(zero_block[1]) & 0xF == 0  # -0 kept; inf -> +0


@pytest.mark.parametrize("backend", BACKENDS)
def test_store_mla_nvfp4(backend):
    n, L, R = 3, 32, 16
    kv_c, k_pe = special_rows(n, L, torch.float32, seed=8), special_rows(n, R, torch.float32, seed=9)
    pool = CanaryBuffer({"c": ((2, 2, (L + R) // 2), torch.uint8),
                         "s": ((2, 2, (L + R) // 16), torch.float8_e4m3fn)})
    loc = torch.tensor([2, 3, 0], device=DEVICE)

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype="nvfp4", scale_cache=p["s"],
                          backend=b)

    ref = run_both(backend, pool, call)
    lc = loc.cpu()
    nvfp4_check(ref["c"].cpu().reshape(4, -1)[lc], ref["s"].cpu().reshape(4, -1)[lc],
                torch.cat([kv_c, k_pe], -1).cpu(), None)


# ------------------------------------------------------------------------- the fp8 rounding
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("cache", FP8)
def test_rounding_of_every_code_and_midpoint(backend, cache):
    """Every fp8 code's value, the midpoints between neighbours (ties to even) and values just
    beside them: the reference (torch's own cast + the NaN rule) and each backend's bit
    arithmetic (`fp8_bits`) give the same codes."""
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(cache).float()
    vals = codes[torch.isfinite(codes)].unique()
    mids = (vals[1:] + vals[:-1]) / 2
    x = torch.cat([vals, mids, mids.nextafter(torch.full_like(mids, INF)),
                   mids.nextafter(torch.full_like(mids, -INF)), torch.tensor(SPECIALS)])
    x = x[torch.randperm(x.numel(), generator=torch.Generator().manual_seed(0))]
    x = x[: x.numel() // 16 * 16].reshape(-1, 1, 16).to(DEVICE)
    one = torch.tensor(1.0, device=DEVICE)
    pools = {}
    for b in ("torch", backend):
        kc = torch.zeros(1, x.shape[0], 1, 16, dtype=cache, device=DEVICE)
        vc = torch.zeros_like(kc)
        kvwrite.store_kv(x, x, kc, vc, torch.arange(x.shape[0], device=DEVICE), k_scale=one,
                         v_scale=one, backend=b)
        pools[b] = kc.view(torch.uint8)
    assert torch.equal(pools["torch"], pools[backend])
    check_fp8_codes(pools["torch"].reshape(-1, 16), x.reshape(-1, 16), cache, 1.0)


# The quantising cases whose cpu lanes read codes off fp32 arithmetic (csrc/kvwrite/simd_x86.h
# grid_codes8: no subnormal result, so no dependence on MXCSR.FTZ / DAZ).
# mha-fp8-token / -head: the int8 cases' dynamic scales into an fp8 cache (no bench case of their own).
FTZ_CASES = ("mha-fp8", "mha-fp8-token", "mha-fp8-head", "mha-int8-token", "mla-fp8ds", "dsv4-kv", "indexer-k",
             "mha-nvfp4", "mla-nvfp4", "dsv4-kv-nvfp4")


@pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend is not built here")
@pytest.mark.parametrize("outliers", [False, True])
@pytest.mark.parametrize("name", FTZ_CASES)
def test_flush_denormal_same_bytes(name: str, outliers: bool) -> None:
    """The cpu backend writes the torch reference's bytes in a thread with MXCSR.FTZ / DAZ set
    (torch.set_flush_denormal) and in one without, on normal rows and on rows with outliers (most
    codes of a tile small, many e4m3 subnormals: the lanes' slow case when they made fp32 subnormals)."""
    from kvwrite.bench import cases
    if name.startswith("mha-fp8-"):
        def build(n, device, gen):
            return cases._mha_dynamic(n, device, gen, torch.float8_e4m3fn, name.endswith("head"))
    else:
        found, _ = cases.available([name])
        if not found:
            pytest.skip(f"{name} is not a bench case here")
        build = found[0].build
    with cases.values("outliers" if outliers else "normal"):
        s = build(64, torch.device("cpu"), torch.Generator().manual_seed(3))

    def run(backend: str, flush: bool) -> list[torch.Tensor]:
        for t in s.outputs:
            t.zero_()
        if flush and not torch.set_flush_denormal(True):
            pytest.skip("this CPU cannot flush denormals")
        try:
            s.call(backend, "off", None)
        finally:
            torch.set_flush_denormal(False)
        return [t.view(torch.uint8).clone() for t in s.outputs]

    want = run("torch", False)
    for flush in (False, True):
        for got, exp in zip(run("cpu", flush), want):
            assert torch.equal(got, exp), f"flush_denormal={flush}"
