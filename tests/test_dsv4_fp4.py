"""DeepSeek V4 FP4 KV records (`store_dsv4_kv_fp4`): every backend against the torch reference
(bytes, canaries, records), each record decoded by byte offsets written out here from the
engines' layouts (an independent decoder), the engines' rounding rules restated per value, the
special values, page-granular DCP, bad locs in assert and guard, bad arguments."""
from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.facts import FP4_RECORDS
from test_dsv4 import locs_for, values
from test_store_kv import bad_loc_cases

FMTS = tuple(FP4_RECORDS)
FLOATS = (torch.float32, torch.float16, torch.bfloat16)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def page_bytes(fmt: str, pps: int) -> int:
    return pps * FP4_RECORDS[fmt].token_bytes


def store(backend, cache, kv, loc, fmt, **kw):
    kvwrite.store_dsv4_kv_fp4(kv, cache, loc, fmt=fmt, backend=backend, **kw)


# --- every backend == reference ------------------------------------------------------------------

@st.composite
def cases(draw):
    return dict(dtype=draw(st.sampled_from(FLOATS)), pps=draw(st.sampled_from([1, 2, 4, 64])),
                pages=draw(st.integers(1, 3)), n=draw(st.integers(0, 10)),
                dcp=draw(st.sampled_from([(0, 1), (1, 2)])), loc_map=draw(st.booleans()),
                check=draw(st.sampled_from(["off", "assert", "guard"])),
                loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FMTS)
@given(c=cases())
def test_matches_reference(backend, fmt, c):
    gen = torch.Generator().manual_seed(c["seed"])
    rank, size = c["dcp"]
    capacity = c["pages"] * c["pps"] * size
    n = min(c["n"], capacity)
    x = values(n, 512 + (16 if c["strided"] else 0), c["dtype"], gen)
    x = x[:, 8:520] if c["strided"] else x
    kw = dict(check=c["check"], dcp_rank=rank, dcp_size=size, page_size=c["pps"])
    if c["loc_map"]:
        m = torch.full((2 * capacity,), -1, dtype=torch.int64)
        m[torch.randperm(2 * capacity, generator=gen)[:capacity]] = torch.randperm(capacity, generator=gen)
        kw["loc_map"] = m.to(DEVICE)
        capacity *= 2
    loc = locs_for(n, capacity, gen, 0.2).to(c["loc_dtype"]).to(DEVICE)
    pool = CanaryBuffer({"cache": ((c["pages"], page_bytes(fmt, c["pps"])), torch.uint8)}, c["seed"])
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    store(backend, pool["cache"], x, loc, fmt, errors=errs, **kw)
    store("torch", ref["cache"], x, loc, fmt, errors=ref_errs, **kw)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


# --- each record decoded by byte offsets -----------------------------------------------------------

def e4m3_value(b: int) -> float:
    if b & 0x7F == 0x7F:
        return math.nan
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


def e2m1_rne(y: float) -> int:
    """e2m1 code of y: the nearest magnitude, a tie to the even code, saturating at 6."""
    a = min(abs(y), 6.0)
    best = min(range(8), key=lambda c: (abs(E2M1[c] - a), c & 1))
    return best | (8 if math.copysign(1.0, y) < 0 else 0)


def e4m3_rne(s: float) -> int:
    """The e4m3 code of s >= 0 nearest (ties to the even code), saturating at 448."""
    return min(range(0x7F), key=lambda c: (abs(e4m3_value(c) - s), c & 1))


def layout(fmt: str, pps: int, o: int) -> dict:
    """Byte offsets of token o of a page, from the engines' layouts (not from kvwrite.facts)."""
    if fmt == "nvfp4":      # FlashInfer: [pps x (224 e2m1 + 128 bf16)] [pps x (28 e4m3 + 4 pad)]
        return dict(data=o * 352, rope=o * 352 + 224, scales=pps * 352 + o * 32, nscales=28, pad=4, block=16, n=448)
    if fmt == "nvfp4_v41":  # FlashMLA V41_FP4: [pps x 256 e2m1] [pps x 32 e4m3]
        return dict(data=o * 256, rope=None, scales=pps * 256 + o * 32, nscales=32, pad=0, block=16, n=512)
    return dict(data=o * 368, scales=o * 368 + 224, rope=o * 368 + 240, nscales=14, pad=2, block=32, n=448)  # SGLang


