"""SWA loc translation (loc_map) and DCP-sharded stores: every backend against the reference and
a token-by-token oracle, canaries, every check mode, and which index an error names."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes
from kvwrite.errors import KIND_LOC_MAP, KIND_POOL

H, D = 2, 32
ALL = ["torch", *BACKENDS]
CHECKS = ["off", "assert", "guard"]


def pool(prefix: str, num_pages: int, pps: int, seed: int, ranks: int = 1) -> CanaryBuffer:
    specs = {}
    for r in range(ranks):
        specs[f"{prefix}k{r}"] = ((num_pages, pps, H, D), torch.bfloat16)
        specs[f"{prefix}v{r}"] = ((num_pages, pps, H, D), torch.bfloat16)
    return CanaryBuffer(specs, seed)


def rows(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(n, H, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(n, H, D, generator=gen).to(torch.bfloat16).to(DEVICE)
    return k, v


def store(backend, buf, r, k, v, loc, check="off", errors=None, **kw):
    kvwrite.store_kv(k, v, buf[f"k{r}"], buf[f"v{r}"], loc, check=check, errors=errors,
                     backend=backend, **kw)


def oracle(buf, r, k, v, loc, loc_map=None, dcp_rank=0, dcp_size=1):
    """Token-by-token Python loop of the documented order: loc -> loc_map -> DCP -> row."""
    kc, vc = buf[f"k{r}"].flatten(0, 1), buf[f"v{r}"].flatten(0, 1)
    table = None if loc_map is None else loc_map.tolist()
    for i, row in enumerate(loc.tolist()):
        if row == -1:
            continue
        if table is not None:
            if not 0 <= row < len(table) or table[row] == -1:
                continue
            row = table[row]
        if row % dcp_size != dcp_rank:
            continue
        row //= dcp_size
        if 0 <= row < kc.shape[0]:
            kc[row], vc[row] = k[i], v[i]


def swa_map(full: int, swa_cap: int, gen: torch.Generator, minus_one: float, dtype) -> torch.Tensor:
    """An injective full->SWA map: a random part of the full locs maps to distinct SWA rows,
    the rest (and at least a `minus_one` fraction) to -1."""
    out = torch.full((full,), -1, dtype=torch.int64)
    keep = torch.randperm(full, generator=gen)[: min(full, swa_cap)]
    keep = keep[torch.rand(keep.shape[0], generator=gen) >= minus_one]
    out[keep] = torch.randperm(swa_cap, generator=gen)[: keep.shape[0]]
    return out.to(dtype).to(DEVICE)


# --- SWA translation -------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
@given(full=st.integers(1, 200), pps=st.sampled_from([1, 4, 16]), swa_pages=st.integers(1, 6),
       minus_one=st.sampled_from([0.0, 0.3, 1.0]), pad=st.sampled_from([0.0, 0.2]),
       check=st.sampled_from(CHECKS), map_dtype=st.sampled_from([torch.int32, torch.int64]),
       seed=st.integers(0, 2**16))
def test_swa_translation_matches_reference_and_oracle(backend, full, pps, swa_pages, minus_one,
                                                      pad, check, map_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    loc_map = swa_map(full, swa_pages * pps, gen, minus_one, map_dtype)
    n = int(torch.randint(0, full + 1, (1,), generator=gen))
    loc = torch.randperm(full, generator=gen)[:n]
    loc = torch.where(torch.rand(n, generator=gen) < pad, -1, loc).to(DEVICE)
    k, v = rows(n, seed)
    buf = pool("", swa_pages, pps, seed)
    ref, twin, original = buf.clone(), buf.clone(), buf.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    store(backend, buf, 0, k, v, loc, check, errs, loc_map=loc_map)
    store("torch", ref, 0, k, v, loc, check, ref_errs, loc_map=loc_map)
    oracle(twin, 0, k, v, loc, loc_map)
    assert_same_bytes(buf, ref, original)
    assert_same_bytes(ref, twin, original)
    assert errs.error() is None and ref_errs.error() is None


@pytest.mark.parametrize("backend", ALL)
def test_off_mode_never_reads_past_loc_map(backend):
    """A loc outside [0, len(loc_map)) is skipped in off mode. loc_map is a view of a longer
    buffer whose tail holds valid rows: reading past its end would write them."""
    backing = torch.tensor([5, -1, 2, 0, 7, 3, 1, 6], device=DEVICE)
    loc_map = backing[:4]
    loc = torch.tensor([0, 4, 2, 5, -1, -7, 3, 7, 6], device=DEVICE)
    k, v = rows(loc.shape[0], 3)
    buf = pool("", 2, 4, 5)
    twin, original = buf.clone(), buf.raw.clone()
    store(backend, buf, 0, k, v, loc, "off", loc_map=loc_map)
    oracle(twin, 0, k, v, loc, loc_map)
    assert_same_bytes(buf, twin, original)
    written = (buf.raw != original).nonzero().numel()
    assert written > 0 and not torch.equal(buf.raw, original)


def swa_bad_cases(full: int, swa_cap: int):
    """loc_map with -1 entries and out-of-range entries (>= SWA capacity, < -1), and locs that
    miss the map; each: (loc_map, loc, first bad token, its kind, target, limit, bad count)."""
    m = [3, -1, swa_cap + 2, 0, -5, 1, swa_cap, 2]  # full == 8
    assert full == len(m)
    return {
        # first bad: token 1 maps through m[2] beyond the SWA pool
        "map_entry_beyond": (m, [0, 2, 1, 3, 7], 1, KIND_POOL, swa_cap + 2, swa_cap, 1),
        # first bad: token 0 maps to -5 (negative, not -1 padding)
        "map_entry_negative": (m, [4, 0, 6, -1], 0, KIND_POOL, -5, swa_cap, 2),
        # first bad: token 1 has a loc past the map's end (lookup)
        "loc_beyond_map": (m, [5, full + 3, 2, 1, 0], 1, KIND_LOC_MAP, full + 3, full, 2),
        # first bad: token 2 has a negative loc (not -1) for the lookup; token 3 a bad entry
        "loc_negative": (m, [-1, 7, -3, 6, 3], 2, KIND_LOC_MAP, -3, full, 2),
    }


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("case", ["map_entry_beyond", "map_entry_negative", "loc_beyond_map", "loc_negative"])
def test_swa_out_of_range_guard_and_assert(backend, case):
    full, pps, pages = 8, 2, 2
    swa_cap = pps * pages
    m, loc_list, first, kind, target, limit, count = swa_bad_cases(full, swa_cap)[case]
    loc_map = torch.tensor(m, dtype=torch.int32, device=DEVICE)
    loc = torch.tensor(loc_list, device=DEVICE)
    k, v = rows(loc.shape[0], 11)
    buf = pool("", pages, pps, 13)
    original, good = buf.raw.clone(), buf.clone()
    oracle(good, 0, k, v, loc, loc_map)  # the oracle writes only in-range rows
    errs = kvwrite.ErrorBuffer(DEVICE)
    store(backend, buf, 0, k, v, loc, "guard", errs, loc_map=loc_map)
    assert_same_bytes(buf, good, original)
    err = errs.error()
    assert (err.op, err.token_index, err.loc, err.kind, err.target, err.limit, err.count) == (
        "store_kv", first, loc_list[first], kind, target, limit, count)
    if kind == KIND_LOC_MAP:
        assert err.page is None and f"outside loc_map (length {full})" in str(err)
    else:
        assert err.page == target // pps and f"(translated/local loc {target})" in str(err)
        assert f"capacity {swa_cap}" in str(err)
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context (test_store_kv.test_device_assert_in_subprocess)
    buf = pool("", pages, pps, 13)
    with pytest.raises(kvwrite.OutOfBoundsWrite) as info:
        store(backend, buf, 0, k, v, loc, "assert", loc_map=loc_map)
    got = info.value
    assert (got.token_index, got.loc, got.kind, got.target, got.limit) == (first, loc_list[first], kind, target, limit)
    assert torch.equal(buf.raw[buf.canary_mask()], original[buf.canary_mask()])
    # off mode skips locs outside the map and negative mapped rows (rows past the pool would be
    # written unchecked in off mode: leave those tokens out)
    off_loc = torch.tensor([-1 if 0 <= l < full and m[l] >= swa_cap else l for l in loc_list], device=DEVICE)
    off, off_ref = pool("", pages, pps, 13), pool("", pages, pps, 13)
    store(backend, off, 0, k, v, off_loc, "off", loc_map=loc_map)
    oracle(off_ref, 0, k, v, off_loc, loc_map)
    assert_same_bytes(off, off_ref, original)


# --- DCP sharding ----------------------------------------------------------------------------

def interleave(shards: list[torch.Tensor]) -> torch.Tensor:
    """Virtual rows from per-rank rows: virtual loc l lives on rank l % n at local row l // n."""
    flat = torch.stack([s.flatten(0, 1) for s in shards])  # [ranks, local rows, H, D]
    return flat.transpose(0, 1).reshape(-1, *flat.shape[2:])


