"""store_mla: every backend against the torch reference (concat, per-tensor fp8, fp8_ds_mla),
canaries around every cache, out-of-range locs, the DeepSeek row format, bad arguments."""
from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite.ops.mla import FORMATS, MODE_DS_MLA, ds_mla_row_bytes
from test_store_kv import bad_loc_cases

TINY = torch.finfo(torch.float32).tiny
FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def make_pool(fmt, dtype, num_pages, pps, lora, rope, seed):
    f = FORMATS[fmt]
    return CanaryBuffer({"kv_cache": ((num_pages, pps, f.row_width(lora, rope)), f.cache_dtype(dtype))}, seed)


def run_store(backend, pool, kv_c, k_pe, loc, fmt="auto", scale=None, check="off", errors=None, **kw):
    kvwrite.store_mla(kv_c, k_pe, pool["kv_cache"], loc, kv_cache_dtype=fmt, scale=scale,
                      check=check, errors=errors, backend=backend, **kw)


def projection(n, lora, rope, dtype, gen, strided, spread=4.0):
    """kv_c [n, L] and k_pe [n, R]: contiguous, or slices of one wider projection output."""
    if not strided:
        return ((torch.randn(n, lora, generator=gen) * spread).to(dtype).to(DEVICE),
                (torch.randn(n, rope, generator=gen) * spread).to(dtype).to(DEVICE))
    # per-token magnitudes vary over decades so tiles have very different scales
    mag = torch.exp2(torch.randint(-12, 8, (n, 1), generator=gen).float())
    proj = (torch.randn(n, lora + rope + 24, generator=gen) * mag).to(dtype).to(DEVICE)
    return proj[:, 8:8 + lora], proj[:, 8 + lora + 16:]