def expected_block(x: list[float], fmt: str) -> tuple[int, float]:
    """(scale byte, decoded scale) of a block per the engine's rule, restated in Python floats."""
    amax = max(abs(v) for v in x)
    if fmt == "mxfp4":       # SGLang: byte = round(log2(amax) - log2(6)) + 127, clamped to [0, 255]
        byte = min(max(round(math.log2(max(amax, 1e-40)) - math.log2(6)) + 127, 0), 255)
        return byte, 2.0 ** (byte - 127)
    s = amax / 6 if fmt == "nvfp4" else max(amax / 6, 2.0 ** -9)   # FlashMLA V41 floors at 2^-9
    code = e4m3_rne(s)
    return code, e4m3_value(code)


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("fmt", FMTS)
def test_record_by_byte_offsets(backend, fmt):
    pps, pages = 4, 3
    gen = torch.Generator().manual_seed(5)
    kv = (torch.randn(3, 512, generator=gen) * 3).to(torch.bfloat16)
    kv[1, :64] = 0.0
    kv[2, 32:48] = 1e-6                  # a tiny block (v41: the 2^-9 floor)
    loc = [9, -1, 2]
    pool = CanaryBuffer({"cache": ((pages, page_bytes(fmt, pps)), torch.uint8)}, 11)
    original = pool.raw.clone()
    store(backend, pool["cache"], kv.to(DEVICE), torch.tensor(loc, device=DEVICE), fmt, page_size=pps)
    cache = pool["cache"].cpu()
    off = pool.offsets["cache"]
    before = original[off:off + cache.numel()].view(cache.shape)
    written = torch.zeros_like(cache, dtype=torch.bool)
    for i, l in enumerate(loc):
        if l < 0:
            continue
        page, o = divmod(l, pps)
        lay = layout(fmt, pps, o)
        row = kv[i].float().tolist()
        blk = lay["block"]
        for b in range(lay["nscales"]):
            x = row[b * blk:(b + 1) * blk]
            byte, d = expected_block(x, fmt)
            assert int(cache[page, lay["scales"] + b]) == byte, (fmt, i, b)
            for j in range(blk // 2):
                at = lay["data"] + b * blk // 2 + j
                want = e2m1_rne(x[2 * j] / d) | (e2m1_rne(x[2 * j + 1] / d) << 4) if d else None
                if want is not None:
                    assert int(cache[page, at]) == want, (fmt, i, b, j)
                written[page, at] = True
            written[page, lay["scales"] + b] = True
        if lay["rope"] is not None:
            rope = cache[page, lay["rope"]:lay["rope"] + 128].contiguous().view(torch.bfloat16)
            assert torch.equal(rope, kv[i, 448:])
            written[page, lay["rope"]:lay["rope"] + 128] = True
    assert torch.equal(cache[~written], before[~written])          # pad bytes and other rows kept
    assert not bool((pool.raw != original)[pool.canary_mask()].any())


@pytest.mark.parametrize("fmt", FMTS)
def test_dequant_within_bound(fmt):
    """Each decoded value is within half the e2m1 spacing of its block step d (d * h(|x'| / d),
    h = 1/4 below 2, 1/2 below 4, 1 above), or is +-6 d where |x| > 6 d (ue8m0 rounds log2(amax /
    6) to nearest: amax up to 6 sqrt(2) d saturates); RoPE exact in bf16; loc -1 reads zeros."""
    from kvwrite.reference.dsv4_fp4 import byte_value, regions

    gen = torch.Generator().manual_seed(2)
    n = 32
    kv = torch.randn(n, 512, generator=gen) * torch.exp2(torch.randint(-8, 8, (n, 1), generator=gen).float())
    cache = torch.zeros(n // 8, page_bytes(fmt, 8), dtype=torch.uint8)
    loc = torch.randperm(n, generator=gen)
    kvwrite.store_dsv4_kv_fp4(kv, cache, loc, fmt=fmt, backend="torch")
    got = kvwrite.dequant_dsv4_kv_fp4(cache, loc, fmt=fmt)
    rec = FP4_RECORDS[fmt]
    _, scales, _ = regions(cache, 8, rec)
    sb = scales.reshape(-1, rec.scale_row)[loc, :rec.blocks]
    d = (byte_value(sb) if rec.scale == "ue8m0" else sb.contiguous().view(torch.float8_e4m3fn).float())
    d = d.repeat_interleave(rec.block, -1)
    x, xq = kv[:, :rec.quant], got[:, :rec.quant]
    m = xq.abs() / d
    h = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0))
    clipped = x.abs() > 6 * d
    assert bool(((x - xq).abs() <= d * h)[~clipped].all())
    assert bool((xq[clipped] == torch.copysign(6 * d[clipped], x[clipped])).all())
    # e4m3 steps of normal scales (>= 2**-6) are within 1/16 of amax / 6
    assert fmt == "mxfp4" or not bool((clipped & (x.abs() > 6.375 * d) & (d >= 2**-6)).any())
    assert bool((got[:, rec.quant:] == kv[:, rec.quant:].bfloat16().float()).all())
    assert bool((kvwrite.dequant_dsv4_kv_fp4(cache, torch.tensor([-1]), fmt=fmt) == 0).all())