def deinterleave_into(virtual: torch.Tensor, shards: list[torch.Tensor]) -> None:
    n = len(shards)
    for r, s in enumerate(shards):
        s.copy_(virtual.flatten(0, 1)[r::n].reshape(s.shape))


@pytest.mark.parametrize("backend", ALL)
@pytest.mark.parametrize("dcp_size", [1, 2, 4, 8])
@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("with_map", [False, True])
def test_union_of_dcp_shards_equals_unsharded_store(backend, dcp_size, check, with_map):
    """Each rank stores into its own pool (local rows loc // dcp_size); interleaved, the rank
    pools equal one unsharded store into a pool of the whole virtual loc space. With a loc_map
    the map is applied first (full -> SWA virtual), then the SWA virtual loc is sharded."""
    pps, local_pages = 4, 3
    virtual = dcp_size * local_pages * pps
    seed = 100 * dcp_size + int(with_map)
    gen = torch.Generator().manual_seed(seed)
    full = virtual + 9 if with_map else virtual
    loc_map = swa_map(full, virtual, gen, 0.2, torch.int32) if with_map else None
    n = full - 3
    loc = torch.randperm(full, generator=gen)[:n]
    loc = torch.where(torch.rand(n, generator=gen) < 0.15, -1, loc).to(DEVICE)
    k, v = rows(n, seed)
    whole = pool("", local_pages * dcp_size, pps, seed)
    shards = pool("", local_pages, pps, seed + 1, ranks=dcp_size)
    deinterleave_into(whole["k0"], [shards[f"k{r}"] for r in range(dcp_size)])
    deinterleave_into(whole["v0"], [shards[f"v{r}"] for r in range(dcp_size)])
    original, oracle_shards = shards.raw.clone(), shards.clone()
    errs = kvwrite.ErrorBuffer(DEVICE)
    for r in range(dcp_size):
        store(backend, shards, r, k, v, loc, check, errs, loc_map=loc_map, dcp_rank=r, dcp_size=dcp_size)
        oracle(oracle_shards, r, k, v, loc, loc_map, r, dcp_size)
    store("torch", whole, 0, k, v, loc, check, loc_map=loc_map)
    assert errs.error() is None
    assert_same_bytes(shards, oracle_shards, original)
    for name in ("k", "v"):
        union = interleave([shards[f"{name}{r}"] for r in range(dcp_size)])
        assert torch.equal(union.view(torch.uint8), whole[f"{name}0"].flatten(0, 1).view(torch.uint8))
    assert not torch.equal(shards.raw, original)


