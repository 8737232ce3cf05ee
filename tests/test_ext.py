"""The C++/CUDA extension's kernels (backend "cpu" here, "cuda" on a GPU) beyond the shared
matrices: exact fp8 rounding, vector/scalar copy paths, SWA loc_map + DCP with exact guard
records, and multithreaded records."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes

EXT = [b for b in BACKENDS if b in ("cpu", "cuda")]
pytestmark = pytest.mark.skipif(not EXT, reason="the C++/CUDA extension is unavailable here")


def only_good_locs(check):
    """`off` has no defined behaviour for bad locs, and on a GPU `assert` kills the context
    (the device assert is tested in a subprocess): give those only good locs."""
    return check == "off" or (check == "assert" and DEVICE.type == "cuda")


def store(backend, k, v, kc, vc, loc, **kw):
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend, **kw)


@pytest.mark.parametrize("backend", EXT)
@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp8_rounding_is_bit_exact_for_every_bf16_value_and_midpoint(backend, fp8):
    """Every finite bf16 value and every midpoint between neighbours (ties), through the kernel's
    saturate(x / 1), equals torch's own cast on the CPU."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    vals = bits[torch.isfinite(bits)]
    mids = (vals.sort().values[:-1] + vals.sort().values[1:]) / 2
    x = torch.cat([vals, mids[torch.isfinite(mids)]])
    x = torch.cat([x, x.new_zeros((-x.numel()) % 64)]).reshape(-1, 1, 64).to(DEVICE)
    n = x.shape[0]
    kc = torch.zeros(n, 1, 1, 64, dtype=fp8, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    store(backend, x, x, kc, kc.clone(), torch.arange(n, device=DEVICE), k_scale=one, v_scale=one)
    fmax = 448.0 if fp8 == torch.float8_e4m3fn else 57344.0
    want = x.cpu().clamp(-fmax, fmax).to(fp8).view(torch.uint8).reshape(n, 1, 1, 64)
    got = kc.cpu().view(torch.uint8)
    assert torch.equal(got, want), f"{int((got != want).sum())} codes differ"


@pytest.mark.parametrize("backend", EXT)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d, token_pad", [(64, 0), (64, 1), (6, 0), (3, 0)])
def test_vector_and_scalar_copy_paths(backend, dtype, d, token_pad):
    """16-byte units where every row is aligned; smaller units for odd strides / odd rows."""
    h, pps, pages, n = 3, 4, 5, 17
    gen = torch.Generator().manual_seed(d + token_pad)
    src = torch.randn(n, h * d + token_pad, generator=gen).to(dtype).to(DEVICE)
    k = src[:, token_pad:].reshape(n, h, d) if token_pad else src.reshape(n, h, d)
    v = (k * 2).contiguous()
    pool = CanaryBuffer({"k_cache": ((pages, pps, h, d), dtype), "v_cache": ((pages, pps, h, d), dtype)}, seed=d)
    ref, original = pool.clone(), pool.raw.clone()
    loc = torch.randperm(pages * pps, generator=gen)[:n].to(DEVICE)
    store(backend, k, v, pool["k_cache"], pool["v_cache"], loc)
    store("torch", k, v, ref["k_cache"], ref["v_cache"], loc)
    assert_same_bytes(pool, ref, original)


@st.composite
def map_dcp_cases(draw):
    dcp = draw(st.sampled_from([1, 2, 4]))
    pps = draw(st.sampled_from([1, 4, 16]))
    pages = draw(st.integers(1, 6))
    map_len = draw(st.integers(1, 3 * pages * pps * dcp))
    return dict(dcp=dcp, rank=draw(st.integers(0, dcp - 1)), pps=pps, pages=pages, map_len=map_len,
                n=draw(st.integers(0, 300)), use_map=draw(st.booleans()),
                check=draw(st.sampled_from(["off", "guard", "assert"])), seed=draw(st.integers(0, 2**16)),
                fp8=draw(st.sampled_from([None, torch.float8_e4m3fn])))


@pytest.mark.parametrize("backend", EXT)
@given(c=map_dcp_cases())
def test_loc_map_and_dcp_match_reference_including_the_record(backend, c):
    """SWA translation (-1 entries, entries past the pool, locs past the map) composed with DCP
    sharding: the same bytes as the reference, and in guard mode the identical record tensor
    (many bad tokens race for the packed-min slots)."""
    gen = torch.Generator().manual_seed(c["seed"])
    h, d = 2, 16
    cap_local = c["pages"] * c["pps"]
    virt = cap_local * c["dcp"]
    check = c["check"]
    loc_map = None
    if c["use_map"]:  # an injective map (no two locs share a row), with -1 holes and bad rows
        loc_map = torch.randperm(max(c["map_len"], virt + 8), generator=gen)[:c["map_len"]] - 1
        loc_map[torch.rand(c["map_len"], generator=gen) < 0.2] = -1
        if only_good_locs(check):
            loc_map[loc_map >= virt] = -1
        loc_map = loc_map.to(torch.int32).to(DEVICE)
    hi = c["map_len"] if c["use_map"] else virt
    # unique good locs (a written row has one writer), padding, and bad ones in checked modes
    good = torch.randperm(hi, generator=gen)[:c["n"]]
    r = torch.randint(0, 8, (c["n"],), generator=gen)
    loc = torch.where(torch.rand(c["n"], generator=gen) < 0.1, -1, torch.where(r < 2, r - 3, hi + r - 2))
    keep = torch.rand(c["n"], generator=gen) < 0.7
    loc[: good.numel()] = torch.where(keep[: good.numel()], good, loc[: good.numel()])
    if only_good_locs(check):
        loc[(loc < -1) | (loc >= hi)] = -1
        loc[: good.numel()] = torch.where(keep[: good.numel()], good, -1)
    loc = loc[torch.randperm(c["n"], generator=gen)].to(DEVICE)
    k = torch.randn(c["n"], h, d, generator=gen).to(DEVICE)
    v = torch.randn(c["n"], h, d, generator=gen).to(DEVICE)
    cache = c["fp8"] or torch.float32
    scales = dict(k_scale=torch.tensor([0.3], device=DEVICE), v_scale=torch.tensor([0.7], device=DEVICE)) if c["fp8"] else {}
    shape = (c["pages"], c["pps"], h, d)
    pool = CanaryBuffer({"k_cache": (shape, cache), "v_cache": (shape, cache)}, seed=c["seed"])
    kw = dict(loc_map=loc_map, dcp_rank=c["rank"], dcp_size=c["dcp"], check=check, **scales)
    compare_with_reference(
        backend, lambda b, p, e: store(b, k, v, p["k_cache"], p["v_cache"], loc, errors=e, **kw), pool, check)


@pytest.mark.parametrize("backend", EXT)
def test_many_threads_record_the_lowest_bad_token(backend):
    """Thousands of bad and repeated tokens over many parallel chunks / thread blocks: the record
    is exactly the reference's (count, and the lowest token's fields in every slot)."""
    n, cap = 5000, 64
    gen = torch.Generator().manual_seed(0)
    loc = torch.randint(-1, cap * 3, (n,), generator=gen)
    loc[:1000] = torch.randint(0, cap, (1000,), generator=gen)
    loc = loc.to(DEVICE)
    k = torch.randn(n, 1, 8, generator=gen).to(DEVICE)
    kc = torch.zeros(cap // 16, 16, 1, 8, device=DEVICE)
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    store(backend, k, k, kc, kc.clone(), loc, check="guard", errors=errs)
    store("torch", k, k, kc.clone(), kc.clone(), loc, check="guard", errors=ref_errs)
    assert torch.equal(errs.tensor.cpu(), ref_errs.tensor.cpu())
    lc = loc.cpu()
    bad = int(((lc >= cap) | (lc < -1)).sum())
    good = lc[(lc >= 0) & (lc < cap)]
    repeats = good.numel() - good.unique().numel()   # every later writer of a row is a duplicate
    assert errs.error().count == bad + repeats


def test_direct_op_call_assert_throws_with_the_details():
    """torch.ops.kvwrite_ext.* called directly (no kvwrite wrapper): a clear RuntimeError."""
    if "cpu" not in EXT:
        pytest.skip("cpu backend unavailable")
    kc = torch.zeros(2, 4, 1, 8)
    k = torch.ones(2, 1, 8)
    with pytest.raises(RuntimeError, match=r"check=assert.*token 1 loc 8 \(local 8\) page 2, pool has 2 pages of 4 rows"):
        torch.ops.kvwrite_ext.store_kv(k, k, kc, kc.clone(), None, None, torch.tensor([0, 8]), None, None,
                                       0, 1, 1, 0)
    assert not kc.any()


# --- store_mla and store_indexer_k --------------------------------------------------------------

def mixed_locs(gen, n, hi, check):
    """Unique good locs in [0, hi) (a row has one writer), -1 padding, and in checked modes bad
    locs (negative or past hi) of which several tokens may share one."""
    good = torch.randperm(hi, generator=gen)[:n]
    r = torch.randint(0, 8, (n,), generator=gen)
    loc = torch.where(torch.rand(n, generator=gen) < 0.1, -1, torch.where(r < 2, r - 3, hi + r - 2))
    if only_good_locs(check):
        loc[:] = -1
    keep = torch.rand(good.numel(), generator=gen) < (0.9 if only_good_locs(check) else 0.7)
    loc[: good.numel()] = torch.where(keep, good, loc[: good.numel()])
    return loc[torch.randperm(n, generator=gen)].to(DEVICE)


def compare_with_reference(backend, store_fn, pool, check):
    """Run `store_fn(backend, pool, errors)` and the reference on a twin pool: the same bytes,
    untouched canaries, the same record, or the same OutOfBoundsWrite in assert mode."""
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    raised = []
    for b, p, e in ((backend, pool, errs), ("torch", ref, ref_errs)):
        try:
            store_fn(b, p, e)
        except kvwrite.OutOfBoundsWrite as exc:
            raised.append((exc.op, exc.token_index, exc.loc, exc.target, exc.limit, exc.kind, exc.count))
    if check == "assert" and raised:
        assert len(raised) == 2 and raised[0] == raised[1]
        assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])
        return
    assert not raised
    assert_same_bytes(pool, ref, original)
    assert torch.equal(errs.tensor.cpu(), ref_errs.tensor.cpu())


