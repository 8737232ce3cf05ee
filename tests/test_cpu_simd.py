"""The cpu backend's vectorised conversions (csrc/kvwrite/simd_x86.h) against the torch
reference: every 16-bit input pattern (bf16 and fp16: NaNs, infs, subnormals, both zeros, every
exponent), head widths that leave a scalar tail, and scales that put the grid anywhere (tiny,
subnormal, huge). Canaries around the pool."""
from __future__ import annotations

import pytest
import torch

import kvwrite
from conftest import KERNEL_BACKENDS
from helpers import CanaryBuffer, assert_same_bytes

pytestmark = pytest.mark.skipif("cpu" not in KERNEL_BACKENDS, reason="the cpu backend is not built here")

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def every_pattern(dtype: torch.dtype, heads: int, dim: int) -> torch.Tensor:
    """All 65536 bit patterns of a 16-bit float type as [n, heads, dim] (the last token padded
    with the first patterns again)."""
    per_token = heads * dim
    n = -(-65536 // per_token)
    bits = torch.arange(n * per_token, dtype=torch.int32) % 65536
    return bits.to(torch.int16).view(dtype).reshape(n, heads, dim)


def run(call, specs: dict) -> None:
    pool = CanaryBuffer(specs)
    ref, original = pool.clone(), pool.raw.clone()
    call(pool, "cpu")
    call(ref, "torch")
    assert_same_bytes(pool, ref, original)


def run_store_kv_nvfp4(k: torch.Tensor, v: torch.Tensor, loc: torch.Tensor, glob: float | None = None) -> None:
    """store_kv_nvfp4 of k, v ([n, heads, dim]) at loc into pools of 16-token pages (8 slots to
    spare), global scale glob on both sides (None: none), cpu against torch."""
    n, heads, dim = k.shape
    pages = -(-(n + 8) // 16)
    gt = None if glob is None else torch.tensor([glob])

    def call(p, b):
        kvwrite.store_kv_nvfp4(k, v, p["k"], p["v"], p["ks"], p["vs"], loc, k_global_scale=gt,
                               v_global_scale=gt, backend=b)

    run(call, {"k": ((pages, 16, heads, dim // 2), torch.uint8),
               "v": ((pages, 16, heads, dim // 2), torch.uint8),
               "ks": ((pages, 16, heads, dim // 16), torch.float8_e4m3fn),
               "vs": ((pages, 16, heads, dim // 16), torch.float8_e4m3fn)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", FP8)
@pytest.mark.parametrize("dim", [128, 40])   # 40: one 32-wide block and an 8-element tail
def test_store_kv_fp8_every_pattern(dtype, cache, dim):
    heads = 4
    k = every_pattern(dtype, heads, dim)
    v = k.flip(0)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(1))[:n]
    shape = (-(-(n + 8) // 16), 16, heads, dim)
    # per-head scales: ordinary, tiny, an fp32 subnormal, huge
    ks = torch.tensor([0.37, 1e-30, 3e-39, 1e30])
    vs = torch.tensor(1.0)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale=ks, v_scale=vs, backend=b)

    run(call, {"k": (shape, cache), "v": (shape, cache)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cache", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("rule", ["rne", "vllm"])
def test_store_kv_dynamic_every_pattern(dtype, cache, per_head, rule):
    heads, dim = 4, 72   # 72: two 32-wide blocks and an 8-element tail
    k = every_pattern(dtype, heads, dim)
    # the dynamic scale comes from the row's finite amax: spread the magnitudes per token
    v = (k.float() * torch.logspace(-3, 3, k.shape[0])[:, None, None]).to(dtype)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(2))[:n]
    pages = -(-(n + 8) // 16)
    shape = (pages, 16, heads, dim)
    sshape = (pages, 16, heads) if per_head else (pages, 16)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale_cache=p["ks"], v_scale_cache=p["vs"],
                         quant_rule=rule, backend=b)

    run(call, {"k": (shape, cache), "v": (shape, cache), "ks": (sshape, torch.float32),
               "vs": (sshape, torch.float32)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("g", [None, 0.5, 0.0, 1e-30])   # 0: every block's scale underflows to 0
def test_store_kv_nvfp4_every_pattern(dtype, g):
    heads, dim = 4, 64
    k = every_pattern(dtype, heads, dim)
    # blocks of mixed magnitudes too: the block scale lands anywhere on the e4m3 grid
    v = (k.float() * torch.logspace(-4, 4, k.shape[0])[:, None, None]).to(dtype)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(3))[:n]
    run_store_kv_nvfp4(k, v, loc, g)


@pytest.mark.parametrize("lora,rope", [(512, 64), (40, 24)])   # 40 + 24: a block straddles both
def test_store_mla_nvfp4_every_pattern(lora, rope):
    x = every_pattern(torch.bfloat16, 1, lora + rope)[:, 0]
    kv_c, k_pe = x[:, :lora], x[:, lora:]
    n = x.shape[0]
    loc = torch.randperm(n + 4, generator=torch.Generator().manual_seed(4))[:n]
    pages = -(-(n + 4) // 16)

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype="nvfp4", scale_cache=p["s"], backend=b)

    run(call, {"c": ((pages, 16, (lora + rope) // 2), torch.uint8),
               "s": ((pages, 16, (lora + rope) // 16), torch.float8_e4m3fn)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_store_dsv4_indexer_mxfp4_every_pattern(dtype):
    from kvwrite.ops.dsv4 import indexer_row_bytes
    d, pps = 128, 64
    k = every_pattern(dtype, 1, d)[:, 0]
    k = (k.float() * torch.logspace(-6, 6, k.shape[0])[:, None]).to(dtype)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(5))[:n]
    pages = -(-(n + 8) // pps)

    def call(p, b):
        kvwrite.store_dsv4_indexer_k(k, p["c"], loc, fmt="mxfp4", backend=b)

    run(call, {"c": ((pages, pps * indexer_row_bytes(d, "mxfp4")), torch.uint8)})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_store_mla_fp8_ds_mla_every_pattern(dtype):
    x = every_pattern(torch.bfloat16, 1, 576)[:, 0].to(dtype)
    x = x * torch.logspace(-4, 4, x.shape[0], dtype=dtype)[:, None]
    kv_c, k_pe = x[:, :512], x[:, 512:]
    n = x.shape[0]
    loc = torch.randperm(n + 4, generator=torch.Generator().manual_seed(6))[:n]

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype="fp8_ds_mla", backend=b)

    run(call, {"c": ((-(-(n + 4) // 16), 16, 656), torch.uint8)})


@pytest.mark.parametrize("scale", [None, "pow2"])
def test_store_mla_fp8_ds_mla_one_multiply(scale):
    """fp8_ds_mla tiles coded by one multiply a value (fp8_ds_tiles_512, fp8_ds_recip): every bf16
    amax mantissa (the seven the table leaves to the division among them) at exponents inside the
    table's range and past both ends, the other values on the e4m3 rounding ties t * s (normal and
    subnormal) and one bf16 step either side, both signs; a token with a NaN tile, one with an inf."""
    n, tiles = 256, 4
    g = torch.Generator().manual_seed(12)
    mant = (torch.arange(n * tiles) % 128).float().reshape(n, tiles, 1)
    expo = torch.randint(-36, 52, (n, tiles, 1), generator=g).float()
    amax = ((1 + mant / 128) * 2.0 ** expo).to(torch.bfloat16).float()
    s = amax / 448
    ties = torch.cat([(2 * torch.arange(8, 16) + 1) * 2.0 ** j / 16 for j in range(-6, 9)] +
                     [(2 * torch.arange(0, 8) + 1) * 2.0 ** -10])
    t = ties[torch.randint(0, ties.numel(), (n, tiles, 128), generator=g)] * s
    bits = t.to(torch.bfloat16).view(torch.int16) + torch.randint(-1, 2, t.shape, generator=g, dtype=torch.int16)
    x = torch.minimum(bits.view(torch.bfloat16).float().abs(), amax)
    x = x * torch.where(torch.rand(x.shape, generator=g) < 0.5, -1.0, 1.0)
    x[..., 7] = amax[..., 0] * torch.where(torch.rand(n, tiles, generator=g) < 0.5, -1.0, 1.0)
    x[5, 2, 9], x[9, 1, 3] = float("nan"), float("-inf")
    kv_c = x.reshape(n, tiles * 128).to(torch.bfloat16)
    k_pe = torch.randn(n, 64, generator=g).to(torch.bfloat16)
    loc = torch.randperm(n + 4, generator=g)[:n]
    fmt = "fp8_ds_mla+pow2" if scale else "fp8_ds_mla"

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype=fmt, backend=b)

    run(call, {"c": ((-(-(n + 4) // 16), 16, 656), torch.uint8)})


# The streaming bf16 lanes (fp8_bf16_run / int8_bf16_run: x / s by a reciprocal and one FMA
# correction, the sign taken from the input): signs of the scale, the edges of their scale range
# (2^-40, 2^40) and scales that make many quotients exact ties of the fp8 / int8 grids.
@pytest.mark.parametrize("cache", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_store_kv_fp8_bf16_lanes_scales(cache):
    heads, dim = 8, 64
    k = every_pattern(torch.bfloat16, heads, dim)
    v = k.flip(0)
    n = k.shape[0]
    loc = torch.randperm(n + 8, generator=torch.Generator().manual_seed(7))[:n]
    shape = (-(-(n + 8) // 16), 16, heads, dim)
    ks = torch.tensor([-0.37, 3.0, 1 / 3, 0.125, 2.0 ** -40, 2.0 ** 40, 2.0 ** -40 * 0.99, -7e-3])
    vs = torch.tensor(-1.0 / 448)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale=ks, v_scale=vs, backend=b)

    run(call, {"k": (shape, cache), "v": (shape, cache)})


@pytest.mark.parametrize("cache", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("strided", [False, True])
def test_store_kv_dynamic_bf16_lanes(cache, per_head, strided):
    """Tokens without NaN or inf (the lanes' domain): amax a power of two times the format's max
    (s exact, so x / s lands on grid ties), random magnitudes, zeros and subnormals; one token
    with an inf and one with a NaN (the generic lanes), and one with a NaN in K alone (K by the
    generic lanes, V by the streaming ones, after both sides' scales). Strided: heads apart in
    the source (one run a head)."""
    heads, dim, n = 12, 64, 48   # 12 heads: one group of eight scales at once, four one by one
    g = torch.Generator().manual_seed(8)
    qmax = 127.0 if cache == torch.int8 else torch.finfo(cache).max
    x = torch.randn(n, heads, dim, generator=g) * torch.logspace(-30, 30, n)[:, None, None]
    ties = (torch.randint(-255, 256, (n, heads, dim), generator=g) / 2).float()   # k + 0.5 steps
    x[::3] = ties[::3] * 2.0 ** torch.randint(-8, 8, (1,), generator=g).item()
    x[::3, :, 0] = qmax * 2.0 ** -3    # the amax: s = 2^-3 (per token and per head)
    x[1::7, :, 5:9] = torch.tensor([0.0, -0.0, 1e-39, -1e-40])
    x[2, 1, 3] = float("inf")
    x[4, 2, 7] = float("nan")
    k = x.to(torch.bfloat16)
    v = (-x).to(torch.bfloat16)
    k[10, 3, 1] = float("nan")
    if strided:
        k, v = (torch.cat([t, t], -1)[..., :dim] for t in (k, v))
    loc = torch.randperm(n + 8, generator=g)[:n]
    pages = -(-(n + 8) // 16)
    sshape = (pages, 16, heads) if per_head else (pages, 16)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale_cache=p["ks"], v_scale_cache=p["vs"], backend=b)

    run(call, {"k": ((pages, 16, heads, dim), cache), "v": ((pages, 16, heads, dim), cache),
               "ks": (sshape, torch.float32), "vs": (sshape, torch.float32)})


@pytest.mark.parametrize("per_head", [False, True])
@pytest.mark.parametrize("dim", [64, 96])   # 96: runs that are not whole 64s (the exact lanes)
def test_store_kv_int8_half_amax(per_head, dim):
    """int8 dynamic scales with random bf16 amax mantissas (s = RN(amax / 127) inexact): x =
    +-amax / 2 (x / s within an ulp or two of 63.5) is the one tie the one-FMA lanes settle per
    scale (int8_fast_recip); with its bf16 neighbours, the amax itself, random values, scales at
    the floor (amax < 127e-6) and exact ones (amax = 254 * 2^e: s a power of two)."""
    heads, n = 12, 256   # 12 heads: eight scales at once, four one by one
    g = torch.Generator().manual_seed(11)
    rows = heads if per_head else 1
    mant = torch.randint(128, 256, (n, rows, 1), generator=g).float() / 128
    amax = (mant * 2.0 ** torch.randint(-16, 16, (n, rows, 1), generator=g).float()).to(torch.bfloat16).float()
    amax[::17] = 254.0 * 2.0 ** torch.randint(-10, 10, (1,), generator=g).item()
    x = (torch.rand(n, heads, dim, generator=g) * 2 - 1) * amax
    half = (amax / 2).to(torch.bfloat16)
    step = torch.tensor(1, dtype=torch.int16)
    x[..., 1:2] = half.float()
    x[..., 2:3] = -half.float()
    x[..., 3:4] = (half.view(torch.int16) + step).view(torch.bfloat16).float()
    x[..., 4:5] = -(half.view(torch.int16) - step).view(torch.bfloat16).float()
    x[..., 0:1] = amax * torch.where(torch.rand(n, rows, 1, generator=g) < 0.5, -1.0, 1.0)
    k = x.to(torch.bfloat16)
    v = k.flip(0)
    loc = torch.randperm(n + 8, generator=g)[:n]
    pages = -(-(n + 8) // 16)
    sshape = (pages, 16, heads) if per_head else (pages, 16)

    def call(p, b):
        kvwrite.store_kv(k, v, p["k"], p["v"], loc, k_scale_cache=p["ks"], v_scale_cache=p["vs"], backend=b)

    run(call, {"k": ((pages, 16, heads, dim), torch.int8), "v": ((pages, 16, heads, dim), torch.int8),
               "ks": (sshape, torch.float32), "vs": (sshape, torch.float32)})


# The FP4 bf16 lanes (NVFP4 blocks of 16 with e4m3 scales, MXFP4 blocks of 32 with ue8m0 scales):
# each block's amax fixes its scale d exactly (6 d for NVFP4: every e4m3 code; a power of two for
# MXFP4), the other elements sit on the e2m1 rounding thresholds B d (the ties .25 .75 1.25 1.75
# 2.5 3.5 5) and one bf16 step either side, with both signs, among zeros, bf16 subnormals and
# random values; blocks that are all zero, all subnormal, or hold a NaN or an inf; scales that
# underflow to 0. Runs of blocks that are not a multiple of the lanes' eight.
_E2M1_TIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def _bf16_neighbours(x: torch.Tensor) -> torch.Tensor:
    """x (bf16-exact fp32 values > 0) and its bf16 neighbours below and above, as fp32."""
    bits = x.to(torch.bfloat16).view(torch.int16).to(torch.int32)
    near = torch.stack([bits - 1, bits, bits + 1], -1).to(torch.int16).view(torch.bfloat16)
    return near.float().flatten()


def fp4_threshold_blocks(scales: torch.Tensor, amax_of, block: int, g: torch.Generator) -> torch.Tensor:
    """One block of `block` bf16 values per scale d: element 0 = +-amax_of(d), the rest drawn from
    the thresholds B d and their bf16 neighbours, 0, -0, bf16 subnormals and N(0, d), random signs."""
    out = []
    sub = torch.tensor([0x0001, 0x0040, 0x007F], dtype=torch.int16).view(torch.bfloat16).float()
    for d in scales.tolist():
        cand = torch.cat([_bf16_neighbours(torch.tensor(_E2M1_TIES) * d), torch.tensor([0.0, -0.0]), sub,
                          torch.randn(8, generator=g) * d])
        pick = cand[torch.randint(0, cand.numel(), (block - 1,), generator=g)]
        sign = torch.where(torch.rand(block - 1, generator=g) < 0.5, -1.0, 1.0)
        first = amax_of(d) * (1.0 if torch.rand(1, generator=g).item() < 0.5 else -1.0)
        out.append(torch.cat([torch.tensor([first]), pick * sign]))
    return torch.stack(out).to(torch.bfloat16)


def e4m3_values() -> torch.Tensor:
    """Every positive finite e4m3 value (subnormals included)."""
    v = torch.arange(1, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    return v[torch.isfinite(v)]


def fp4_special_blocks(block: int) -> torch.Tensor:
    """All zero, all -0, all bf16 subnormal, a NaN, +inf, -inf, a scale that rounds to 0, a huge
    amax (e4m3 saturates), blocks of `block` values as bf16."""
    rows = torch.zeros(8, block)
    rows[1] = -0.0
    rows[2] = torch.tensor([0x0001, 0x8040 - 0x10000], dtype=torch.int16).view(torch.bfloat16).float().repeat(block // 2)
    rows[3] = 1.0
    rows[3, 3] = float("nan")
    rows[4] = -0.5
    rows[4, 5] = float("inf")
    rows[5, 1] = -float("inf")
    rows[6] = 1e-5 * torch.linspace(-1, 1, block)   # amax / 6 below e4m3's smallest step: d = 0
    rows[7] = 3e38 * torch.linspace(-1, 1, block)
    return rows.to(torch.bfloat16)


@pytest.mark.parametrize("heads,dim", [(5, 48), (1, 16), (3, 80), (8, 128)])
@pytest.mark.parametrize("strided", [False, True])
def test_store_kv_nvfp4_bf16_lanes_thresholds(heads, dim, strided):
    g = torch.Generator().manual_seed(9)
    d = e4m3_values()
    blocks = torch.cat([fp4_threshold_blocks(d, lambda s: 6 * s, 16, g), fp4_special_blocks(16)])
    per_token = heads * dim // 16
    n = -(-blocks.shape[0] // per_token)
    rows = torch.cat([blocks, blocks[: n * per_token - blocks.shape[0]]]).reshape(n, heads, dim)
    if strided:   # heads not contiguous: runs of dim / 16 blocks a head
        rows = torch.cat([rows, rows], -1)[..., :dim]
    run_store_kv_nvfp4(rows, rows.flip(0), torch.randperm(n + 8, generator=g)[:n])


@pytest.mark.parametrize("lora,rope", [(512, 64), (48, 16)])
def test_store_mla_nvfp4_bf16_lanes_thresholds(lora, rope):
    g = torch.Generator().manual_seed(10)
    blocks = torch.cat([fp4_threshold_blocks(e4m3_values(), lambda s: 6 * s, 16, g), fp4_special_blocks(16)])
    per_token = (lora + rope) // 16
    n = -(-blocks.shape[0] // per_token)
    x = torch.cat([blocks, blocks[: n * per_token - blocks.shape[0]]]).reshape(n, lora + rope)
    kv_c, k_pe = x[:, :lora], x[:, lora:]
    loc = torch.randperm(n + 4, generator=g)[:n]
    pages = -(-(n + 4) // 16)

    def call(p, b):
        kvwrite.store_mla(kv_c, k_pe, p["c"], loc, kv_cache_dtype="nvfp4", scale_cache=p["s"], backend=b)

    run(call, {"c": ((pages, 16, (lora + rope) // 2), torch.uint8),
               "s": ((pages, 16, (lora + rope) // 16), torch.float8_e4m3fn)})


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_v41", "mxfp4"])
def test_store_dsv4_fp4_bf16_lanes_thresholds(fmt):
    """The V4 records: 28 NVFP4 blocks (three groups of eight and four), V4.1's 32 (scale floored
    at 2^-9), 14 MXFP4 blocks (eight and six); MXFP4 amax 2^j: scale 2^(j - 1), every exponent
    byte the lanes take and the ones they leave to the scalar rule."""
    from kvwrite.facts import FP4_RECORDS
    rec = FP4_RECORDS[fmt]
    g = torch.Generator().manual_seed(11)
    if fmt == "mxfp4":
        scales = 2.0 ** torch.arange(-110, 120, 3, dtype=torch.float64)
        blocks = fp4_threshold_blocks(scales.float(), lambda s: 8 * s, 32, g)
    else:
        blocks = fp4_threshold_blocks(e4m3_values(), lambda s: 6 * s, 16, g)
    blocks = torch.cat([blocks, fp4_special_blocks(rec.block)])
    per_token = rec.quant // rec.block
    n = -(-blocks.shape[0] // per_token)
    quant = torch.cat([blocks, blocks[: n * per_token - blocks.shape[0]]]).reshape(n, rec.quant)
    kv = torch.cat([quant, torch.randn(n, 512 - rec.quant, generator=g).to(torch.bfloat16)], 1)
    loc = torch.randperm(n + 4, generator=g)[:n]
    pages = n + 4

    def call(p, b):
        kvwrite.store_dsv4_kv_fp4(kv, p["c"], loc, fmt=fmt, backend=b)

    run(call, {"c": ((pages, rec.token_bytes), torch.uint8)})


def fp4_arith_blocks(dtype: torch.dtype, glob: float | None, g: torch.Generator) -> torch.Tensor:
    """Blocks of 16 for the arithmetic NVFP4 lanes (a global scale, fp16 / fp32 rows): per e4m3
    value v the block amax 6 v g and the ties B RN(v g) as `dtype` with their `dtype` neighbours
    (one unit of the last place either side), 0, -0, subnormals; then the special blocks."""
    gs = 1.0 if glob is None else glob
    ibits = torch.int32 if dtype == torch.float32 else torch.int16
    sub = torch.tensor([1, 0x40, 0x7F], dtype=ibits).view(dtype).float()
    out = []
    for d in e4m3_values().tolist():
        dd = torch.tensor(d, dtype=torch.float32) * torch.tensor(gs, dtype=torch.float32)
        ties = (torch.tensor(_E2M1_TIES) * dd).to(dtype).view(ibits).to(torch.int64)
        near = torch.stack([ties - 1, ties, ties + 1], -1).to(ibits).view(dtype).float().flatten()
        cand = torch.cat([near, torch.tensor([0.0, -0.0]), sub])
        pick = cand[torch.randint(0, cand.numel(), (15,), generator=g)]
        sign = torch.where(torch.rand(15, generator=g) < 0.5, -1.0, 1.0)
        out.append(torch.cat([(6 * dd).reshape(1), pick * sign]))
    specials = fp4_special_blocks(16).float()
    specials[2] = sub.repeat(6)[:16]   # subnormals of the row's own type (fp32: read as +-0)
    return torch.cat([torch.stack(out), specials]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("glob", [None, 0.37, 1e-30, 3e38, 1e-40])   # 3e38: d overflows, 1e-40: subnormal g
@pytest.mark.parametrize("heads,dim", [(5, 48), (3, 80), (8, 128)])
def test_store_kv_nvfp4_arith_lanes_thresholds(dtype, glob, heads, dim):
    """The AVX-512 arithmetic NVFP4 lanes (sixteen blocks a group; groups they decline go to the
    AVX2 lanes): ties and neighbours for every e4m3 scale, specials, runs of 15 / 64 blocks a
    token and 3 / 5 a head (strided v), with and without a global scale."""
    g = torch.Generator().manual_seed(12)
    blocks = fp4_arith_blocks(dtype, glob, g)
    per_token = heads * dim // 16
    n = -(-blocks.shape[0] // per_token)
    k = torch.cat([blocks, blocks[: n * per_token - blocks.shape[0]]]).reshape(n, heads, dim)
    v = torch.cat([k, k], -1)[..., :dim].flip(0)   # heads not contiguous
    run_store_kv_nvfp4(k, v, torch.randperm(n + 8, generator=g)[:n], glob)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("glob", [None, 0.37])
def test_store_mla_nvfp4_arith_lanes_thresholds(dtype, glob):
    """store_mla nvfp4 by the arithmetic lanes: 32 blocks of kv_c and 4 of k_pe a token."""
    g = torch.Generator().manual_seed(13)
    blocks = fp4_arith_blocks(dtype, glob, g)
    n = -(-blocks.shape[0] // 36)
    x = torch.cat([blocks, blocks[: n * 36 - blocks.shape[0]]]).reshape(n, 576)
    loc = torch.randperm(n + 4, generator=g)[:n]
    pages = -(-(n + 4) // 16)
    gt = None if glob is None else torch.tensor([glob])

    def call(p, b):
        kvwrite.store_mla(x[:, :512], x[:, 512:], p["c"], loc, kv_cache_dtype="nvfp4", scale_cache=p["s"],
                          global_scale=gt, backend=b)

    run(call, {"c": ((pages, 16, 288), torch.uint8), "s": ((pages, 16, 36), torch.float8_e4m3fn)})


@pytest.mark.parametrize("d", [128, 64])
def test_store_dsv4_indexer_mxfp4_lanes_thresholds(d):
    """The V4 indexer's MXFP4 rows (scale max(amax, 1e-4) / 6 rounded up to a power of two): amax
    6 s (the scale s itself) and 4 s for s = 2^j, ties B s and their bf16 neighbours, the specials
    (NaN / inf blocks left to the scalar rule), scales under the 1e-4 floor; 4 / 2 blocks a row."""
    from kvwrite.ops.dsv4 import indexer_row_bytes
    g = torch.Generator().manual_seed(14)
    scales = (2.0 ** torch.arange(-20, 124, 1, dtype=torch.float64)).float()
    blocks = torch.cat([fp4_threshold_blocks(scales, lambda s: 6 * s, 32, g),
                        fp4_threshold_blocks(scales, lambda s: 4 * s, 32, g), fp4_special_blocks(32)])
    per_token = d // 32
    n = -(-blocks.shape[0] // per_token)
    k = torch.cat([blocks, blocks[: n * per_token - blocks.shape[0]]]).reshape(n, d)
    loc = torch.randperm(n + 8, generator=g)[:n]
    pages = -(-(n + 8) // 64)

    def call(p, b):
        kvwrite.store_dsv4_indexer_k(k, p["c"], loc, fmt="mxfp4", backend=b)

    run(call, {"c": ((pages, 64 * indexer_row_bytes(d, "mxfp4")), torch.uint8)})


@pytest.mark.parametrize("nb", [4, 17, 20, 28, 31, 33, 48])
def test_store_kv_nvfp4_bf16_lanes_run_tails(nb):
    """Runs of nb blocks (one head of 16 nb): the AVX-512 lanes end a run of 16 blocks or more with
    the group of its last 16 (blocks shared with the group before written twice); the threshold and
    special blocks shuffled over every position, then N(0, 1) rows (every scale code normal: the
    table path) with a NaN at every block position in turn."""
    g = torch.Generator().manual_seed(12)
    blocks = torch.cat([fp4_threshold_blocks(e4m3_values(), lambda s: 6 * s, 16, g), fp4_special_blocks(16)])
    blocks = blocks[torch.randperm(blocks.shape[0], generator=g)]
    n = -(-blocks.shape[0] // nb)
    rows = torch.cat([blocks, blocks[: n * nb - blocks.shape[0]]]).reshape(n, 1, 16 * nb)
    run_store_kv_nvfp4(rows, rows.flip(0), torch.randperm(n + 8, generator=g)[:n])
    rows = torch.randn(nb, 1, 16 * nb, generator=g).to(torch.bfloat16)
    for t in range(nb):
        rows[t, 0, 16 * t + 5] = float("nan")
    run_store_kv_nvfp4(rows, rows.flip(0), torch.randperm(nb + 8, generator=g)[:nb])


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_v41", "mxfp4"])
def test_store_dsv4_fp4_bf16_lanes_nan_positions(fmt):
    """The V4 records (28 / 32 NVFP4 blocks, 14 MXFP4: groups that share blocks) of N(0, 1) rows
    with a NaN or an inf at every block position in turn."""
    from kvwrite.facts import FP4_RECORDS
    rec = FP4_RECORDS[fmt]
    nb = rec.quant // rec.block
    g = torch.Generator().manual_seed(13)
    kv = torch.randn(2 * nb, 512, generator=g).to(torch.bfloat16)
    for t in range(2 * nb):
        kv[t, rec.block * (t % nb) + 3] = float("nan") if t < nb else float("inf")
    loc = torch.randperm(2 * nb + 4, generator=g)[: 2 * nb]

    def call(p, b):
        kvwrite.store_dsv4_kv_fp4(kv, p["c"], loc, fmt=fmt, backend=b)

    run(call, {"c": ((2 * nb + 4, rec.token_bytes), torch.uint8)})


@pytest.mark.parametrize("fmt", ["nvfp4", "nvfp4_v41", "mxfp4"])
def test_store_dsv4_fp4_bf16_lanes_group_paths(fmt):
    """The V4 records by one call a token (NVFP4 groups of 16 and 12 / 16, MXFP4 8 and 6): one
    block at every position in turn zero, tiny (1e-30: an e4m3 scale below the table's range) or
    huge (1e30: saturated), so each group alone leaves the table / lane path while the other keeps
    it; whole rows scaled by 2^-120 .. 2^120; the scale rows' padding left as it was (canaries)."""
    from kvwrite.facts import FP4_RECORDS
    rec = FP4_RECORDS[fmt]
    nb = rec.quant // rec.block
    g = torch.Generator().manual_seed(17)
    factors = [0.0, 1e-30, 1e30]
    kv = torch.randn(len(factors) * nb + 16, 512, generator=g)
    for k, f in enumerate(factors):
        for b in range(nb):
            kv[k * nb + b, rec.block * b: rec.block * (b + 1)] *= f
    kv[len(factors) * nb:] *= (2.0 ** torch.arange(-120, 120, 15, dtype=torch.float64)).float()[:, None]
    kv = kv.to(torch.bfloat16)
    n = kv.shape[0]
    loc = torch.randperm(n + 4, generator=g)[:n]

    def call(p, b):
        kvwrite.store_dsv4_kv_fp4(kv, p["c"], loc, fmt=fmt, backend=b)

    run(call, {"c": ((n + 4, rec.token_bytes), torch.uint8)})


def test_simd_check_bf16_lanes_exhaustive(tmp_path) -> None:
    """bench/simd_check.cpp in its bf16 mode: the SIMD lanes against their scalar rules over every
    bf16 input (fp8 / int8 / fp8_ds_mla / power-of-two e4m3 / NVFP4 / MXFP4 lanes, the scale rules):
    compiled here with the host compiler, it exits non-zero when any byte differs."""
    import platform
    import shutil
    import subprocess
    from pathlib import Path

    cxx = shutil.which("g++")
    if cxx is None or platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("needs g++ on x86-64")
    src = Path(__file__).resolve().parent.parent / "bench" / "simd_check.cpp"
    exe = tmp_path / "simd_check"
    subprocess.run([cxx, "-O2", "-ffp-contract=off", "-fno-trapping-math", "-std=c++17", "-w", str(src), "-o", str(exe)],
                   check=True, capture_output=True, timeout=600)
    out = subprocess.run([str(exe), "bf16"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:]
    assert "portable loops" in out.stdout or " differ" in out.stdout   # the checks ran (or no SIMD level)
