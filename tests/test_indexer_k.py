"""store_indexer_k: every backend against the torch reference, the page-major layout, ue8m0
scales, canaries, out-of-range locs (pool and loc_map), bad arguments."""
from __future__ import annotations

import struct

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite.errors import KIND_LOC_MAP
from kvwrite.ops.indexer_k import row_bytes
from test_store_kv import bad_loc_cases

FLOATS = (torch.float32, torch.float16, torch.bfloat16)


def make_pool(num_pages, pps, d, qbs, seed):
    return CanaryBuffer({"cache": ((num_pages, pps * row_bytes(d, qbs)), torch.uint8)}, seed)


def run_store(backend, pool, k, loc, qbs=128, scale_fmt=None, check="off", errors=None, **kw):
    kvwrite.store_indexer_k(k, pool["cache"], loc, quant_block_size=qbs, scale_fmt=scale_fmt,
                            check=check, errors=errors, backend=backend, **kw)


def keys(n, d, dtype, gen, strided):
    """[n, D] keys whose magnitudes vary over decades (some blocks under the 1e-4 amax floor);
    strided: a slice of a wider projection."""
    mag = torch.exp2(torch.randint(-18, 8, (n, 1), generator=gen).float())
    x = torch.randn(n, d + (24 if strided else 0), generator=gen) * mag
    x = x.to(dtype).to(DEVICE)
    return x[:, 8:8 + d] if strided else x