MLA_FORMATS = {"auto": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "fp8_ds_mla": torch.uint8}


def _pool_case(draw) -> dict:
    """The fields every store case draws: input dtype, pool shape, tokens, strided input, check, seed."""
    return dict(dtype=draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16])),
                pps=draw(st.sampled_from([1, 16, 64])), pages=draw(st.integers(1, 4)), n=draw(st.integers(0, 70)),
                strided=draw(st.booleans()), check=draw(st.sampled_from(["off", "assert", "guard"])),
                seed=draw(st.integers(0, 2**16)))


@st.composite
def mla_cases(draw):
    fmt = draw(st.sampled_from(sorted(MLA_FORMATS)))
    lora = draw(st.sampled_from([512, 128, 256] if fmt == "fp8_ds_mla" else [512, 16, 33]))
    return dict(fmt=fmt, lora=lora, rope=draw(st.sampled_from([64, 8, 3])),
                map_dcp=draw(st.booleans()), **_pool_case(draw))


@pytest.mark.parametrize("backend", EXT)
@given(c=mla_cases())
def test_store_mla_matches_reference(backend, c):
    gen = torch.Generator().manual_seed(c["seed"])
    n, lora, rope, fmt = c["n"], c["lora"], c["rope"], c["fmt"]
    proj = (torch.randn(n, lora + rope + (5 if c["strided"] else 0), generator=gen) * 4)
    proj[:, : lora // 3] *= 1e-3  # small and subnormal fp8 codes, tiles of very different scales
    proj = proj.to(c["dtype"]).to(DEVICE)
    kv_c, k_pe = proj[:, :lora], proj[:, proj.shape[1] - rope:]
    if not c["strided"]:
        kv_c, k_pe = kv_c.contiguous(), k_pe.contiguous()
    width = kvwrite.ops.mla.FORMATS[fmt].row_width(lora, rope)
    cache_dtype = MLA_FORMATS[fmt] or c["dtype"]
    pool = CanaryBuffer({"kv_cache": ((c["pages"], c["pps"], width), cache_dtype)}, seed=c["seed"])
    scale = (torch.rand((), generator=gen) + 0.05).to(DEVICE) if fmt.startswith("fp8_e") else None
    dcp = 2 if c["map_dcp"] else 1
    virt = c["pages"] * c["pps"] * dcp
    loc_map = (torch.randperm(virt + 4, generator=gen) - 1).to(DEVICE) if c["map_dcp"] else None
    if loc_map is not None and only_good_locs(c["check"]):
        loc_map[loc_map >= virt] = -1
    loc = mixed_locs(gen, n, virt + 4 if c["map_dcp"] else virt, c["check"])

    def store(b, p, e):
        kvwrite.store_mla(kv_c, k_pe, p["kv_cache"], loc, kv_cache_dtype=fmt, scale=scale, check=c["check"],
                          errors=e, loc_map=loc_map, dcp_rank=1 if dcp > 1 else 0, dcp_size=dcp, backend=b)

    compare_with_reference(backend, store, pool, c["check"])


@st.composite
def indexer_cases(draw):
    qbs = draw(st.sampled_from([128, 64, 32]))
    return dict(qbs=qbs, d=qbs * draw(st.sampled_from([1, 2, 4])), ue8m0=draw(st.booleans()),
                use_map=draw(st.booleans()), **_pool_case(draw))


@pytest.mark.parametrize("backend", EXT)
@given(c=indexer_cases())
def test_store_indexer_k_matches_reference(backend, c):
    gen = torch.Generator().manual_seed(c["seed"])
    n, d, qbs = c["n"], c["d"], c["qbs"]
    k = torch.randn(n, d + (3 if c["strided"] else 0), generator=gen) * 2
    k[: n // 3] *= 1e-6  # amax below the 1e-4 floor
    k = k.to(c["dtype"]).to(DEVICE)[:, :d]
    if not c["strided"]:
        k = k.contiguous()
    row = d + (d // qbs) * 4
    pool = CanaryBuffer({"cache": ((c["pages"], c["pps"] * row), torch.uint8)}, seed=c["seed"])
    cap = c["pages"] * c["pps"]
    loc_map = (torch.randperm(cap + 4, generator=gen) - 1).to(torch.int32).to(DEVICE) if c["use_map"] else None
    if loc_map is not None and only_good_locs(c["check"]):
        loc_map[loc_map >= cap] = -1
    loc = mixed_locs(gen, n, cap + 4 if c["use_map"] else cap, c["check"])

    def store(b, p, e):
        kvwrite.store_indexer_k(k, p["cache"], loc, quant_block_size=qbs, scale_fmt="ue8m0" if c["ue8m0"] else None,
                                check=c["check"], errors=e, loc_map=loc_map, backend=b)

    compare_with_reference(backend, store, pool, c["check"])