# --- special values --------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("fmt", FMTS)
def test_special_values(backend, fmt):
    rec = FP4_RECORDS[fmt]
    kv = torch.ones(1, 512)
    kv[0, 0] = float("nan")                   # block 0: code 0, scale NaN
    kv[0, rec.block] = float("inf")           # block 1: +6, scale from the finite values (1)
    kv[0, 2 * rec.block + 1] = -float("inf")
    kv[0, 3 * rec.block:4 * rec.block] = -0.0  # block 3: all -0
    kv[0, 4 * rec.block] = 1e-40              # fp32 subnormal: read as +0
    cache = torch.zeros(1, page_bytes(fmt, 1), dtype=torch.uint8, device=DEVICE)
    store(backend, cache, kv.to(DEVICE), torch.tensor([0], device=DEVICE), fmt)
    cache = cache.cpu()
    lay = layout(fmt, 1, 0)
    sc = cache[0, lay["scales"]:lay["scales"] + lay["nscales"]].tolist()
    data = cache[0, lay["data"]:lay["data"] + rec.quant // 2].tolist()
    nan_scale = 0xFF if fmt == "mxfp4" else 0x7F
    assert sc[0] == nan_scale and data[0] & 0xF == 0
    one_scale = expected_block([1.0] * rec.block, fmt)[0]
    assert sc[1] == one_scale and sc[2] == one_scale
    half = rec.block // 2
    assert data[half] & 0xF == 7 and data[2 * half] >> 4 == 0xF        # +6 and -6
    assert all(b == 0x88 for b in data[3 * half:4 * half])             # -0 codes
    assert data[4 * half] & 0xF == 0                                  # subnormal -> +0


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_mxfp4_scale_steps_at_the_exact_boundary(backend):
    """mxfp4's ue8m0 byte round(log2(amax / 6)) + 127 is decided exactly: it steps between the two
    fp32 neighbours of 6 sqrt(2) 2^e. SGLang's PyTorch reference rounds an fp32 log2 and moves the
    step by a few ulps (its Triton kernel does not): bench/peers/dsv4_fp4_diff.py counts them."""
    from fractions import Fraction

    amax, want = [], []
    for e in (-20, 0, 13):
        bits = torch.tensor(6 * 2 ** 0.5 * 2.0 ** e).view(torch.int32) + torch.arange(-2, 3, dtype=torch.int32)
        for x in bits.view(torch.float32).tolist():
            amax.append(x)
            want.append(127 + e + int(Fraction(x) ** 2 >= 72 * Fraction(4) ** e))
    assert len(set(want)) == 6                                  # both sides of each step
    kv = torch.zeros(len(amax), 512)
    kv[:, 0] = torch.tensor(amax)
    cache = torch.zeros(len(amax), page_bytes("mxfp4", 1), dtype=torch.uint8, device=DEVICE)
    store(backend, cache, kv.to(DEVICE), torch.arange(len(amax), device=DEVICE), "mxfp4")
    assert cache.cpu()[:, layout("mxfp4", 1, 0)["scales"]].tolist() == want


# --- DCP: page p on rank p % dcp_size as local page p // dcp_size ---------------------------------

@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("fmt", FMTS)
def test_dcp_shards_whole_pages(backend, fmt):
    pps, local_pages, size = 4, 3, 2
    gen = torch.Generator().manual_seed(9)
    x = values(16, 512, torch.bfloat16, gen)
    loc = locs_for(16, local_pages * size * pps, gen, 0.1).to(DEVICE)
    whole = torch.zeros(local_pages * size, page_bytes(fmt, pps), dtype=torch.uint8, device=DEVICE)
    store("torch", whole, x, loc, fmt)
    for rank in range(size):
        mine = torch.zeros(local_pages, page_bytes(fmt, pps), dtype=torch.uint8, device=DEVICE)
        store(backend, mine, x, loc, fmt, dcp_rank=rank, dcp_size=size, check="guard",
              errors=kvwrite.ErrorBuffer(DEVICE))
        assert torch.equal(mine, whole[rank::size]), rank


# --- bad locs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("fmt", FMTS)
@pytest.mark.parametrize("case", ["beyond", "allocator_tail", "negative", "mixed"])
def test_out_of_range_guard_and_assert(backend, fmt, case):
    pps, num_pages = 4, 4
    capacity = num_pages * pps
    loc_list = bad_loc_cases(capacity, pps)[case]
    loc = torch.tensor(loc_list, device=DEVICE)
    x = values(len(loc_list), 512, torch.float32, torch.Generator().manual_seed(1))
    bad = [i for i, l in enumerate(loc_list) if l != -1 and not 0 <= l < capacity]
    spec = {"cache": ((num_pages, page_bytes(fmt, pps)), torch.uint8)}
    pool = CanaryBuffer(spec, 7)
    original = pool.raw.clone()
    good_only = pool.clone()
    keep = torch.tensor([l if i not in bad else -1 for i, l in enumerate(loc_list)], device=DEVICE)
    store("torch", good_only["cache"], x, keep, fmt)
    errs = kvwrite.ErrorBuffer(DEVICE)
    store(backend, pool["cache"], x, loc, fmt, check="guard", errors=errs)
    assert_same_bytes(pool, good_only, original)
    err = errs.error()
    first = bad[0]
    assert (err.op, err.token_index, err.loc, err.count) == ("store_dsv4_kv_fp4", first, loc_list[first], len(bad))
    assert err.pool_page_size == pps and err.page == loc_list[first] // pps
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context
    pool = CanaryBuffer(spec, 7)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="store_dsv4_kv_fp4") as info:
        store(backend, pool["cache"], x, loc, fmt, check="assert")
    assert info.value.token_index == first and info.value.loc == loc_list[first]
    assert torch.equal(pool.raw, original)