@st.composite
def store_cases(draw, scale_fmt):
    d, qbs = draw(st.sampled_from([(128, 128), (256, 128), (64, 32), (96, 48)]))
    pps = draw(st.sampled_from([1, 16, 64]))
    num_pages = draw(st.integers(1, max(1, 320 // pps) + 1))
    capacity = num_pages * pps
    n = draw(st.sampled_from([0, 1, 7, capacity]) | st.integers(0, capacity))
    return dict(dtype=draw(st.sampled_from(FLOATS)), d=d, qbs=qbs, pps=pps, num_pages=num_pages,
                n=min(n, capacity), strided=draw(st.booleans()), pad=draw(st.sampled_from([0.0, 0.25])),
                loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])), scale_fmt=scale_fmt,
                loc_map=draw(st.booleans()),
                check=draw(st.sampled_from(["off", "assert", "guard"])), seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
@given(data=st.data())
def test_store_indexer_k_matches_reference(backend, scale_fmt, data):
    c = data.draw(store_cases(scale_fmt))
    gen = torch.Generator().manual_seed(c["seed"])
    k = keys(c["n"], c["d"], c["dtype"], gen, c["strided"])
    capacity = c["num_pages"] * c["pps"]
    kw = {}
    if c["loc_map"]:   # SWA-style translation from a 3x larger loc space (injective where not -1)
        rows = torch.full((3 * capacity,), -1, dtype=torch.int64)
        rows[torch.randperm(3 * capacity, generator=gen)[:capacity]] = torch.randperm(capacity, generator=gen)
        kw["loc_map"] = rows.to(DEVICE)
    loc = paged_locs(c["n"], 3 * capacity if c["loc_map"] else capacity, c["pps"], gen, c["pad"], c["loc_dtype"])
    pool = make_pool(c["num_pages"], c["pps"], c["d"], c["qbs"], c["seed"])
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, loc, c["qbs"], scale_fmt, c["check"], errs, **kw)
    run_store("torch", ref, k, loc, c["qbs"], scale_fmt, c["check"], ref_errs, **kw)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_blocks_either_side_of_the_amax_floor(backend, scale_fmt):
    """bf16 blocks whose amax sits just under (0x38D1) or at (0x38D2) the 1e-4 floor, or far from it:
    the cpu lanes (one multiply above the floor, the general loop under it) give the reference's bytes."""
    gen = torch.Generator().manual_seed(5)
    tops = torch.tensor([0x38D1, 0x38D2, 0x38D0, 0x38D3, 0x3F80, 0x2F00, 0x4300, 0x38D2], dtype=torch.int32)
    amax = (tops << 16).view(torch.float32)   # the bf16 bits as fp32 values
    n, d = len(tops), 256
    x = (torch.rand(n, d, generator=gen) * 2 - 1) * amax[:, None]
    x[torch.arange(n), torch.randint(0, d, (n,), generator=gen)] = amax * torch.where(torch.arange(n) % 2 == 0, 1.0, -1.0)
    k = x.to(torch.bfloat16).to(DEVICE)
    loc = torch.randperm(4 * 16, generator=gen)[:n].to(DEVICE)
    pool = make_pool(4, 16, d, 128, 1)
    ref, original = pool.clone(), pool.raw.clone()
    run_store(backend, pool, k, loc, 128, scale_fmt)
    run_store("torch", ref, k, loc, 128, scale_fmt)
    assert_same_bytes(pool, ref, original)


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def ue8m0_by_hand(s: float) -> float:
    """The smallest power of two >= s."""
    p = 2.0 ** -127
    while p < s:
        p *= 2
    return p


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("scale_fmt", [None, "ue8m0"])
def test_page_major_layout_and_scales(backend, scale_fmt):
    """Token at loc = page*pps + o: e4m3 bytes at [o*D, (o+1)*D) of its page, its block scales
    at pps*D + (o*D/qbs + b)*4, each = max(amax, 1e-4)/448 (ue8m0: next power of two)."""
    d, qbs, pps = 128, 64, 4
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(3, d, generator=gen) * 5
    k[0, :64] = 1e-6                         # under the 1e-4 amax floor
    k[1, 64:] = 0.0
    k[2, 7] = 448.0 * 3                      # amax 1344: scale exactly 3 (ue8m0: 4)
    loc = [6, -1, 1]
    cache = torch.zeros(3, pps * row_bytes(d, qbs), dtype=torch.uint8, device=DEVICE)
    kvwrite.store_indexer_k(k.to(DEVICE), cache, torch.tensor(loc, device=DEVICE), quant_block_size=qbs,
                            scale_fmt=scale_fmt, backend=backend)
    cache = cache.cpu()
    written = torch.zeros_like(cache, dtype=torch.bool)
    for i, l in enumerate(loc):
        if l < 0:
            continue
        page, o = divmod(l, pps)
        for b in range(d // qbs):
            x = k[i, b * qbs:(b + 1) * qbs]
            s = f32(max(float(x.abs().max()), f32(1e-4)) / 448.0)
            if scale_fmt == "ue8m0":
                s = ue8m0_by_hand(s)
            at = pps * d + (o * (d // qbs) + b) * 4
            assert struct.unpack("<f", bytes(cache[page, at:at + 4].tolist()))[0] == s, (i, b)
            q = (x / torch.tensor(s)).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
            start = o * d + b * qbs
            assert torch.equal(cache[page, start:start + qbs], q), (i, b)
            written[page, start:start + qbs] = True
            written[page, at:at + 4] = True
    assert not bool(cache[~written].any())   # nothing else written
    if scale_fmt is None:
        assert struct.unpack("<f", bytes(cache[0, pps * d + 8:pps * d + 12].tolist()))[0] == f32(1344 / 448) == 3.0


def test_read_indexer_k_reads_keys_back():
    d, qbs = 256, 128
    gen = torch.Generator().manual_seed(8)
    k = keys(20, d, torch.bfloat16, gen, strided=True)
    cache = torch.zeros(4, 16 * row_bytes(d, qbs), dtype=torch.uint8, device=DEVICE)
    loc = paged_locs(20, 64, 16, gen, 0.2)
    for fmt in (None, "ue8m0"):
        kvwrite.store_indexer_k(k, cache, loc, scale_fmt=fmt)
        got = kvwrite.read_indexer_k(cache, loc, d)
        x = torch.where((loc != -1)[:, None], k.float(), torch.zeros_like(k.float()))
        block_scale = (x.reshape(20, 2, qbs).abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)
        if fmt:
            block_scale = block_scale * 2
        bound = x.abs() / 16 + (block_scale * 2**-9).expand(20, 2, qbs).reshape(20, d)
        assert got.shape == (20, d) and bool(((got - x).abs() <= bound).all()), fmt


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_pool_page_size_is_derived_from_the_cache(backend):
    d = 128
    cache = torch.zeros(2, 16 * row_bytes(d, 128), dtype=torch.uint8, device=DEVICE)   # 16 tokens a page
    k = torch.ones(2, d, device=DEVICE)
    errs = kvwrite.ErrorBuffer(DEVICE)
    kvwrite.store_indexer_k(k, cache, torch.tensor([31, 32], device=DEVICE), check="guard", errors=errs, backend=backend)
    err = errs.error()
    assert (err.token_index, err.loc, err.page, err.pool_page_size, err.num_pages) == (1, 32, 2, 16, 2)
    assert bool((cache[1, 15 * d:16 * d] == 0x7E).all())   # 1 / (1/448) = 448
    with pytest.raises(ValueError, match=r"cache's page of 2113 bytes is not a whole number of tokens of 132"):
        kvwrite.store_indexer_k(k, torch.zeros(2, 2113, dtype=torch.uint8), torch.tensor([0, 1]), backend="torch")


# --- out-of-range locs -----------------------------------------------------------------------

@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("case", ["beyond", "allocator_tail", "negative", "mixed"])
def test_out_of_range_guard_and_assert(backend, case):
    pps, num_pages, d = 16, 4, 64
    capacity = num_pages * pps
    loc_list = bad_loc_cases(capacity, pps)[case]
    loc = torch.tensor(loc_list, device=DEVICE)
    k = keys(len(loc_list), d, torch.bfloat16, torch.Generator().manual_seed(1), strided=True)
    bad = [i for i, l in enumerate(loc_list) if l != -1 and not 0 <= l < capacity]
    pool = make_pool(num_pages, pps, d, 32, 7)
    original = pool.raw.clone()
    good_only = pool.clone()
    keep = torch.tensor([l if i not in bad else -1 for i, l in enumerate(loc_list)], device=DEVICE)
    run_store("torch", good_only, k, keep, 32)
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, loc, 32, check="guard", errors=errs)
    assert_same_bytes(pool, good_only, original)
    err = errs.error()
    first = bad[0]
    assert (err.op, err.token_index, err.loc, err.count) == ("store_indexer_k", first, loc_list[first], len(bad))
    assert err.page == loc_list[first] // pps and err.num_pages == num_pages and err.pool_page_size == pps
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context
    pool = make_pool(num_pages, pps, d, 32, 7)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="store_indexer_k") as info:
        run_store(backend, pool, k, loc, 32, check="assert")
    assert info.value.token_index == first and info.value.loc == loc_list[first]
    assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_loc_outside_loc_map_is_reported_as_such(backend):
    pool = make_pool(2, 4, 32, 32, 9)
    original = pool.raw.clone()
    loc_map = torch.tensor([3, -1, 7, 0, 8], device=DEVICE)    # 8 is beyond the pool's 8 rows
    k = torch.ones(4, 32, device=DEVICE)
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, torch.tensor([0, 1, 5, 4], device=DEVICE), 32, check="guard",
              errors=errs, loc_map=loc_map)
    err = errs.error()
    assert (err.token_index, err.loc, err.kind, err.limit, err.count) == (2, 5, KIND_LOC_MAP, 5, 2)
    assert "outside loc_map (length 5)" in str(err)
    twin = pool.clone()
    twin.raw.copy_(original)
    run_store("torch", twin, k, torch.tensor([0, -1, -1, -1], device=DEVICE), 32, loc_map=loc_map)
    assert_same_bytes(pool, twin, original)


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_large_pool_int64_offsets(backend):
    """A page beyond byte 2**31: the page address needs int64 arithmetic."""
    d = 128
    num_pages = 2**31 // row_bytes(d, 128) + 3
    cache = torch.empty(num_pages, row_bytes(d, 128), dtype=torch.uint8, device=DEVICE)
    cache[0].zero_()
    cache[-1].zero_()
    k = torch.full((1, d), -2.0, dtype=torch.bfloat16, device=DEVICE)
    kvwrite.store_indexer_k(k, cache, torch.tensor([num_pages - 1], device=DEVICE), check="guard",
                            errors=kvwrite.ErrorBuffer(DEVICE), backend=backend)
    assert bool((cache[-1, :d] == 0xFE).all()) and bool((cache[0] == 0).all())   # -448
    assert cache[-1, d:].view(torch.float32).item() == f32(2.0 / 448)


