"""DeepSeek V4 stores: every backend against the torch reference (bytes, canaries, records),
the KV page decoded by byte offsets written out here, the fp8 / ue8m0 and mxfp4 error bounds,
page-granular DCP, bad locs in assert and guard, compressed_loc / state_loc rules."""
from __future__ import annotations

import math
import struct

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.ops.dsv4 import indexer_row_bytes, kv_page_bytes
from test_store_kv import bad_loc_cases

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def values(n, d, dtype, gen):
    """Rows whose magnitudes vary over decades (some tiles under the 1e-4 amax floor)."""
    mag = torch.exp2(torch.randint(-22, 10, (n, 1), generator=gen).float())
    return (torch.randn(n, d, generator=gen) * mag).to(dtype).to(DEVICE)


def run(op, backend, pool, x, loc, **kw):
    name = {"kv": "cache", "idx": "cache", "rows": "pool"}[op]
    fn = {"kv": kvwrite.store_dsv4_kv, "idx": kvwrite.store_dsv4_indexer_k, "rows": kvwrite.store_rows}[op]
    fn(x, pool[name], loc, backend=backend, **kw)


def locs_for(n, capacity, gen, pad):
    perm = torch.randperm(capacity, generator=gen)[:n]
    perm[torch.rand(n, generator=gen) < pad] = -1
    return perm


# --- every backend == reference ------------------------------------------------------------------