@st.composite
def store_cases(draw, fmt):
    ds = FORMATS[fmt].mode == MODE_DS_MLA
    dtype = draw(st.sampled_from(FLOATS[1:] if fmt.endswith("+input") else FLOATS))
    dims = [(512, 64), (128, 16), (256, 7)] if ds else [(512, 64), (33, 5), (96, 16)]
    lora, rope = draw(st.sampled_from(dims))
    pps = draw(st.sampled_from([1, 16, 64]))
    num_pages = draw(st.integers(1, max(1, 320 // pps) + 1))
    capacity = num_pages * pps
    n = draw(st.sampled_from([0, 1, 7, capacity]) | st.integers(0, capacity))
    return dict(dtype=dtype, fmt=fmt, lora=lora, rope=rope, pps=pps, num_pages=num_pages,
                n=min(n, capacity), strided=draw(st.booleans()),
                scale=draw(st.sampled_from([(), (1,)])) if FORMATS[fmt].takes_scale else None,
                pad=draw(st.sampled_from([0.0, 0.25])),
                loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                route=draw(st.sampled_from(["plain", "plain", "loc_map", "dcp"])),
                check=draw(st.sampled_from(["off", "assert", "guard"])), seed=draw(st.integers(0, 2**16)))


def inputs(c):
    """(kv_c, k_pe, loc, scale, extra kwargs) of a case: locs of the pool's capacity, or of the
    virtual space a loc_map / DCP shard translates into it."""
    gen = torch.Generator().manual_seed(c["seed"])
    kv_c, k_pe = projection(c["n"], c["lora"], c["rope"], c["dtype"], gen, c["strided"])
    capacity = c["num_pages"] * c["pps"]
    kw = {}
    if c["route"] == "plain":
        loc = paged_locs(c["n"], capacity, c["pps"], gen, c["pad"], c["loc_dtype"])
    elif c["route"] == "loc_map":  # SWA: full locs [0, 2*capacity) -> pool rows (or -1)
        full = 2 * capacity
        rows = torch.full((full,), -1, dtype=torch.int64)     # injective where not -1
        rows[torch.randperm(full, generator=gen)[:capacity]] = torch.randperm(capacity, generator=gen)
        kw["loc_map"] = rows.to(torch.int32).to(DEVICE)
        loc = paged_locs(c["n"], full, c["pps"], gen, c["pad"], c["loc_dtype"])
    else:  # DCP rank 1 of 2: virtual locs [0, 2*capacity); this rank owns the odd ones
        kw.update(dcp_rank=1, dcp_size=2)
        loc = paged_locs(c["n"], 2 * capacity, c["pps"], gen, c["pad"], c["loc_dtype"])
    scale = None
    if c["scale"] is not None:
        scale = (torch.rand(c["scale"], generator=gen) * 0.5 + 0.02).to(DEVICE)
    return kv_c, k_pe, loc, scale, kw


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", [f for f in FORMATS if not FORMATS[f].takes_scale_cache])  # nvfp4: test_nvfp4.py
@given(data=st.data())
def test_store_mla_matches_reference(backend, fmt, data):
    c = data.draw(store_cases(fmt))
    kv_c, k_pe, loc, scale, kw = inputs(c)
    pool = make_pool(c["fmt"], c["dtype"], c["num_pages"], c["pps"], c["lora"], c["rope"], c["seed"])
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, kv_c, k_pe, loc, c["fmt"], scale, c["check"], errs, **kw)
    run_store("torch", ref, kv_c, k_pe, loc, c["fmt"], scale, c["check"], ref_errs, **kw)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("fmt", ["auto", "fp8_e4m3"])
def test_concat_rows_equal_store_kv_of_the_concatenation(backend, fmt):
    """"auto"/fp8 rows are store_kv's rows of concat(kv_c, k_pe) as one head, through the same
    SWA map and DCP shard: loc resolution and per-tensor quantisation are shared, not redone."""
    gen = torch.Generator().manual_seed(5)
    n, lora, rope, pps, pages = 40, 96, 16, 16, 4
    kv_c, k_pe = projection(n, lora, rope, torch.bfloat16, gen, strided=True)
    loc_map = torch.randperm(256, generator=gen).to(DEVICE) - 64   # rows < 0 after the map: padding
    loc_map = torch.where(loc_map >= 0, loc_map, -1)
    loc = paged_locs(n, 256, pps, gen, 0.2)
    scale = torch.tensor(0.3, device=DEVICE) if fmt != "auto" else None
    pool = make_pool(fmt, torch.bfloat16, pages, pps, lora, rope, 1)
    kw = dict(loc_map=loc_map, dcp_rank=0, dcp_size=3, check="guard", errors=kvwrite.ErrorBuffer(DEVICE))
    run_store(backend, pool, kv_c, k_pe, loc, fmt, scale, **kw)
    twin = pool.clone()
    rows = torch.cat([kv_c, k_pe], dim=1)[:, None]
    kc = pool.clone()["kv_cache"][:, :, None]   # scratch for V
    kvwrite.store_kv(rows, rows, twin["kv_cache"][:, :, None], kc, loc, k_scale=scale, v_scale=scale,
                     backend="torch", **kw)
    assert torch.equal(pool.raw, twin.raw)
    assert kw["errors"].error() is None


def ds_row_by_hand(kv_c_row: torch.Tensor, k_pe_row: torch.Tensor, pow2: bool = False,
                   raw_rope: bool = False) -> bytes:
    """One fp8_ds_mla row from the format's words, token by token (the reference's oracle);
    `pow2`: scale 2^ceil(log2(max(amax/448, 1e-4))); `raw_rope`: the rope's own 16 bits."""
    out = b""
    scales = []
    for t in range(kv_c_row.numel() // 128):
        x = kv_c_row[t * 128:(t + 1) * 128].float()
        s = struct.unpack("<f", struct.pack("<f", float(x.abs().max()) / 448.0))[0]   # fp32 division
        if pow2:
            s = 2.0 ** math.ceil(math.log2(max(s, struct.unpack("<f", struct.pack("<f", 1e-4))[0])))
        else:
            s = max(s, TINY)
        sv = torch.tensor(s, dtype=torch.float32)
        q = (x / sv).clamp(-448, 448).to(torch.float8_e4m3fn)
        out += bytes(q.view(torch.uint8).tolist())
        scales.append(s)
    out += struct.pack(f"<{len(scales)}f", *scales)
    rope = k_pe_row if raw_rope else k_pe_row.to(torch.bfloat16)
    out += bytes(rope.contiguous().view(torch.uint8).tolist())
    return out


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_ds_mla_pow2_scales_and_input_rope(backend, dtype):
    """ds_mla_scale="pow2" / ds_mla_rope="input" (vLLM's newer writer): tile scales are powers of
    two, floor 2^-13, and the rope keeps its fp16/bf16 bits; canaries around the cache."""
    lora, rope = 256, 8
    gen = torch.Generator().manual_seed(3)
    kv_c = (torch.randn(4, lora, generator=gen) * 3).to(dtype)
    kv_c[1, :128] = 0                       # all-zero tile: 1e-4 rounds up to 2^-13
    kv_c[2, 128:] = 448 * 2.0 ** -3         # amax / 448 exactly a power of two: kept
    kv_c[3, 7] = 450.0                      # just above 448: scale 2
    k_pe = (torch.randn(4, rope, generator=gen) * 100).to(dtype)
    k_pe[0, :3] = torch.tensor([1 + 2**-10, -0.0, 65504.0]).to(dtype)   # fp16 bits bf16 would round
    pool = CanaryBuffer({"kv_cache": ((2, 4, ds_mla_row_bytes(lora, rope)), torch.uint8)}, 9)
    original = pool.raw.clone()
    loc = torch.tensor([5, 0, -1, 7], device=DEVICE)
    kvwrite.store_mla(kv_c.to(DEVICE), k_pe.to(DEVICE), pool["kv_cache"], loc, kv_cache_dtype="fp8_ds_mla",
                      ds_mla_scale="pow2", ds_mla_rope="input", backend=backend)
    rows = pool["kv_cache"].reshape(8, -1).cpu()
    for i, l in enumerate(loc.tolist()):
        if l >= 0:
            assert bytes(rows[l].tolist()) == ds_row_by_hand(kv_c[i], k_pe[i], True, True), (i, l)
    scales = rows[[5, 0, 7], lora:lora + 8].contiguous().view(torch.float32)
    assert bool((torch.frexp(scales).mantissa == 0.5).all())             # powers of two
    assert rows[0, lora:lora + 4].view(torch.float32).item() == 2.0 ** -13
    assert rows[7, lora:lora + 4].view(torch.float32).item() == 2.0
    assert torch.equal(rows[5, -2 * rope:].view(dtype), k_pe[0])
    untouched = torch.ones(8, dtype=torch.bool)
    untouched[[5, 0, 7]] = False
    moved = pool.raw != original
    moved_rows = moved[pool.offsets["kv_cache"]:pool.offsets["kv_cache"] + pool.sizes["kv_cache"]]
    assert not bool(moved_rows.view(8, -1)[untouched].any())
    assert not bool((moved & pool.canary_mask()).any())
    ref = pool.clone()
    ref.raw.copy_(original)
    kvwrite.store_mla(kv_c.to(DEVICE), k_pe.to(DEVICE), ref["kv_cache"], loc,
                      kv_cache_dtype="fp8_ds_mla+pow2+input", backend="torch")
    assert_same_bytes(pool, ref, original)


def test_ds_mla_options_refused_where_they_do_not_apply():
    kv_c, k_pe = torch.ones(2, 128, device=DEVICE), torch.ones(2, 4, device=DEVICE)
    cache = torch.zeros(1, 2, ds_mla_row_bytes(128, 4), dtype=torch.uint8, device=DEVICE)
    loc = torch.tensor([0, 1], device=DEVICE)
    with pytest.raises(ValueError, match="kv_c and k_pe must be bfloat16 or float16"):
        kvwrite.store_mla(kv_c, k_pe, cache, loc, kv_cache_dtype="fp8_ds_mla", ds_mla_rope="input")
    with pytest.raises(ValueError, match="ds_mla_scale must be one of"):
        kvwrite.store_mla(kv_c, k_pe, cache, loc, kv_cache_dtype="fp8_ds_mla", ds_mla_scale="log")
    with pytest.raises(ValueError, match="apply only to kv_cache_dtype='fp8_ds_mla'"):
        kvwrite.store_mla(kv_c, k_pe, torch.zeros(1, 2, 132, device=DEVICE), loc, ds_mla_scale="pow2")


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("dtype", FLOATS)
def test_ds_mla_row_format(backend, dtype):
    lora, rope = 256, 8
    gen = torch.Generator().manual_seed(2)
    kv_c = (torch.randn(4, lora, generator=gen) * 3).to(dtype)
    kv_c[1, :128] = 0                                  # all-zero tile: scale is FLT_MIN, bytes 0
    kv_c[2, 128:] *= 1e-3
    kv_c[3, 5] = 60000.0                               # one huge value: the tile's scale follows it
    k_pe = (torch.randn(4, rope, generator=gen)).to(dtype)
    k_pe[0, :4] = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -0.0, 2.0**-130])  # bf16 ties, -0, subnormal
    width = ds_mla_row_bytes(lora, rope)
    assert width == lora + 8 + 16 and ds_mla_row_bytes(512, 64) == 656
    cache = torch.zeros(2, 4, width, dtype=torch.uint8, device=DEVICE)
    loc = torch.tensor([5, 0, -1, 7], device=DEVICE)
    kvwrite.store_mla(kv_c.to(DEVICE), k_pe.to(DEVICE), cache, loc, kv_cache_dtype="fp8_ds_mla", backend=backend)
    rows = cache.view(8, width).cpu()
    for i, l in enumerate(loc.tolist()):
        if l >= 0:
            assert bytes(rows[l].tolist()) == ds_row_by_hand(kv_c[i], k_pe[i]), (i, l)
    assert bool((rows[[1, 2, 3, 4, 6]] == 0).all())     # untouched rows (token 2 is padding)
    zero_tile = rows[0, lora:lora + 4].view(torch.float32)
    assert zero_tile.item() == TINY and bool((rows[0, :128] == 0).all())
    assert rows[7, lora:lora + 4].view(torch.float32) == kv_c[3, 5].float() / 448
    if dtype == torch.bfloat16:   # bf16 rope: bit copies
        assert torch.equal(rows[5, -2 * rope:].view(torch.bfloat16), k_pe[0])


def test_ds_mla_bf16_rope_is_copied_bit_exact_even_nan():
    kv_c = torch.ones(2, 128, dtype=torch.bfloat16, device=DEVICE)
    bits = torch.tensor([[0x7FC1, -0x3F, 0x0001, -0x8000], [0x7F80, 0x1234, -1, 0]], dtype=torch.int16)
    k_pe = bits.view(torch.bfloat16).to(DEVICE)
    for backend in ["torch", *BACKENDS]:
        cache = torch.zeros(1, 2, ds_mla_row_bytes(128, 4), dtype=torch.uint8, device=DEVICE)
        kvwrite.store_mla(kv_c, k_pe, cache, torch.tensor([1, 0], device=DEVICE), kv_cache_dtype="fp8_ds_mla", backend=backend)
        assert torch.equal(cache[0, [1, 0], -8:].cpu().contiguous().view(torch.int16), bits), backend


@pytest.mark.parametrize("dtype", FLOATS)
def test_dequant_ds_mla_reads_rows_back(dtype):
    lora, rope = 512, 64
    gen = torch.Generator().manual_seed(4)
    kv_c, k_pe = projection(9, lora, rope, dtype, gen, strided=True)
    cache = torch.zeros(3, 4, ds_mla_row_bytes(lora, rope), dtype=torch.uint8, device=DEVICE)
    kvwrite.store_mla(kv_c, k_pe, cache, torch.arange(9, device=DEVICE), kv_cache_dtype="fp8_ds_mla")
    got = kvwrite.dequant_ds_mla(cache.view(12, -1)[:9])
    assert got.shape == (9, lora + rope) and got.dtype == torch.float32
    x = kv_c.float()
    tile_amax = x.reshape(9, 4, 128).abs().amax(-1, keepdim=True).expand(9, 4, 128).reshape(9, lora)
    # e4m3: half an ulp is 2**-4 relative for normals, 2**-10 * scale below 2**-6 * scale
    bound = x.abs() / 16 + tile_amax / 448 * 2**-9
    assert bool(((got[:, :lora] - x).abs() <= bound).all())
    assert torch.equal(got[:, lora:], k_pe.to(torch.bfloat16).float())
    assert kvwrite.dequant_ds_mla(cache, kv_lora_rank=512).shape == (3, 4, lora + rope)
    with pytest.raises(ValueError, match="not fp8_ds_mla rows"):
        kvwrite.dequant_ds_mla(cache, kv_lora_rank=768)


# --- out-of-range locs -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("case", ["beyond", "allocator_tail", "negative", "mixed"])
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
def test_out_of_range_guard_and_assert(backend, case, fmt):
    pps, num_pages, lora, rope = 16, 4, 128, 16
    capacity = num_pages * pps
    loc_list = bad_loc_cases(capacity, pps)[case]
    loc = torch.tensor(loc_list, device=DEVICE)
    gen = torch.Generator().manual_seed(1)
    kv_c, k_pe = projection(len(loc_list), lora, rope, torch.bfloat16, gen, strided=True)
    bad = [i for i, l in enumerate(loc_list) if l != -1 and not 0 <= l < capacity]
    pool = make_pool(fmt, torch.bfloat16, num_pages, pps, lora, rope, 7)
    original = pool.raw.clone()
    good_only = pool.clone()
    keep = torch.tensor([l if i not in bad else -1 for i, l in enumerate(loc_list)], device=DEVICE)
    run_store("torch", good_only, kv_c, k_pe, keep, fmt)
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, kv_c, k_pe, loc, fmt, check="guard", errors=errs)
    assert_same_bytes(pool, good_only, original)
    err = errs.error()
    first = bad[0]
    assert (err.op, err.token_index, err.loc, err.count) == ("store_mla", first, loc_list[first], len(bad))
    assert err.page == loc_list[first] // pps and err.num_pages == num_pages and err.pool_page_size == pps
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context
    pool = make_pool(fmt, torch.bfloat16, num_pages, pps, lora, rope, 7)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="store_mla") as info:
        run_store(backend, pool, kv_c, k_pe, loc, fmt, check="assert")
    assert info.value.token_index == first and info.value.loc == loc_list[first]
    assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_dcp_shard_out_of_range_reports_the_local_row(backend):
    """Under DCP the pool is checked against the local row loc // dcp_size."""
    cache = torch.zeros(2, 4, 40, dtype=torch.float16, device=DEVICE)
    kv_c, k_pe = torch.ones(3, 32, dtype=torch.float16, device=DEVICE), torch.ones(3, 8, dtype=torch.float16, device=DEVICE)
    errs = kvwrite.ErrorBuffer(DEVICE)
    kvwrite.store_mla(kv_c, k_pe, cache, torch.tensor([15, 16, 17], device=DEVICE), dcp_rank=1,
                      dcp_size=2, check="guard", errors=errs, backend=backend)
    err = errs.error()
    assert (err.token_index, err.loc, err.target, err.page, err.count) == (2, 17, 8, 2, 1)
    assert bool((cache.view(8, 40)[7] == 1).all()) and int((cache != 0).sum()) == 40


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_large_pool_int64_offsets(backend):
    """fp8_ds_mla rows beyond byte 2**31: the row address needs int64 arithmetic."""
    width = ds_mla_row_bytes(128, 4)        # 140 bytes
    num_pages = 2**31 // width + 3
    cache = torch.empty(num_pages, 1, width, dtype=torch.uint8, device=DEVICE)
    cache[0].zero_()
    cache[-1].zero_()
    kv_c = torch.full((1, 128), 3.0, dtype=torch.bfloat16, device=DEVICE)
    kvwrite.store_mla(kv_c, kv_c[:, :4], cache, torch.tensor([num_pages - 1], device=DEVICE),
                      kv_cache_dtype="fp8_ds_mla", check="guard", errors=kvwrite.ErrorBuffer(DEVICE),
                      backend=backend)
    assert bool((cache[-1, 0, :128] == 0x7E).all()) and bool((cache[0] == 0).all())   # 3/(3/448) = 448