# --- arguments, custom op ------------------------------------------------------------------

def args(**over):
    base = dict(k=torch.randn(3, 128), cache=torch.zeros(4, 16 * 132, dtype=torch.uint8), loc=torch.tensor([0, 5, 9]))
    base.update(over)
    return base


BAD = [
    (dict(k=torch.randn(3, 1, 128)), ValueError, "k must be 2-D"),
    (dict(k=torch.randn(3, 128).to(torch.int32)), TypeError, "k must have dtype"),
    (dict(k=torch.randn(128, 3).t()), ValueError, "k must be contiguous in its last dim"),
    (dict(k=torch.randn(3, 96)), ValueError, r"k's head dim \(96\) must be a multiple of quant_block_size \(128\)"),
    (dict(quant_block_size=0), ValueError, "quant_block_size must be a positive int"),
    (dict(quant_block_size=64.0), ValueError, "quant_block_size must be a positive int"),
    (dict(scale_fmt="e8m0"), ValueError, "scale_fmt must be one of"),
    (dict(cache=torch.zeros(4, 16 * 132)), TypeError, "cache must have dtype"),
    (dict(cache=torch.zeros(4, 16, 132, dtype=torch.uint8)), ValueError, "cache must be 2-D"),
    (dict(cache=torch.zeros(4, 16 * 132 + 1, dtype=torch.uint8)), ValueError, "not a whole number of tokens"),
    (dict(cache=torch.zeros(4, 0, dtype=torch.uint8)), ValueError, "not a whole number of tokens"),
    (dict(cache=torch.zeros(0, 132, dtype=torch.uint8)), ValueError, "at least one page"),
    (dict(loc=torch.tensor([0, 1])), ValueError, "loc must have one entry per token"),
    (dict(loc=torch.tensor([0.0, 1.0, 2.0])), TypeError, "loc must have dtype"),
    (dict(check="strict"), ValueError, "check must be one of"),
    (dict(loc_map=torch.zeros(4)), TypeError, "loc_map must have dtype"),
    (dict(check="guard", errors=torch.zeros(3)), TypeError, "errors must be"),
    (dict(backend="fast"), ValueError, "backend must be one of"),
]