@st.composite
def cases(draw):
    return dict(dtype=draw(st.sampled_from(FLOATS)), pps=draw(st.sampled_from([1, 2, 4, 64])),
                pages=draw(st.integers(1, 4)), n=draw(st.integers(0, 12)),
                dcp=draw(st.sampled_from([(0, 1), (1, 2), (3, 4)])), loc_map=draw(st.booleans()),
                check=draw(st.sampled_from(["off", "assert", "guard"])),
                loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                strided=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def _inputs(c, width, row_bytes=None):
    gen = torch.Generator().manual_seed(c["seed"])
    rank, size = c["dcp"]
    capacity = c["pages"] * c["pps"] * size          # the virtual loc space of all ranks
    n = min(c["n"], capacity)
    x = values(n, width + (16 if c["strided"] else 0), c["dtype"], gen)
    x = x[:, 8:8 + width] if c["strided"] else x
    kw = dict(check=c["check"], dcp_rank=rank, dcp_size=size)
    if c["loc_map"]:    # a full -> SWA map from a 2x larger loc space
        m = torch.full((2 * capacity,), -1, dtype=torch.int64)
        m[torch.randperm(2 * capacity, generator=gen)[:capacity]] = torch.randperm(capacity, generator=gen)
        kw["loc_map"] = m.to(DEVICE)
        capacity *= 2
    loc = locs_for(n, capacity, gen, 0.2).to(c["loc_dtype"]).to(DEVICE)
    return x, loc, kw


def _same(op, backend, specs, x, loc, kw, seed):
    pool = CanaryBuffer(specs, seed)
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    run(op, backend, pool, x, loc, errors=errs, **kw)
    run(op, "torch", ref, x, loc, errors=ref_errs, **kw)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


@pytest.mark.parametrize("backend", BACKENDS)
@given(c=cases())
def test_store_dsv4_kv_matches_reference(backend, c):
    x, loc, kw = _inputs(c, 512)
    specs = {"cache": ((c["pages"], kv_page_bytes(c["pps"])), torch.uint8)}
    _same("kv", backend, specs, x, loc, dict(kw, page_size=c["pps"]), c["seed"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt, scale_fmt, d", [("fp8", None, 128), ("fp8", "ue8m0", 256), ("mxfp4", None, 128),
                                                ("mxfp4", None, 64)])
@given(c=cases())
def test_store_dsv4_indexer_k_matches_reference(backend, fmt, scale_fmt, d, c):
    x, loc, kw = _inputs(c, d)
    specs = {"cache": ((c["pages"], c["pps"] * indexer_row_bytes(d, fmt)), torch.uint8)}
    _same("idx", backend, specs, x, loc, dict(kw, fmt=fmt, scale_fmt=scale_fmt), c["seed"])


@pytest.mark.parametrize("backend", BACKENDS)
@given(c=cases(), width=st.sampled_from([1, 3, 64, 2 * 2 * 512]))
def test_store_rows_matches_reference(backend, c, width):
    c = dict(c, pps=1, pages=c["pages"] * 8)
    x, loc, kw = _inputs(c, width)
    _same("rows", backend, {"pool": ((c["pages"], width), c["dtype"])}, x, loc, kw, c["seed"])


# --- the KV page, decoded by byte offsets written out here ----------------------------------------

def f32(v: float) -> float:
    return struct.unpack("<f", struct.pack("<f", v))[0]


def next_pow2(s: float) -> float:
    p = 2.0 ** -127
    while p < s:
        p *= 2
    return p


def e4m3_value(b: int) -> float:
    sign = -1.0 if b & 0x80 else 1.0
    e, m = (b >> 3) & 0xF, b & 7
    return sign * (m / 8 * 2.0 ** -6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_kv_page_by_byte_offsets(backend):
    """Page p of a page_size-4 cache is 2880 bytes (ceil(4*584/576) = 5 rows of 576): token at
    loc = 4p + o has its 448 e4m3 bytes at o*576, its bf16 rope at o*576 + 448, its 7 scale
    bytes at 4*576 + o*8; byte 4*576 + o*8 + 7 (pad) and bytes [4*584, 2880) are never written."""
    pps, pages, page_bytes = 4, 3, 2880
    assert kv_page_bytes(pps) == page_bytes
    gen = torch.Generator().manual_seed(5)
    kv = torch.randn(3, 512, generator=gen) * 3
    kv[0, 64:128] = 1e-7               # tile 1 under the 1e-4 amax floor
    kv[1, :64] = 0.0
    kv[2, 5] = 448.0 * 3               # tile 0: amax 1344, scale 3 -> 4 (ue8m0)
    loc = [9, -1, 2]
    pool = CanaryBuffer({"cache": ((pages, page_bytes), torch.uint8)}, 11)
    original = pool.raw.clone()
    kvwrite.store_dsv4_kv(kv.to(DEVICE), pool["cache"], torch.tensor(loc, device=DEVICE), page_size=pps,
                          backend=backend)
    cache = pool["cache"].cpu()
    before = original[pool.offsets["cache"]:pool.offsets["cache"] + pages * page_bytes].view(pages, page_bytes)
    written = torch.zeros(pages, page_bytes, dtype=torch.bool)
    for i, l in enumerate(loc):
        if l < 0:
            continue
        page, o = divmod(l, pps)
        for t in range(7):
            x = kv[i, 64 * t:64 * (t + 1)]
            s = next_pow2(f32(max(float(x.abs().max()), f32(1e-4)) / 448.0))
            at = 4 * 576 + o * 8 + t
            assert int(cache[page, at]) == int(math.log2(s)) + 127, (i, t)
            want = (x / s).to(torch.float8_e4m3fn).view(torch.uint8)
            start = o * 576 + 64 * t
            assert torch.equal(cache[page, start:start + 64], want), (i, t)
            got = torch.tensor([e4m3_value(int(b)) * s for b in cache[page, start:start + 64]])
            assert bool(((got - x).abs() <= torch.maximum(x.abs() / 16, torch.full_like(x, s * 2**-10))).all())
            written[page, start:start + 64] = True
            written[page, at] = True
        rope = cache[page, o * 576 + 448:o * 576 + 576].contiguous().view(torch.bfloat16)
        assert torch.equal(rope, kv[i, 448:].to(torch.bfloat16))
        written[page, o * 576 + 448:o * 576 + 576] = True
    assert torch.equal(cache[~written], before[~written])           # pad bytes, padding, other rows
    assert int(cache[0, 4 * 576 + 2 * 8]) == 129   # token 2 (loc 2), tile 0: scale 4 = 2**2
    assert not bool((pool.raw != original)[pool.canary_mask()].any())


def test_dequant_error_within_fp8_ue8m0_bound():
    gen = torch.Generator().manual_seed(2)
    n = 64
    kv = values(n, 512, torch.float32, gen)
    cache = torch.zeros(n // 16, kv_page_bytes(16), dtype=torch.uint8, device=DEVICE)
    loc = torch.randperm(n, generator=gen).to(DEVICE)
    kvwrite.store_dsv4_kv(kv, cache, loc)
    got = kvwrite.dequant_dsv4_kv(cache, loc)
    x = kv.float()
    amax = x[:, :448].reshape(n, 7, 64).abs().amax(-1).clamp(min=1e-4)
    s = torch.exp2(torch.ceil(torch.log2(amax / 448)))            # a power of two in [a/448, 2a/448)
    s = s.repeat_interleave(64, -1)
    nope_err = (got[:, :448] - x[:, :448]).abs()
    assert bool((nope_err <= torch.maximum(x[:, :448].abs() * 2**-4, s * 2**-10)).all())
    assert bool(((got[:, 448:] - x[:, 448:]).abs() <= x[:, 448:].abs() * 2**-8).all())
    assert bool((kvwrite.dequant_dsv4_kv(cache, torch.tensor([-1], device=DEVICE)) == 0).all())


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_mxfp4_layout_and_bound(backend):
    """mxfp4 page of 2 rows, D = 64: packed bytes at o*32 (+ b*16), ue8m0 bytes at 2*32 + o*2 + b."""
    d, pps = 64, 2
    gen = torch.Generator().manual_seed(4)
    k = torch.randn(3, d, generator=gen) * 7
    k[1, :32] = 0.0
    cache = torch.zeros(2, pps * indexer_row_bytes(d, "mxfp4"), dtype=torch.uint8, device=DEVICE)
    loc = torch.tensor([3, 0, -1], device=DEVICE)
    kvwrite.store_dsv4_indexer_k(k.to(DEVICE), cache, loc, fmt="mxfp4", backend=backend)
    cache = cache.cpu()
    e2m1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    for i, l in enumerate([3, 0]):
        page, o = divmod(l, pps)
        for b in range(2):
            x = k[i, 32 * b:32 * (b + 1)]
            s = next_pow2(f32(max(float(x.abs().max()), f32(1e-4)) / 6.0))
            assert int(cache[page, 64 + o * 2 + b]) == int(math.log2(s)) + 127
            packed = cache[page, o * 32 + b * 16:o * 32 + b * 16 + 16].tolist()
            codes = [c for byte in packed for c in (byte & 15, byte >> 4)]
            got = torch.tensor([(-1 if c & 8 else 1) * e2m1[c & 7] * s for c in codes])
            m = got.abs() / s
            h = torch.where(m < 2, 0.25, torch.where(m < 4, 0.5, 1.0))
            assert bool(((got - x).abs() <= s * h).all()), (i, b)
    back = kvwrite.read_dsv4_indexer_k(cache, torch.tensor([3, 0, -1]), head_dim=d, fmt="mxfp4")
    assert bool((back[2] == 0).all()) and bool((back[1, :32] == 0).all())


# --- DCP: page p on rank p % dcp_size as local page p // dcp_size ---------------------------------

@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("op", ["kv", "idx"])
def test_dcp_shards_whole_pages(backend, op):
    pps, local_pages, size = 4, 3, 2
    gen = torch.Generator().manual_seed(9)
    width = 512 if op == "kv" else 128
    page_bytes = kv_page_bytes(pps) if op == "kv" else pps * 132
    x = values(20, width, torch.bfloat16, gen)
    loc = locs_for(20, local_pages * size * pps, gen, 0.1).to(DEVICE)
    whole = {"cache": torch.zeros(local_pages * size, page_bytes, dtype=torch.uint8, device=DEVICE)}
    run(op, "torch", whole, x, loc)       # one unsharded cache of every virtual page
    for rank in range(size):
        mine = {"cache": torch.zeros(local_pages, page_bytes, dtype=torch.uint8, device=DEVICE)}
        run(op, backend, mine, x, loc, dcp_rank=rank, dcp_size=size, check="guard",
            errors=kvwrite.ErrorBuffer(DEVICE))
        assert torch.equal(mine["cache"], whole["cache"][rank::size]), rank


# --- bad locs ----------------------------------------------------------------------------------------

def _pool(op, num_pages, pps, seed):
    if op == "kv":
        return CanaryBuffer({"cache": ((num_pages, kv_page_bytes(pps)), torch.uint8)}, seed)
    if op == "idx":
        return CanaryBuffer({"cache": ((num_pages, pps * 68), torch.uint8)}, seed)
    return CanaryBuffer({"pool": ((num_pages * pps, 24), torch.float32)}, seed)


OPS = {"kv": ("store_dsv4_kv", 512, {}), "idx": ("store_dsv4_indexer_k", 128, {"fmt": "mxfp4"}),
       "rows": ("store_rows", 24, {})}


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("op", list(OPS))
@pytest.mark.parametrize("case", ["beyond", "allocator_tail", "negative", "mixed"])
def test_out_of_range_guard_and_assert(backend, op, case):
    pps, num_pages = 4, 4
    capacity = num_pages * pps
    name, width, kw = OPS[op]
    loc_list = bad_loc_cases(capacity, pps)[case]
    loc = torch.tensor(loc_list, device=DEVICE)
    x = values(len(loc_list), width, torch.float32, torch.Generator().manual_seed(1))
    bad = [i for i, l in enumerate(loc_list) if l != -1 and not 0 <= l < capacity]
    pool = _pool(op, num_pages, pps, 7)
    original = pool.raw.clone()
    good_only = pool.clone()
    keep = torch.tensor([l if i not in bad else -1 for i, l in enumerate(loc_list)], device=DEVICE)
    run(op, "torch", good_only, x, keep, **kw)
    errs = kvwrite.ErrorBuffer(DEVICE)
    run(op, backend, pool, x, loc, check="guard", errors=errs, **kw)
    assert_same_bytes(pool, good_only, original)
    err = errs.error()
    first = bad[0]
    assert (err.op, err.token_index, err.loc, err.count) == (name, first, loc_list[first], len(bad))
    rows_pps = 1 if op == "rows" else pps
    assert err.pool_page_size == rows_pps and err.page == loc_list[first] // rows_pps
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context
    pool = _pool(op, num_pages, pps, 7)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=name) as info:
        run(op, backend, pool, x, loc, check="assert", **kw)
    assert info.value.token_index == first and info.value.loc == loc_list[first]
    assert torch.equal(pool.raw, original)


BAD = [
    (dict(kv=torch.randn(2, 511)), ValueError, r"kv must have shape \[2, 512\]"),
    (dict(kv=torch.randn(2, 512).to(torch.int32)), TypeError, "kv must have dtype"),
    (dict(cache=torch.zeros(3, 2881, dtype=torch.uint8)), ValueError, "not a DeepSeek V4 KV page"),
    (dict(page_size=8), ValueError, r"pages of kv_page_bytes\(8\) = 5184 bytes"),
    (dict(cache=torch.zeros(3, 2880)), TypeError, "cache must have dtype"),
    (dict(loc=torch.tensor([0])), ValueError, "loc must have one entry per token"),
    (dict(dcp_size=0), ValueError, "dcp_size must be"),
    (dict(check="strict"), ValueError, "check must be one of"),
]


@pytest.mark.parametrize("over, exc, msg", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_named_errors(over, exc, msg):
    a = dict(kv=torch.randn(2, 512), cache=torch.zeros(3, 2880, dtype=torch.uint8), loc=torch.tensor([0, 5]))
    a.update(over)
    kw = {k: v for k, v in a.items() if k not in ("kv", "cache", "loc")}
    before = a["cache"].clone()
    with pytest.raises(exc, match=msg):
        kvwrite.store_dsv4_kv(a["kv"], a["cache"], a["loc"], backend="torch", **kw)
    assert torch.equal(before, a["cache"])


def test_bad_indexer_and_rows_arguments():
    k, cache, loc = torch.randn(2, 128), torch.zeros(2, 4 * 132, dtype=torch.uint8), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="fmt must be one of"):
        kvwrite.store_dsv4_indexer_k(k, cache, loc, fmt="fp4")
    with pytest.raises(ValueError, match="scale_fmt applies to fmt='fp8' only"):
        kvwrite.store_dsv4_indexer_k(k, torch.zeros(2, 4 * 68, dtype=torch.uint8), loc, fmt="mxfp4", scale_fmt="ue8m0")
    with pytest.raises(ValueError, match=r"head dim \(96\) must be a positive multiple of 128"):
        kvwrite.store_dsv4_indexer_k(torch.randn(2, 96), cache, loc)
    with pytest.raises(ValueError, match=r"page_size \* 132 = 660"):
        kvwrite.store_dsv4_indexer_k(k, cache, loc, page_size=5)
    with pytest.raises(TypeError, match="src must have dtype"):
        kvwrite.store_rows(torch.randn(2, 4).half(), torch.zeros(8, 4), loc)
    with pytest.raises(ValueError, match=r"src must have shape \[2, 4\]"):
        kvwrite.store_rows(torch.randn(2, 5), torch.zeros(8, 4), loc)


# --- loc rules ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("ratio", [4, 128])
def test_compressed_loc_rule(ratio):
    page_size = 256
    positions = torch.arange(0, 600)
    pages = torch.tensor([5, 2, 7])             # a request's pages, in order
    loc = pages[positions // page_size] * page_size + positions % page_size
    loc[17] = -1
    loc[40] = -5
    c = kvwrite.compressed_loc(loc, positions, ratio)
    for i in range(600):
        p, l = int(positions[i]), int(loc[i])
        want = -1 if (p + 1) % ratio or l == -1 else (l if l < 0 else l // ratio)
        assert int(c[i]) == want, i
    emitted = c >= 0
    assert int(emitted.sum()) == len([p for p in range(600) if (p + 1) % ratio == 0 and p != 17])
    # the compressed page (page_size // ratio rows) is the full page; rows are the position's group
    assert torch.equal(c[emitted] // (page_size // ratio), loc[emitted] // page_size)
    assert torch.equal(c[emitted] % (page_size // ratio), (positions[emitted] % page_size) // ratio)


@pytest.mark.parametrize("ring", [8, 16, 128, 256])
def test_state_loc_rule(ring):
    swa = torch.arange(0, 4 * 128)
    s = kvwrite.state_loc(torch.cat([swa, torch.tensor([-1, -7])]), 128, ring)
    for v in range(0, 4 * 128, 37):
        assert int(s[v]) == (v // 128) * ring + v % ring
    assert s[-2:].tolist() == [-1, -7]
    # a page's tokens share ring rows cyclically: at most ring distinct rows per SWA page
    for page in range(4):
        rows = set(s[page * 128:(page + 1) * 128].tolist())
        assert len(rows) == min(ring, 128) and min(rows) >= page * ring


def test_torch_compile_fullgraph_calls_the_custom_ops():
    cache = torch.zeros(2, kv_page_bytes(4), dtype=torch.uint8)
    pool = torch.zeros(8, 16)

    def layer(kv, rows, loc):
        kvwrite.store_dsv4_kv(kv * 2, cache, loc, backend="torch")
        kvwrite.store_rows(rows, pool, loc, backend="torch")
        return kv.sum()

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    kv, rows = torch.randn(2, 512), torch.randn(2, 16)
    compiled(kv, rows, torch.tensor([1, 6]))
    ref = torch.zeros_like(cache)
    kvwrite.store_dsv4_kv(kv * 2, ref, torch.tensor([1, 6]), backend="torch")
    assert torch.equal(cache, ref) and torch.equal(pool[[1, 6]], rows)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_special_values_follow_the_shared_policy(backend, dtype):
    """NaN, +-inf, fp32 subnormals, -0 in NoPE, RoPE and mxfp4 blocks: every backend writes the
    reference's bytes (README "Special values")."""
    gen = torch.Generator().manual_seed(13)
    x = torch.randn(4, 512, generator=gen)
    x[0, 3], x[0, 70], x[0, 500], x[1, 9] = float("nan"), float("inf"), float("-inf"), -0.0
    x[2, :64] = 1e-40                                 # subnormal tile
    x[3, 449] = float("nan")
    x = x.to(dtype).to(DEVICE)
    loc = torch.tensor([0, 1, 2, 3], device=DEVICE)
    for op, specs, inp, kw in (("kv", {"cache": ((1, kv_page_bytes(4)), torch.uint8)}, x, {}),
                               ("idx", {"cache": ((1, 4 * 68), torch.uint8)}, x[:, :128], {"fmt": "mxfp4"})):
        pool = CanaryBuffer(specs, 3)
        ref, original = pool.clone(), pool.raw.clone()
        run(op, backend, pool, inp, loc, **kw)
        run(op, "torch", ref, inp, loc, **kw)
        assert_same_bytes(pool, ref, original)