BAD = [
    (dict(kv=torch.randn(2, 511)), ValueError, r"kv must have shape \[2, 512\]"),
    (dict(kv=torch.randn(2, 512).to(torch.int32)), TypeError, "kv must have dtype"),
    (dict(cache=torch.zeros(3, 1537, dtype=torch.uint8)), ValueError, "not a whole number of 'nvfp4' records of 384"),
    (dict(page_size=8), ValueError, r"page_size \* 384 = 3072 bytes"),
    (dict(fmt="nvfp8"), ValueError, "fmt must be one of"),
    (dict(fmt="mxfp4"), ValueError, "'mxfp4' records of 368"),
    (dict(cache=torch.zeros(3, 1536)), TypeError, "cache must have dtype"),
    (dict(loc=torch.tensor([0])), ValueError, "loc must have one entry per token"),
    (dict(dcp_size=0), ValueError, "dcp_size must be"),
    (dict(check="strict"), ValueError, "check must be one of"),
]


@pytest.mark.parametrize("over, exc, msg", BAD, ids=[m for _, _, m in BAD])
@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_bad_arguments_raise_named_errors(over, exc, msg, backend):
    a = dict(kv=torch.randn(2, 512), cache=torch.zeros(3, 1536, dtype=torch.uint8), loc=torch.tensor([0, 5]))
    a.update(over)
    kw = {k: v for k, v in a.items() if k not in ("kv", "cache", "loc")}
    before = a["cache"].clone()
    with pytest.raises(exc, match=msg):
        kvwrite.store_dsv4_kv_fp4(a["kv"], a["cache"], a["loc"], backend=backend, **kw)
    assert torch.equal(before, a["cache"])


def test_dequant_bad_arguments():
    with pytest.raises(ValueError, match="fmt must be one of"):
        kvwrite.dequant_dsv4_kv_fp4(torch.zeros(1, 384, dtype=torch.uint8), torch.tensor([0]), fmt="fp8")
    with pytest.raises(TypeError, match="uint8"):
        kvwrite.dequant_dsv4_kv_fp4(torch.zeros(1, 384), torch.tensor([0]))
    with pytest.raises(IndexError, match="outside"):
        kvwrite.dequant_dsv4_kv_fp4(torch.zeros(1, 384, dtype=torch.uint8), torch.tensor([1]))


# --- rope_store_dsv4_kv_fp4: the fused GPT-J RoPE ------------------------------------------------

ROPE_FMTS = ("nvfp4", "mxfp4")


def rope_inputs(n, dtype, cs_dtype, max_pos, seed):
    gen = torch.Generator().manual_seed(seed)
    kv = values(n, 512, dtype, gen)
    cos_sin = torch.randn(max_pos, 64, generator=gen).to(cs_dtype).to(DEVICE)
    q = torch.randn(n, 2, 64, generator=gen).to(dtype).to(DEVICE)
    return kv, cos_sin, q


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", ROPE_FMTS)
@pytest.mark.parametrize("dtype, cs_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16),
                                             (torch.float32, torch.float32)])