# --- arguments, custom op ------------------------------------------------------------------

def args(**over):
    base = dict(kv_c=torch.randn(3, 128), k_pe=torch.randn(3, 16), kv_cache=torch.zeros(4, 16, 144),
                loc=torch.tensor([0, 5, 9]))
    base.update(over)
    return base


E4M3, U8 = torch.float8_e4m3fn, torch.uint8
BAD = [
    (dict(kv_c=torch.randn(3, 1, 128)), ValueError, "kv_c must be 2-D"),
    (dict(kv_c=torch.randn(3, 128).to(torch.int32)), TypeError, "kv_c must have dtype"),
    (dict(kv_c=torch.randn(128, 3).t()), ValueError, "kv_c must be contiguous in its last dim"),
    (dict(k_pe=torch.randn(3, 16, dtype=torch.float16)), TypeError, "k_pe must have dtype"),
    (dict(k_pe=torch.randn(4, 16)), ValueError, "k_pe must have shape"),
    (dict(kv_cache=torch.zeros(4, 16, 143)), ValueError, "kv_cache must have shape"),
    (dict(kv_cache=torch.zeros(4, 16, 1, 144)), ValueError, "kv_cache must be 3-D"),
    (dict(kv_cache=torch.zeros(4, 16, 144, dtype=torch.float16)), TypeError, "kv_cache must have dtype"),
    (dict(kv_cache=torch.zeros(0, 16, 144)), ValueError, "at least one page"),
    (dict(kv_cache_dtype="fp8"), ValueError, "kv_cache_dtype must be one of"),
    (dict(kv_cache_dtype="fp8_e4m3", kv_cache=torch.zeros(4, 16, 144, dtype=E4M3)), ValueError, "scale is required"),
    (dict(kv_cache_dtype="fp8_e4m3", kv_cache=torch.zeros(4, 16, 144, dtype=torch.float8_e5m2),
          scale=torch.tensor(1.0)), TypeError, "kv_cache must have dtype"),
    (dict(kv_cache_dtype="fp8_e4m3", kv_cache=torch.zeros(4, 16, 144, dtype=E4M3), scale=torch.ones(2)),
     ValueError, r"scale must have shape \[\], \[1\]"),
    (dict(kv_cache_dtype="fp8_e4m3", kv_cache=torch.zeros(4, 16, 144, dtype=E4M3),
          scale=torch.tensor(1.0, dtype=torch.float64)), TypeError, "scale must have dtype"),
    (dict(scale=torch.tensor(1.0)), ValueError, "scale applies only"),
    (dict(kv_cache_dtype="fp8_ds_mla", kv_cache=torch.zeros(4, 16, 144)), TypeError, "kv_cache must have dtype"),
    (dict(kv_cache_dtype="fp8_ds_mla", kv_cache=torch.zeros(4, 16, 144, dtype=U8)), ValueError, r"must have shape \[\*, \*, 164\]"),
    (dict(kv_cache_dtype="fp8_ds_mla", kv_c=torch.randn(3, 96), kv_cache=torch.zeros(4, 16, 140, dtype=U8)),
     ValueError, "multiple of 128"),
    (dict(loc=torch.tensor([0, 1])), ValueError, "loc must have one entry per token"),
    (dict(loc=torch.tensor([0.0, 1.0, 2.0])), TypeError, "loc must have dtype"),
    (dict(check="strict"), ValueError, "check must be one of"),
    (dict(loc_map=torch.zeros(4)), TypeError, "loc_map must have dtype"),
    (dict(dcp_size=0), ValueError, "dcp_size must be"),
    (dict(dcp_rank=1, dcp_size=1), ValueError, "dcp_rank must be"),
    (dict(check="guard", errors=torch.zeros(3)), TypeError, "errors must be"),
    (dict(backend="fast"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("over, exc, msg", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_named_errors_before_any_write(over, exc, msg):
    a = args(**over)
    kw = {k: v for k, v in a.items() if k not in ("kv_c", "k_pe", "kv_cache", "loc")}
    kw.setdefault("backend", "torch")
    before = a["kv_cache"].clone()
    with pytest.raises(exc, match=msg):
        kvwrite.store_mla(a["kv_c"], a["k_pe"], a["kv_cache"], a["loc"], **kw)
    assert torch.equal(before.view(torch.uint8), a["kv_cache"].view(torch.uint8))


def test_n0_is_a_noop_and_unavailable_backend_is_named():
    a = args(kv_c=torch.randn(0, 128), k_pe=torch.randn(0, 16), loc=torch.zeros(0, dtype=torch.int64))
    kvwrite.store_mla(a["kv_c"], a["k_pe"], a["kv_cache"], a["loc"], check="guard")
    assert bool((a["kv_cache"] == 0).all())
    with pytest.raises(kvwrite.BackendUnavailable, match="store_mla: backend='cuda'"):
        kvwrite.store_mla(*args().values(), backend="cuda")


def test_torch_compile_fullgraph_calls_the_custom_op():
    cache = torch.zeros(2, 4, ds_mla_row_bytes(128, 16), dtype=torch.uint8)
    errors = kvwrite.ErrorBuffer("cpu")

    def layer(proj, loc):
        proj = proj * 2
        kvwrite.store_mla(proj[:, :128], proj[:, 128:], cache, loc, kv_cache_dtype="fp8_ds_mla",
                          check="guard", errors=errors, backend="torch")
        return proj.sum()

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    proj = torch.randn(3, 144, dtype=torch.bfloat16)
    compiled(proj, torch.tensor([1, 20, 6]))
    rows = cache.view(8, -1)
    assert torch.equal(kvwrite.dequant_ds_mla(rows[6:7], 128)[0, 128:], (proj[2, 128:] * 2).float())
    assert errors.error().loc == 20 and bool((rows[0] == 0).all())


def test_custom_op_is_registered():
    cache = torch.zeros(2, 4, 48)
    x = torch.ones(1, 48)
    torch.ops.kvwrite.store_mla(x[:, :40], x[:, 40:], cache, torch.tensor([5]), "auto", None, "off",
                                None, None, 0, 1, "torch")
    assert bool((cache[1, 1] == 1).all()) and int((cache != 0).sum()) == 48


@pytest.mark.skipif(DEVICE.type != "cuda", reason="device asserts exist on a GPU only")
@pytest.mark.parametrize("fmt", ["auto", "fp8_ds_mla"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_assert_in_subprocess(backend, fmt):
    """On a GPU the assert mode is a device-side assert: the process dies with it."""
    import subprocess
    import sys

    code = f"""
import torch, kvwrite
from kvwrite.ops.mla import FORMATS
f = FORMATS["{fmt}"]
cache = torch.zeros(4, 16, f.row_width(128, 16), dtype=f.cache_dtype(torch.bfloat16), device="cuda")
x = torch.ones(3, 144, dtype=torch.bfloat16, device="cuda")
kvwrite.store_mla(x[:, :128], x[:, 128:], cache, torch.tensor([1, 64, -1], device="cuda"),
                  kv_cache_dtype="{fmt}", check="assert", backend="{backend}")
torch.cuda.synchronize()
print("NOT REACHED")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "NOT REACHED" not in out.stdout
    assert "assert" in (out.stderr + out.stdout).lower(), out.stderr[-2000:]