@pytest.mark.parametrize("over, exc, msg", BAD, ids=[m for _, _, m in BAD])
def test_bad_arguments_raise_named_errors_before_any_write(over, exc, msg):
    a = args(**over)
    kw = {key: v for key, v in a.items() if key not in ("k", "cache", "loc")}
    kw.setdefault("backend", "torch")
    before = a["cache"].clone()
    with pytest.raises(exc, match=msg):
        kvwrite.store_indexer_k(a["k"], a["cache"], a["loc"], **kw)
    assert torch.equal(before, a["cache"])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dcp_size, dcp_rank", [(2, 1), (4, 0), (4, 3)])
def test_dcp_sharded_cache_keeps_this_ranks_tokens(backend, dcp_size, dcp_rank):
    """vLLM shards the indexer cache over the DCP ranks: virtual loc v is rank v % dcp_size's row
    v // dcp_size; other ranks' tokens (and -1) are skipped. Equal to the reference storing this
    rank's tokens at their local rows, canaries untouched; a local row past the cache is an error."""
    gen = torch.Generator().manual_seed(dcp_size * 10 + dcp_rank)
    pps, pages = 16, 3
    pool = make_pool(pages, pps, 128, 128, 7)
    ref, original = pool.clone(), pool.raw.clone()
    n = 40
    loc = torch.randperm(pages * pps * dcp_size, generator=gen)[:n]
    loc[::9] = -1
    k = keys(n, 128, torch.bfloat16, gen, strided=True)
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, loc.to(DEVICE), check="guard", errors=errs, dcp_rank=dcp_rank, dcp_size=dcp_size)
    local = torch.where((loc >= 0) & (loc % dcp_size == dcp_rank), loc // dcp_size, -1)
    run_store("torch", ref, k, local.to(DEVICE))
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None
    far = torch.tensor([pages * pps * dcp_size + dcp_rank], device=DEVICE)   # local row = capacity
    run_store(backend, pool, k[:1], far, check="guard", errors=errs, dcp_rank=dcp_rank, dcp_size=dcp_size)
    assert errs.error() is not None


def test_torch_compile_fullgraph_calls_the_custom_op():
    cache = torch.zeros(2, 4 * 132, dtype=torch.uint8)
    errors = kvwrite.ErrorBuffer("cpu")

    def layer(k, loc):
        k = k * 2
        kvwrite.store_indexer_k(k, cache, loc, scale_fmt="ue8m0", check="guard", errors=errors, backend="torch")
        return k.sum()

    compiled = torch.compile(layer, fullgraph=True, backend="eager")
    k = torch.randn(3, 128)
    compiled(k, torch.tensor([1, 20, 6]))
    got = kvwrite.read_indexer_k(cache, torch.tensor([1, 6]), 128)
    assert bool(((got - k[[0, 2]] * 2).abs() <= (k[[0, 2]] * 2).abs() / 8 + 1e-3).all())
    assert errors.error().loc == 20


def test_custom_op_is_registered():
    cache = torch.zeros(2, 4 * 132, dtype=torch.uint8)
    torch.ops.kvwrite.store_indexer_k(torch.full((1, 128), 448.0), cache, torch.tensor([5]), 128, None,
                                      "off", None, None, 0, 1, "torch")
    assert bool((cache[1, 128:256] == 0x7E).all()) and int((cache != 0).sum()) == 128 + 2  # scale 1.0


@pytest.mark.skipif(DEVICE.type != "cuda", reason="device asserts exist on a GPU only")
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_assert_in_subprocess(backend):
    """On a GPU the assert mode is a device-side assert: the process dies with it."""
    import subprocess
    import sys

    code = f"""
import torch, kvwrite
cache = torch.zeros(4, 16 * 132, dtype=torch.uint8, device="cuda")
k = torch.ones(3, 128, dtype=torch.bfloat16, device="cuda")
kvwrite.store_indexer_k(k, cache, torch.tensor([1, 64, -1], device="cuda"), check="assert", backend="{backend}")
torch.cuda.synchronize()
print("NOT REACHED")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "NOT REACHED" not in out.stdout
    assert "assert" in (out.stderr + out.stdout).lower(), out.stderr[-2000:]
