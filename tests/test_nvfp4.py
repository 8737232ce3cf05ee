"""store_kv_nvfp4 / dequant_nvfp4: every backend against the reference bit-exactly, the reference
against an independent scalar oracle, the documented error bound, canaries, checks, bad input."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes, paged_locs
from kvwrite.errors import KIND_LOC_MAP
from kvwrite.reference.nvfp4 import E2M1_VALUES, error_bound, quantize_nvfp4
from test_mla import inputs as mla_inputs  # strided projections; plain / SWA map / DCP routes

ALL = ["torch", *BACKENDS]
E4M3 = torch.float8_e4m3fn


def make_pool(layout, num_pages, pps, h, dk, dv, seed):
    def shape(w):
        return (num_pages, pps, h, w) if layout == "NHD" else (num_pages, h, pps, w)
    return CanaryBuffer({"k_cache": (shape(dk // 2), torch.uint8), "v_cache": (shape(dv // 2), torch.uint8),
                         "k_scale_cache": (shape(dk // 16), E4M3),
                         "v_scale_cache": (shape(dv // 16), E4M3)}, seed)


def run_store(backend, pool, k, v, loc, layout="NHD", kg=None, vg=None, check="off", errors=None, **kw):
    kvwrite.store_kv_nvfp4(k, v, pool["k_cache"], pool["v_cache"], pool["k_scale_cache"],
                           pool["v_scale_cache"], loc, k_global_scale=kg, v_global_scale=vg,
                           layout=layout, check=check, errors=errors, backend=backend, **kw)


def cache_rows(pool, name, layout):
    """[pages * pps, H, *] rows of a cache (canonical order whatever the layout)."""
    c = pool[name]
    return (c if layout == "NHD" else c.transpose(1, 2)).flatten(0, 1)


def global_scale(kind, gen):
    if kind is None:
        return None
    g = torch.rand(1, generator=gen) * 0.3 + 0.01
    return (g.reshape(()) if kind == "scalar" else g).to(DEVICE)


@st.composite
def cases(draw):
    pps = draw(st.sampled_from([1, 4, 16]))
    num_pages = draw(st.integers(1, max(1, 96 // pps) + 1))
    capacity = num_pages * pps
    return dict(
        dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
        h=draw(st.sampled_from([1, 2, 4])), dk=draw(st.sampled_from([16, 64, 128])),
        dv=draw(st.sampled_from([16, 64, 128])), pps=pps, num_pages=num_pages,
        n=min(draw(st.sampled_from([0, 1, 7, capacity]) | st.integers(0, capacity)), capacity),
        layout=draw(st.sampled_from(["NHD", "HND"])),
        kg=draw(st.sampled_from([None, "scalar", "one"])), vg=draw(st.sampled_from([None, "one"])),
        pad=draw(st.sampled_from([0.0, 0.25])), loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
        check=draw(st.sampled_from(["off", "assert", "guard"])),
        dcp=draw(st.sampled_from([(0, 1), (1, 2)])),
        zero_blocks=draw(st.booleans()), seed=draw(st.integers(0, 2**16)))


def inputs(c):
    gen = torch.Generator().manual_seed(c["seed"])
    # per-block magnitudes spread over many binades so scales cover e4m3's range (and beyond)
    def rows(d):
        x = torch.randn(c["n"], c["h"], d // 16, 16, generator=gen)
        x = x * torch.exp2(torch.randint(-12, 12, (c["n"], c["h"], d // 16, 1), generator=gen).float())
        if c["zero_blocks"]:
            x = x * (torch.rand(c["n"], c["h"], d // 16, 1, generator=gen) > 0.2)
        return x.reshape(c["n"], c["h"], d).to(c["dtype"]).to(DEVICE)
    k, v = rows(c["dk"]), rows(c["dv"])
    rank, size = c["dcp"]
    loc = paged_locs(c["n"], c["num_pages"] * c["pps"] * size, c["pps"], gen, c["pad"], c["loc_dtype"])
    return k, v, loc, global_scale(c["kg"], gen), global_scale(c["vg"], gen)


@pytest.mark.parametrize("backend", BACKENDS)
@given(c=cases())
def test_store_kv_nvfp4_matches_reference(backend, c):
    k, v, loc, kg, vg = inputs(c)
    pool = make_pool(c["layout"], c["num_pages"], c["pps"], c["h"], c["dk"], c["dv"], c["seed"])
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    rank, size = c["dcp"]
    run_store(backend, pool, k, v, loc, c["layout"], kg, vg, c["check"], errs, dcp_rank=rank, dcp_size=size)
    run_store("torch", ref, k, v, loc, c["layout"], kg, vg, c["check"], ref_errs, dcp_rank=rank, dcp_size=size)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


# --- the reference against an independent scalar oracle ----------------------------------------

def _e4m3_table() -> np.ndarray:
    """Every finite non-negative e4m3fn value, by code 0..126."""
    vals = []
    for code in range(127):
        e, m = code >> 3, code & 7
        vals.append(m * 2.0 ** -9 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7))
    return np.array(vals)


E4M3_TABLE = _e4m3_table()


def nearest_even(table, a: float) -> int:
    """Index of the value of `table` nearest to a >= 0, ties to the even index, saturating."""
    dist = np.abs(table - a)
    best = np.flatnonzero(dist == dist.min())
    return int(best[0] if best[0] % 2 == 0 or len(best) == 1 else best[1])


def oracle_block(x: np.ndarray, g: float) -> tuple[list[int], int]:
    """One block of 16 float32 values: (4-bit codes, e4m3 code), element by element."""
    f32 = np.float32
    s = f32(f32(np.abs(x).max()) / f32(6)) / f32(g)
    scode = nearest_even(E4M3_TABLE, min(float(s), 448.0))
    d = f32(f32(E4M3_TABLE[scode]) * f32(g))
    codes = []
    for xi in x:
        if d == 0:  # a block whose step is 0 keeps only each element's sign
            codes.append(8 if np.signbit(xi) else 0)
            continue
        y = f32(xi) / d
        codes.append(nearest_even(np.array(E2M1_VALUES), abs(float(y))) | (8 if np.signbit(y) else 0))
    return codes, scode


@pytest.mark.parametrize("g", [None, 0.0123, 3.0])
def test_reference_quantiser_matches_scalar_oracle(g):
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(24, 16, generator=gen) * torch.exp2(torch.randint(-14, 10, (24, 1), generator=gen).float())
    x[0] = 0
    x[1] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -1.25, -1.75, -2.5, -3.5, -5.0, -6.0])
    x[2, :8] = torch.tensor([1e-30, -1e-30, 2.0, 0, 0, 0, 0, 0])
    x[3] = x[3] * 1e5  # a block scale that saturates at 448 (with g=None / 0.0123)
    packed, scale = quantize_nvfp4(x, None if g is None else torch.tensor(g))
    for b in range(x.shape[0]):
        codes, scode = oracle_block(x[b].numpy().astype(np.float32), 1.0 if g is None else g)
        want = [codes[2 * i] | codes[2 * i + 1] << 4 for i in range(8)]
        assert packed[b].tolist() == want, b
        assert scale[b].view(torch.uint8).item() == scode, b


def test_format_facts_ties_nibbles_zero_and_saturation():
    x = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.1, -6.0, 0, 0, 0, 0, 0, 0]] * 2)
    x[1] = 0
    packed, scale = quantize_nvfp4(x)  # amax 6 -> block scale 1, d = 1
    assert scale.float().tolist() == [[1.0], [0.0]]
    # codes: 0.25->0, 0.75->2 (1.0), 1.25->2, 1.75->4 (2.0), 2.5->4, 3.5->6 (4.0), 5->6, 6->7;
    # -0.1 -> -0 (8), -6 -> 15; even element in the low nibble
    assert packed[0].tolist() == [0 | 2 << 4, 2 | 4 << 4, 4 | 6 << 4, 6 | 7 << 4, 8 | 15 << 4, 0, 0, 0]
    assert packed[1].tolist() == [0] * 8
    deq = kvwrite.dequant_nvfp4(packed, scale)
    assert deq[0, :10].tolist() == [0, 1, 1, 2, 2, 4, 4, 6, 0, -6] and deq[1].abs().sum() == 0
    huge, s = quantize_nvfp4(torch.full((1, 16), 1e6))
    assert s.float().item() == 448 and huge[0].tolist() == [0x77] * 8


# --- the documented error bound ---------------------------------------------------------------

@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("g", [None, 0.05])
def test_round_trip_within_documented_bound(backend, dtype, g):
    """Stored rows read back with dequant_nvfp4 are within d * h(|x'| / d) of the input wherever
    the block scale is in e4m3's normal range, and err / amax stays below 0.18."""
    n, h, d, pps = 64, 2, 128, 16
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(n, h, d // 16, 16, generator=gen)
    x = x * torch.exp2(torch.randint(-5, 8, (n, h, d // 16, 1), generator=gen).float())
    x = x.reshape(n, h, d).to(dtype).to(DEVICE)
    gs = None if g is None else torch.tensor(g, device=DEVICE)
    pool = make_pool("NHD", n // pps, pps, h, d, d, 9)
    loc = torch.randperm(n, generator=gen).to(DEVICE)
    run_store(backend, pool, x, x, loc, kg=gs, vg=gs)
    rows = loc.long()
    deq = kvwrite.dequant_nvfp4(cache_rows(pool, "k_cache", "NHD")[rows],
                                cache_rows(pool, "k_scale_cache", "NHD")[rows], gs)
    assert torch.equal(deq, kvwrite.dequant_nvfp4(cache_rows(pool, "v_cache", "NHD")[rows],
                                                  cache_rows(pool, "v_scale_cache", "NHD")[rows], gs))
    xf = x.float()
    amax = xf.reshape(n, h, d // 16, 16).abs().amax(-1)
    s = amax / 6 / (1.0 if g is None else g)
    normal = ((s >= 2.0 ** -6) & (s <= 448)).repeat_interleave(16, -1)
    assert normal.float().mean() > 0.9
    err = (xf - deq).abs()
    bound = error_bound(xf, deq, cache_rows(pool, "k_scale_cache", "NHD")[rows], gs)
    assert bool((err <= bound * (1 + 2 ** -20))[normal].all())
    ratio = (err / amax.repeat_interleave(16, -1))[normal]
    assert float(ratio.max()) < 0.18
    assert float((err / bound)[normal].max()) > 0.9  # the bound is tight, not vacuous


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_strided_k_v_slices_of_a_qkv_projection(backend, layout):
    """k and v as head slices of one [N, 3H, D] projection (token stride 3*H*D, head stride D)."""
    n, h, d, pps = 20, 2, 32, 4
    qkv = torch.randn(n, 3 * h, d, generator=torch.Generator().manual_seed(12)).to(torch.float16).to(DEVICE)
    k, v = qkv[:, h:2 * h], qkv[:, 2 * h:]
    assert not k.is_contiguous()
    loc = torch.randperm(6 * pps, generator=torch.Generator().manual_seed(13))[:n].to(DEVICE)
    pool = make_pool(layout, 6, pps, h, d, d, 14)
    ref, original = pool.clone(), pool.raw.clone()
    g = torch.tensor(1.7, device=DEVICE)
    run_store(backend, pool, k, v, loc, layout, g, None, "guard", kvwrite.ErrorBuffer(DEVICE))
    run_store("torch", ref, k.contiguous(), v.contiguous(), loc, layout, g, None)
    assert_same_bytes(pool, ref, original)


# --- out-of-range locs, canaries, records -----------------------------------------------------

@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_out_of_range_guard_and_assert(backend, layout):
    pps, num_pages, h, d = 4, 3, 2, 32
    capacity = pps * num_pages
    loc_list = [0, capacity + 5, -1, 3, -4, capacity * 100, capacity - 1]
    bad = [1, 4, 5]
    loc = torch.tensor(loc_list, device=DEVICE)
    gen = torch.Generator().manual_seed(3)
    k = torch.randn(len(loc_list), h, d, generator=gen).to(DEVICE)
    pool = make_pool(layout, num_pages, pps, h, d, d, 17)
    original, good = pool.raw.clone(), pool.clone()
    keep = torch.tensor([-1 if i in bad else l for i, l in enumerate(loc_list)], device=DEVICE)
    run_store("torch", good, k, k, keep, layout)
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, k, loc, layout, check="guard", errors=errs)
    assert_same_bytes(pool, good, original)
    err = errs.error()
    assert (err.op, err.token_index, err.loc, err.count, err.page) == ("store_kv_nvfp4", 1, capacity + 5, 3, (capacity + 5) // pps)
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context
    pool = make_pool(layout, num_pages, pps, h, d, d, 17)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="store_kv_nvfp4: 3 bad token.*token 1 writes loc"):
        run_store(backend, pool, k, k, loc, layout, check="assert")
    assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])


@pytest.mark.parametrize("backend", ALL)
def test_swa_map_and_dcp(backend):
    """loc -> loc_map -> DCP as store_kv: rank 1 of 2; a loc past the map is KIND_LOC_MAP."""
    h, d, pps, pages = 1, 16, 2, 2
    loc_map = torch.tensor([3, -1, 5, 0, 7, 2, 1, 9], device=DEVICE)
    loc = torch.tensor([0, 1, 2, 4, 6, 7, 8, 5], device=DEVICE)
    k = torch.randn(8, h, d, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    pool = make_pool("NHD", pages, pps, h, d, d, 19)
    original, ref = pool.raw.clone(), pool.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    for p, b, e in ((pool, backend, errs), (ref, "torch", ref_errs)):
        run_store(b, p, k, k, loc, check="guard", errors=e, loc_map=loc_map, dcp_rank=1, dcp_size=2)
    assert_same_bytes(pool, ref, original)
    assert torch.equal(errs.tensor, ref_errs.tensor)
    err = errs.error()
    # token 0: 3 -> rank 1 local 1; token 1: -1 (skipped); token 2: 5 -> local 2; token 3: 7 -> local 3;
    # token 4: 1 -> local 0; token 5: 9 -> local 4 (bad); token 6: loc 8 outside the map; token 7: 2 -> rank 0
    assert (err.token_index, err.target, err.count) == (5, 4, 2)
    errs.reset()
    run_store(backend, pool, k[6:], k[6:], loc[6:], check="guard", errors=errs, loc_map=loc_map, dcp_rank=1, dcp_size=2)
    assert errs.error().kind == KIND_LOC_MAP and errs.error().loc == 8
    written = cache_rows(pool, "k_cache", "NHD")[1]
    packed, _ = quantize_nvfp4(k[0:1])
    assert torch.equal(written, packed[0])


# --- API --------------------------------------------------------------------------------------

def api_args(**over):
    base = dict(k=torch.randn(3, 2, 32), v=torch.randn(3, 2, 16),
                k_cache=torch.zeros(4, 8, 2, 16, dtype=torch.uint8), v_cache=torch.zeros(4, 8, 2, 8, dtype=torch.uint8),
                k_scale_cache=torch.zeros(4, 8, 2, 2, dtype=E4M3), v_scale_cache=torch.zeros(4, 8, 2, 1, dtype=E4M3),
                loc=torch.tensor([0, 5, 9]))
    base.update(over)
    return base


BAD = [
    (dict(k=torch.randn(3, 2, 24), k_cache=torch.zeros(4, 8, 2, 12, dtype=torch.uint8)), ValueError, "k head_dim must be a multiple of 16"),
    (dict(v=torch.randn(3, 2, 8)), ValueError, "v head_dim must be a multiple of 16"),
    (dict(k_cache=torch.zeros(4, 8, 2, 16, dtype=torch.float16)), TypeError, "k_cache must have dtype in \\(uint8\\)"),
    (dict(k_cache=torch.zeros(4, 8, 2, 32, dtype=torch.uint8)), ValueError, r"k_cache must have shape \[4, 8, 2, 16\] \(NHD: num_pages, pool_page_size, H, D/2\)"),
    (dict(v_cache=torch.zeros(4, 4, 2, 8, dtype=torch.uint8)), ValueError, "v_cache must have shape"),
    (dict(k_scale_cache=torch.zeros(4, 8, 2, 2, dtype=torch.uint8)), TypeError, "k_scale_cache must have dtype in \\(float8_e4m3fn\\)"),
    (dict(v_scale_cache=torch.zeros(4, 8, 2, 2, dtype=E4M3)), ValueError, r"v_scale_cache must have shape .*Dv/16"),
    (dict(k_global_scale=torch.ones(2)), ValueError, r"k_global_scale must have shape \[\], \[1\]"),
    (dict(v_global_scale=torch.ones(1, dtype=torch.float64)), TypeError, "v_global_scale must have dtype"),
    (dict(layout="NDH"), ValueError, "layout must be one of"),
    (dict(check="x"), ValueError, "check must be one of"),
    (dict(loc=torch.tensor([0, 1])), ValueError, "loc must have one entry per token"),
    (dict(dcp_rank=1), ValueError, "dcp_rank must be"),
    (dict(k=torch.randn(3, 2, 32).to(torch.int32)), TypeError, "k must have dtype"),
]


@pytest.mark.parametrize("over, exc, msg", BAD, ids=[m[:40] for _, _, m in BAD])
def test_bad_arguments_raise_named_errors(over, exc, msg):
    a = api_args(**{k: v for k, v in over.items() if k in api_args()})
    kw = {k: v for k, v in over.items() if k not in a}
    before = [a[n].clone() for n in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")]
    with pytest.raises(exc, match=msg):
        kvwrite.store_kv_nvfp4(a["k"], a["v"], a["k_cache"], a["v_cache"], a["k_scale_cache"],
                               a["v_scale_cache"], a["loc"], backend="torch", **kw)
    after = [a[n] for n in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache")]
    assert all(torch.equal(b.view(torch.uint8), c.view(torch.uint8)) for b, c in zip(before, after))


def test_dequant_bad_arguments():
    with pytest.raises(TypeError, match="dequant_nvfp4 takes uint8"):
        kvwrite.dequant_nvfp4(torch.zeros(2, 8), torch.zeros(2, 1, dtype=E4M3))
    with pytest.raises(ValueError, match="disagree"):
        kvwrite.dequant_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.zeros(2, 2, dtype=E4M3))


def test_custom_op_and_torch_compile():
    a = api_args()
    errors = kvwrite.ErrorBuffer("cpu")

    def layer(k, v, loc):
        kvwrite.store_kv_nvfp4(k * 2, v, a["k_cache"], a["v_cache"], a["k_scale_cache"],
                               a["v_scale_cache"], loc, check="guard", errors=errors, backend="torch")
        return k.sum()

    torch.compile(layer, fullgraph=True, backend="eager")(a["k"], a["v"], torch.tensor([1, 20, 70]))
    packed, scale = quantize_nvfp4(a["k"] * 2)
    assert torch.equal(a["k_cache"].flatten(0, 1)[20], packed[1])
    assert torch.equal(a["k_scale_cache"].flatten(0, 1)[1].view(torch.uint8), scale[0].view(torch.uint8))
    assert errors.error().loc == 70
    torch.ops.kvwrite.store_kv_nvfp4(a["k"], a["v"], a["k_cache"], a["v_cache"], a["k_scale_cache"],
                                     a["v_scale_cache"], torch.tensor([3, -1, 4]), None, None, "NHD",
                                     "off", None, None, 0, 1, "torch")
    assert torch.equal(a["v_cache"].flatten(0, 1)[4], quantize_nvfp4(a["v"])[0][2])


# --- MLA rows in NVFP4 (store_mla kv_cache_dtype="nvfp4") --------------------------------------

def mla_pool(num_pages, pps, lora, rope, seed):
    return CanaryBuffer({"kv_cache": ((num_pages, pps, (lora + rope) // 2), torch.uint8),
                         "scale_cache": ((num_pages, pps, (lora + rope) // 16), E4M3)}, seed)


def run_mla(backend, pool, kv_c, k_pe, loc, g=None, check="off", errors=None, **kw):
    kvwrite.store_mla(kv_c, k_pe, pool["kv_cache"], loc, kv_cache_dtype="nvfp4",
                      scale_cache=pool["scale_cache"], global_scale=g, check=check, errors=errors,
                      backend=backend, **kw)


@st.composite
def mla_cases(draw):
    pps = draw(st.sampled_from([1, 16]))
    num_pages = draw(st.integers(1, max(1, 64 // pps) + 1))
    capacity = num_pages * pps
    lora, rope = draw(st.sampled_from([(512, 64), (40, 24), (96, 16), (8, 8)]))  # 40+24: a straddling block
    return dict(dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                lora=lora, rope=rope, pps=pps, num_pages=num_pages,
                n=min(draw(st.sampled_from([0, 1, 7, capacity]) | st.integers(0, capacity)), capacity),
                strided=draw(st.booleans()), scale=None, pad=draw(st.sampled_from([0.0, 0.25])),
                loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                route=draw(st.sampled_from(["plain", "loc_map", "dcp"])),
                g=draw(st.sampled_from([None, "scalar", "one"])),
                check=draw(st.sampled_from(["off", "assert", "guard"])), seed=draw(st.integers(0, 2**16)))


@pytest.mark.parametrize("backend", BACKENDS)
@given(c=mla_cases())
def test_store_mla_nvfp4_matches_reference(backend, c):
    kv_c, k_pe, loc, _, kw = mla_inputs(c)
    g = global_scale(c["g"], torch.Generator().manual_seed(c["seed"]))
    pool = mla_pool(c["num_pages"], c["pps"], c["lora"], c["rope"], c["seed"])
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    run_mla(backend, pool, kv_c, k_pe, loc, g, c["check"], errs, **kw)
    run_mla("torch", ref, kv_c, k_pe, loc, g, c["check"], ref_errs, **kw)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


@pytest.mark.parametrize("backend", ALL)
def test_mla_nvfp4_rows_are_the_quantised_concatenation_within_bound(backend):
    """Row = quantize_nvfp4(concat(kv_c, k_pe)); read back within the documented bound."""
    n, lora, rope, pps = 32, 40, 24, 8  # block 2 straddles kv_c and k_pe
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(n, lora + rope, generator=gen) * torch.exp2(torch.randint(-4, 6, (n, 1), generator=gen).float())
    x = x.to(torch.bfloat16).to(DEVICE)
    kv_c, k_pe = x[:, :lora], x[:, lora:]
    g = torch.tensor([0.5], device=DEVICE)
    pool = mla_pool(n // pps, pps, lora, rope, 6)
    original = pool.raw.clone()
    loc = torch.randperm(n, generator=gen).to(DEVICE)
    run_mla(backend, pool, kv_c, k_pe, loc, g, "guard", kvwrite.ErrorBuffer(DEVICE))
    rows = pool["kv_cache"].flatten(0, 1)[loc.long()]
    scales = pool["scale_cache"].flatten(0, 1)[loc.long()]
    packed, scale = quantize_nvfp4(x, g)
    assert torch.equal(rows, packed) and torch.equal(scales.view(torch.uint8), scale.view(torch.uint8))
    deq = kvwrite.dequant_nvfp4(rows, scales, g)
    assert bool(((x.float() - deq).abs() <= error_bound(x.float(), deq, scales, g) * (1 + 2 ** -20)).all())
    assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])


@pytest.mark.parametrize("backend", ALL)
def test_mla_nvfp4_out_of_range_guard_and_assert(backend):
    pps, pages, lora, rope = 4, 2, 16, 16
    loc_list = [1, 9, -1, 7, -3]
    loc = torch.tensor(loc_list, device=DEVICE)
    x = torch.randn(5, lora + rope, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    pool = mla_pool(pages, pps, lora, rope, 10)
    original, good = pool.raw.clone(), pool.clone()
    run_mla("torch", good, x[:, :lora], x[:, lora:], torch.tensor([1, -1, -1, 7, -1], device=DEVICE))
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_mla(backend, pool, x[:, :lora], x[:, lora:], loc, check="guard", errors=errs)
    assert_same_bytes(pool, good, original)
    err = errs.error()
    assert (err.op, err.token_index, err.loc, err.count) == ("store_mla", 1, 9, 2)
    if DEVICE.type == "cuda" and backend != "torch":
        return
    pool = mla_pool(pages, pps, lora, rope, 10)
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 1 writes loc 9"):
        run_mla(backend, pool, x[:, :lora], x[:, lora:], loc, check="assert")
    assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])


def mla_args(**over):
    base = dict(kv_c=torch.randn(2, 40), k_pe=torch.randn(2, 24), kv_cache=torch.zeros(3, 4, 32, dtype=torch.uint8),
                scale_cache=torch.zeros(3, 4, 4, dtype=E4M3))
    base.update(over)
    return base


MLA_BAD = [
    (dict(k_pe=torch.randn(2, 20), kv_cache=torch.zeros(3, 4, 30, dtype=torch.uint8)), ValueError,
     "kv_cache_dtype='nvfp4' needs kv_lora_rank \\+ rope_dim to be a multiple of 16, got 40 \\+ 20"),
    (dict(scale_cache=None), ValueError, "scale_cache is required for kv_cache_dtype='nvfp4'"),
    (dict(scale_cache=torch.zeros(3, 4, 4, dtype=torch.uint8)), TypeError, "scale_cache must have dtype"),
    (dict(scale_cache=torch.zeros(3, 4, 8, dtype=E4M3)), ValueError, r"scale_cache must have shape \[3, 4, 4\]"),
    (dict(scale_cache=torch.zeros(3, 2, 4, dtype=E4M3)), ValueError, r"scale_cache must have shape \[3, 4, 4\]"),
    (dict(kv_cache=torch.zeros(3, 4, 64, dtype=torch.uint8)), ValueError, "kv_cache must have shape"),
    (dict(kv_cache=torch.zeros(3, 4, 32, dtype=torch.bfloat16)), TypeError, "kv_cache must have dtype"),
    (dict(global_scale=torch.ones(3)), ValueError, "global_scale must have shape"),
]


@pytest.mark.parametrize("over, exc, msg", MLA_BAD, ids=[m[:40] for _, _, m in MLA_BAD])
def test_mla_nvfp4_bad_arguments(over, exc, msg):
    a = mla_args(**over)
    with pytest.raises(exc, match=msg):
        kvwrite.store_mla(a["kv_c"], a["k_pe"], a["kv_cache"], torch.tensor([0, 1]), kv_cache_dtype="nvfp4",
                          scale_cache=a["scale_cache"], global_scale=a.get("global_scale"), backend="torch")


def test_mla_scale_cache_only_for_nvfp4_and_custom_op():
    a = mla_args()
    with pytest.raises(ValueError, match="scale_cache/global_scale apply only to kv_cache_dtype 'nvfp4'"):
        kvwrite.store_mla(a["kv_c"], a["k_pe"], torch.zeros(3, 4, 64), torch.tensor([0, 1]),
                          scale_cache=a["scale_cache"], backend="torch")
    g = torch.tensor(2.0)

    def layer(kv_c, k_pe, loc):
        kvwrite.store_mla(kv_c, k_pe, a["kv_cache"], loc, kv_cache_dtype="nvfp4",
                          scale_cache=a["scale_cache"], global_scale=g, backend="torch")
        return kv_c.sum()

    torch.compile(layer, fullgraph=True, backend="eager")(a["kv_c"], a["k_pe"], torch.tensor([5, -1]))
    packed, scale = quantize_nvfp4(torch.cat([a["kv_c"], a["k_pe"]], -1), g)
    assert torch.equal(a["kv_cache"].flatten(0, 1)[5], packed[0])
    assert torch.equal(a["scale_cache"].flatten(0, 1)[5].view(torch.uint8), scale[0].view(torch.uint8))


def test_mla_nvfp4_auto_skips_backends_without_an_implementation():
    """A format whose IMPLS table lacks a backend: "auto" skips it, an explicit request is a
    clear BackendUnavailable (the C++/CUDA extension now implements NVFP4 MLA itself: this
    checks the mechanism with a table that lacks "cpu")."""
    from kvwrite import backend as backends

    table = tuple(b for b, _ in kvwrite.ops.mla.NVFP4_IMPLS if b != "cpu")
    assert backends.resolve("auto", torch.device("cpu"), "store_mla", table) in ("triton", "torch")
    with pytest.raises(kvwrite.BackendUnavailable, match="backend='cpu' is unavailable on cpu"):
        backends.resolve("cpu", torch.device("cpu"), "store_mla", table)
    a = mla_args()
    kvwrite.store_mla(a["kv_c"], a["k_pe"], a["kv_cache"], torch.tensor([0, 1]), kv_cache_dtype="nvfp4",
                      scale_cache=a["scale_cache"])
    assert torch.equal(a["kv_cache"].flatten(0, 1)[1], quantize_nvfp4(torch.cat([a["kv_c"], a["k_pe"]], -1))[0][1])