@pytest.mark.parametrize("backend", ALL)
def test_dcp_checks_the_local_loc_and_records_the_virtual_one(backend):
    """Rank 1 of 4, local capacity 8: virtual loc 4*8+1 = 33 is rank 1's local row 8 (out of
    range); virtual 34 belongs to rank 2 and is not this rank's business; -1 is padding."""
    dcp_size, rank, pps, pages = 4, 1, 4, 2
    loc_list = [5, 34, -1, 33, 9, 4 * 8 * 10 + 1, 2]
    loc = torch.tensor(loc_list, device=DEVICE)
    k, v = rows(len(loc_list), 21)
    buf = pool("", pages, pps, 23)
    original, good = buf.raw.clone(), buf.clone()
    oracle(good, 0, k, v, loc, None, rank, dcp_size)
    errs = kvwrite.ErrorBuffer(DEVICE)
    store(backend, buf, 0, k, v, loc, "guard", errs, dcp_rank=rank, dcp_size=dcp_size)
    assert_same_bytes(buf, good, original)
    err = errs.error()
    assert (err.token_index, err.loc, err.target, err.limit, err.kind, err.count) == (3, 33, 8, 8, KIND_POOL, 2)
    assert err.page == 2 and "loc 33 (translated/local loc 8)" in str(err)
    if DEVICE.type == "cuda" and backend != "torch":
        return
    with pytest.raises(kvwrite.OutOfBoundsWrite, match="token 3 writes loc 33"):
        store(backend, pool("", pages, pps, 23), 0, k, v, loc, "assert", dcp_rank=rank, dcp_size=dcp_size)
    # off mode writes the same in-range rows (the out-of-range ones would be past the pool: use
    # only in-range locs here)
    ok = torch.tensor([l if l not in (33, 4 * 8 * 10 + 1) else -1 for l in loc_list], device=DEVICE)
    off, off_ref = pool("", pages, pps, 23), pool("", pages, pps, 23)
    store(backend, off, 0, k, v, ok, "off", dcp_rank=rank, dcp_size=dcp_size)
    oracle(off_ref, 0, k, v, ok, None, rank, dcp_size)
    assert_same_bytes(off, off_ref, original)