@pytest.mark.parametrize("check", ["off", "guard"])
def test_rope_matches_reference_and_rope_then_store(backend, fmt, dtype, cs_dtype, check):
    """Bytes, q and the record equal the reference's; the written rows equal `store_dsv4_kv_fp4`
    of the rows rotated in torch (kvwrite.reference.rope), i.e. rope-then-store, bit for bit."""
    from kvwrite.reference.rope import rope

    n, pps, pages, max_pos = 9, 4, 3, 16
    kv, cos_sin, q = rope_inputs(n, dtype, cs_dtype, max_pos, 3)
    positions = torch.tensor([0, 3, 15, 7, 16, 2, -1, 9, 1], device=DEVICE)   # 16, -1: bad positions
    loc = torch.tensor([0, 5, 11, -1, 3, 7, 8, 2, 1], device=DEVICE)
    spec = {"cache": ((pages, page_bytes(fmt, pps)), torch.uint8)}
    pool = CanaryBuffer(spec, 4)
    ref, original = pool.clone(), pool.raw.clone()
    results = []
    for be, buf in ((backend, pool), ("torch", ref)):
        qq = q.clone()
        errs = kvwrite.ErrorBuffer(DEVICE)
        kvwrite.rope_store_dsv4_kv_fp4(positions, kv, cos_sin, buf["cache"], loc, q=qq, fmt=fmt, check=check,
                                       errors=errs, backend=be)
        results.append((qq, errs.error()))
    assert_same_bytes(pool, ref, original)
    assert torch.equal(results[0][0], results[1][0])
    ok = (positions >= 0) & (positions < max_pos)
    assert not torch.equal(results[0][0][ok], q[ok]) and torch.equal(results[0][0][~ok], q[~ok])
    if check == "guard":
        e0, e1 = results[0][1], results[1][1]
        assert (e0.token_index, e0.count) == (e1.token_index, e1.count) == (4, 2)
    # rope in torch, then the plain store, on the tokens with a valid position
    good = ok & (loc >= 0)
    rolled = kv.clone()
    rolled[good, 448:] = rope(kv[good][:, None, 448:], positions[good], cos_sin, 64, False)[:, 0]
    keep = torch.where(good, loc, torch.full_like(loc, -1))
    twin = pool.clone()
    twin.raw.copy_(original)
    kvwrite.store_dsv4_kv_fp4(rolled, twin["cache"], keep, fmt=fmt, backend="torch")
    assert torch.equal(pool["cache"], twin["cache"])


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_rope_bad_position_assert(backend):
    kv, cos_sin, q = rope_inputs(4, torch.bfloat16, torch.float32, 8, 1)
    cache = torch.zeros(2, page_bytes("nvfp4", 4), dtype=torch.uint8, device=DEVICE)
    before, q0 = cache.clone(), q.clone()
    positions = torch.tensor([1, 2, 8, 3], device=DEVICE)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="rope_store_dsv4_kv_fp4") as info:
        kvwrite.rope_store_dsv4_kv_fp4(positions, kv, cos_sin, cache, torch.arange(4, device=DEVICE), q=q,
                                       check="assert", backend=backend)
    assert info.value.token_index == 2
    assert torch.equal(cache, before) and torch.equal(q, q0)


def test_rope_bad_arguments():
    kv, cos_sin, q = rope_inputs(2, torch.bfloat16, torch.float32, 8, 1)
    cache = torch.zeros(2, 4 * 384, dtype=torch.uint8)
    pos, loc = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="fused RoPE store takes fmt in"):
        kvwrite.rope_store_dsv4_kv_fp4(pos, kv, cos_sin, torch.zeros(2, 4 * 288, dtype=torch.uint8), loc,
                                       fmt="nvfp4_v41")
    with pytest.raises(ValueError, match=r"cos_sin must have shape \[\*, 64\] \(max_position"):
        kvwrite.rope_store_dsv4_kv_fp4(pos, kv, cos_sin[:, :32], cache, loc)
    with pytest.raises(TypeError, match="q must have dtype"):
        kvwrite.rope_store_dsv4_kv_fp4(pos, kv, cos_sin, cache, loc, q=q.float())
    with pytest.raises(ValueError, match=r"positions must have shape \[2\]|kv must have shape \[3, 512\]"):
        kvwrite.rope_store_dsv4_kv_fp4(torch.tensor([0, 1, 2]), kv, cos_sin, cache, loc)