@pytest.mark.parametrize("backend", ALL)
def test_map_then_dcp_error_names_the_map_or_the_local_row(backend):
    """loc_map then DCP: a loc past the map is a KIND_LOC_MAP error on every rank; a mapped row
    past this rank's pool is KIND_POOL against the local row; other ranks' rows are skipped."""
    dcp_size, rank, pps, pages = 2, 0, 2, 2  # local capacity 4, virtual SWA space 8
    loc_map = torch.tensor([0, 9, 2, 10, -1, 3, 12, 6], device=DEVICE)
    loc_list = [0, 2, 3, 8, 6, 1, 5, 7]
    loc = torch.tensor(loc_list, device=DEVICE)
    k, v = rows(len(loc_list), 31)
    buf = pool("", pages, pps, 33)
    original, good = buf.raw.clone(), buf.clone()
    oracle(good, 0, k, v, loc, loc_map, rank, dcp_size)
    errs = kvwrite.ErrorBuffer(DEVICE)
    store(backend, buf, 0, k, v, loc, "guard", errs, loc_map=loc_map, dcp_rank=rank, dcp_size=dcp_size)
    assert_same_bytes(buf, good, original)
    err = errs.error()
    # token 2: loc 3 -> 10 (rank 0, local 5 >= 4); token 3: loc 8 outside the map; token 4:
    # 6 -> 12 (local 6); token 5: 1 -> 9 (rank 1, skipped); token 7: 7 -> 6 (local 3, fine)
    assert (err.token_index, err.loc, err.kind, err.target, err.limit, err.count) == (2, 3, KIND_POOL, 5, 4, 3)
    errs.reset()
    store(backend, buf, 0, k[3:], v[3:], loc[3:], "guard", errs, loc_map=loc_map, dcp_rank=rank, dcp_size=dcp_size)
    err = errs.error()
    assert (err.token_index, err.loc, err.kind, err.target, err.limit, err.count) == (0, 8, KIND_LOC_MAP, 8, 8, 2)
    assert "outside loc_map (length 8)" in str(err)
