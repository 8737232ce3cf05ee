"""store_kv: every backend against the torch reference, canaries around every cache."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from conftest import DEVICE
from helpers import BACKENDS, CanaryBuffer, assert_same_bytes, paged_locs

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz)


def make_pool(layout, num_pages, pps, h, dk, dv, cache_dtype, seed):
    shape = (lambda d: (num_pages, pps, h, d)) if layout == "NHD" else (lambda d: (num_pages, h, pps, d))
    return CanaryBuffer({"k_cache": (shape(dk), cache_dtype), "v_cache": (shape(dv), cache_dtype)}, seed)


def run_store(backend, pool, k, v, loc, layout, ks, vs, check, errors=None, **kw):
    kvwrite.store_kv(k, v, pool["k_cache"], pool["v_cache"], loc, layout=layout, k_scale=ks,
                     v_scale=vs, check=check, errors=errors, backend=backend, **kw)


def scale_for(kind, h, gen):
    if kind is None:
        return None
    s = torch.rand(h if kind == "H" else 1, generator=gen) * 0.5 + 0.02
    return (s.reshape(()) if kind == "scalar" else s).to(DEVICE)


@st.composite
def store_cases(draw):
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.bfloat16]))
    cache = draw(st.sampled_from([dtype, *FP8]))
    h = draw(st.sampled_from([1, 2, 8]))
    dk = draw(st.sampled_from([64, 80, 128, 256]))
    dv = draw(st.sampled_from([dk, dk, 64]))
    pps = draw(st.sampled_from([1, 16, 64]))
    num_pages = draw(st.integers(1, max(1, 320 // pps) + 1))
    capacity = num_pages * pps
    n = draw(st.sampled_from([0, 1, 7, capacity]) | st.integers(0, capacity))
    return dict(dtype=dtype, cache=cache, h=h, dk=dk, dv=dv, pps=pps, num_pages=num_pages, n=min(n, capacity),
                layout=draw(st.sampled_from(["NHD", "HND"])),
                scale=draw(st.sampled_from(["scalar", "one", "H"])) if cache in FP8 else None,
                pad=draw(st.sampled_from([0.0, 0.25])), loc_dtype=draw(st.sampled_from([torch.int32, torch.int64])),
                check=draw(st.sampled_from(["off", "assert", "guard"])), seed=draw(st.integers(0, 2**16)))


def inputs(c):
    gen = torch.Generator().manual_seed(c["seed"])
    k = (torch.randn(c["n"], c["h"], c["dk"], generator=gen) * 4).to(c["dtype"]).to(DEVICE)
    v = (torch.randn(c["n"], c["h"], c["dv"], generator=gen) * 4).to(c["dtype"]).to(DEVICE)
    loc = paged_locs(c["n"], c["num_pages"] * c["pps"], c["pps"], gen, c["pad"], c["loc_dtype"])
    return k, v, loc, scale_for(c["scale"], c["h"], gen), scale_for(c["scale"], c["h"], gen)


@pytest.mark.parametrize("backend", BACKENDS)
@given(c=store_cases())
def test_store_kv_matches_reference(backend, c):
    k, v, loc, ks, vs = inputs(c)
    pool = make_pool(c["layout"], c["num_pages"], c["pps"], c["h"], c["dk"], c["dv"], c["cache"], c["seed"])
    ref, original = pool.clone(), pool.raw.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(DEVICE), kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, v, loc, c["layout"], ks, vs, c["check"], errs)
    run_store("torch", ref, k, v, loc, c["layout"], ks, vs, c["check"], ref_errs)
    assert_same_bytes(pool, ref, original)
    assert errs.error() is None and ref_errs.error() is None


def naive_store(k, v, kc, vc, loc, layout):
    """Token-by-token Python loop: the oracle of the reference itself."""
    pps = kc.shape[1] if layout == "NHD" else kc.shape[2]
    for i, l in enumerate(loc.tolist()):
        if l == -1:
            continue
        p, o = divmod(l, pps)
        if layout == "NHD":
            kc[p, o], vc[p, o] = k[i], v[i]
        else:
            kc[p, :, o], vc[p, :, o] = k[i], v[i]


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_reference_matches_naive_loop(layout):
    c = dict(dtype=torch.bfloat16, h=2, dk=64, dv=80, pps=16, num_pages=4, n=37, pad=0.3, loc_dtype=torch.int32, scale=None, seed=3)
    k, v, loc, _, _ = inputs(c)
    pool = make_pool(layout, 4, 16, 2, 64, 80, torch.bfloat16, 3)
    twin = pool.clone()
    run_store("torch", pool, k, v, loc, layout, None, None, "off")
    naive_store(k, v, twin["k_cache"], twin["v_cache"], loc, layout)
    assert torch.equal(pool.raw, twin.raw)
    assert not torch.equal(pool.raw, make_pool(layout, 4, 16, 2, 64, 80, torch.bfloat16, 3).raw)


def test_fp8_saturates_and_matches_formula():
    h, d = 2, 64
    k = torch.tensor([[1e6, -1e6, 3.0, 0.1] * 16] * h, dtype=torch.float32)[None].to(DEVICE)
    kc = torch.zeros(1, 1, h, d, dtype=torch.float8_e4m3fn, device=DEVICE)
    vc = torch.zeros_like(kc)
    scale = torch.tensor([0.5, 2.0], device=DEVICE)
    for backend in ["torch", *BACKENDS]:
        kvwrite.store_kv(k, k, kc, vc, torch.tensor([0], device=DEVICE), k_scale=scale, v_scale=scale, backend=backend)
        got = kc[0, 0].float()
        assert got[0, 0] == 448 and got[0, 1] == -448 and got[0, 2] == 6.0 and got[1, 2] == 1.5
        assert torch.equal(kc[0, 0].view(torch.uint8), (k[0] / scale[:, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8))


# --- out-of-range locs -----------------------------------------------------------------------

def bad_loc_cases(capacity, pps):
    """Each class of bad loc: beyond capacity, the tail of an allocator page 4x the pool page
    (the DCP draft-pool bug, SGLang #33348), negative other than -1."""
    return {
        "beyond": [0, capacity + 5, 3, -1, capacity],
        "allocator_tail": [1, -1, capacity - 1, capacity + 2 * pps + 1, capacity + 3 * pps],
        "negative": [-1, 2, -2, -capacity - 7, 4],
        "mixed": [-1, -1, capacity * 1000 + 17, -3, 1, capacity],
    }


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
@pytest.mark.parametrize("case", ["beyond", "allocator_tail", "negative", "mixed"])
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_out_of_range_guard_and_assert(backend, case, layout):
    pps, num_pages, h, d = 16, 4, 2, 64
    capacity = num_pages * pps
    loc_list = bad_loc_cases(capacity, pps)[case]
    loc = torch.tensor(loc_list, device=DEVICE)
    n = len(loc_list)
    gen = torch.Generator().manual_seed(1)
    k = torch.randn(n, h, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    v = torch.randn(n, h, d, generator=gen).to(torch.bfloat16).to(DEVICE)
    bad = [i for i, l in enumerate(loc_list) if l != -1 and not 0 <= l < capacity]
    # guard: good tokens written exactly as the reference writes them, bad ones skipped, record exact
    pool = make_pool(layout, num_pages, pps, h, d, d, torch.bfloat16, 7)
    original = pool.raw.clone()
    good_only = pool.clone()
    keep = torch.tensor([l if i not in bad else -1 for i, l in enumerate(loc_list)], device=DEVICE)
    run_store("torch", good_only, k, v, keep, layout, None, None, "off")
    errs = kvwrite.ErrorBuffer(DEVICE)
    run_store(backend, pool, k, v, loc, layout, None, None, "guard", errs)
    assert_same_bytes(pool, good_only, original)
    err = errs.error()
    first = bad[0]
    assert (err.op, err.token_index, err.loc, err.count) == ("store_kv", first, loc_list[first], len(bad))
    assert err.page == loc_list[first] // pps and err.num_pages == num_pages and err.pool_page_size == pps
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=f"token {first}"):
        errs.raise_if_any()
    errs.reset()
    assert errs.error() is None
    # assert: raises, names the first bad token, and no sentinel byte changes
    if DEVICE.type == "cuda" and backend != "torch":
        return  # a device assert kills the context: see test_device_assert_in_subprocess
    pool = make_pool(layout, num_pages, pps, h, d, d, torch.bfloat16, 7)
    with pytest.raises(kvwrite.OutOfBoundsWrite) as info:
        run_store(backend, pool, k, v, loc, layout, None, None, "assert")
    assert info.value.token_index == first and info.value.loc == loc_list[first]
    assert torch.equal(pool.raw[pool.canary_mask()], original[pool.canary_mask()])


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_guard_record_accumulates_across_calls_and_default_buffer(backend):
    kc = torch.zeros(2, 4, 1, 64, dtype=torch.float16, device=DEVICE)
    vc = torch.zeros_like(kc)
    k = torch.ones(3, 1, 64, dtype=torch.float16, device=DEVICE)
    buf = kvwrite.default_errors(DEVICE)
    buf.reset()
    kvwrite.store_kv(k, k, kc, vc, torch.tensor([0, 1, 9], device=DEVICE), check="guard", backend=backend)
    kvwrite.store_kv(k, k, kc, vc, torch.tensor([8, 2, 3], device=DEVICE), check="guard", backend=backend)
    err = buf.error()  # the first call's record (token 2, loc 9); the second call is counted
    assert err.count == 2 and err.token_index == 2 and err.loc == 9 and err.page == 2
    buf.reset()


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_large_pool_int64_offsets(backend):
    """A pool of > 2**31 elements: the last row's address needs int64 arithmetic. The 4 GiB
    buffer is never touched except at its first and last rows (lazily committed memory)."""
    h, d = 1, 64
    num_pages = 2**25 + 2  # (num_pages - 1) * 64 elements > 2**31
    kc = torch.empty(num_pages, 1, h, d, dtype=torch.float16, device=DEVICE)
    kc[0].zero_()
    kc[-1].zero_()
    k = torch.full((1, h, d), 3.0, dtype=torch.float16, device=DEVICE)
    kvwrite.store_kv(k, k, kc, kc, torch.tensor([num_pages - 1], device=DEVICE), check="guard",
                     errors=kvwrite.ErrorBuffer(DEVICE), backend=backend)
    assert bool((kc[-1] == 3).all()) and bool((kc[0] == 0).all())


@pytest.mark.skipif(DEVICE.type != "cuda", reason="device asserts exist on a GPU only")
@pytest.mark.parametrize("backend", BACKENDS)
def test_device_assert_in_subprocess(backend):
    """On a GPU the assert mode is a device-side assert: the process dies with it."""
    import subprocess
    import sys

    code = f"""
import torch, kvwrite
kc = torch.zeros(4, 16, 2, 64, dtype=torch.bfloat16, device="cuda")
k = torch.ones(3, 2, 64, dtype=torch.bfloat16, device="cuda")
kvwrite.store_kv(k, k, kc, kc.clone(), torch.tensor([1, 64, -1], device="cuda"), check="assert", backend="{backend}")
torch.cuda.synchronize()
print("NOT REACHED")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "NOT REACHED" not in out.stdout
    assert "assert" in (out.stderr + out.stdout).lower(), out.stderr[-2000:]


@pytest.mark.skipif("cpu" not in BACKENDS or DEVICE.type != "cpu", reason="the cpu backend's threads")
def test_head_major_grouped_store_splits_pages_over_threads():
    """Enough tokens for several parallel_for chunks at two threads: each chunk stores the pages
    that start in it, reading the one (row, token) order the calling thread built. (The chunks
    run on threads only where the extension is built with OpenMP; the JIT build today is not, so
    here they run one after another: the page split is what this checks.)"""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gen = torch.Generator().manual_seed(5)
        bf, n, (pages, rows, h, d, x) = torch.bfloat16, 1024, (128, 16, 4, 64, 8)
        k, v = torch.randn(n, h, d, generator=gen).to(bf), torch.randn(n, h, d, generator=gen).to(bf)
        loc = torch.randperm(pages * rows, generator=gen)[:n]
        out = {}
        for b in ("cpu", "torch"):
            out[b] = (torch.zeros(pages, h, d // x, rows, x, dtype=bf), torch.zeros(pages, h, d, rows, dtype=bf))
            kvwrite.store_kv_head_major(k, v, *out[b], loc, backend=b)
        assert all(torch.equal(a, b) for a, b in zip(out["cpu"], out["torch"]))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("check", ["off", "guard"])
def test_head_major_many_tokens_per_page(backend, dtype, check):
    """store_kv_head_major with many tokens per page (the CPU store groups a call's tokens by page
    and moves 2-byte values by runs of consecutive rows): random token order, runs of 1 to 20
    consecutive rows across page ends, padding, a loc_map; off: duplicate rows (the later token
    wins); guard: locs outside loc_map (recorded, skipped). Bytes against the torch reference."""
    gen = torch.Generator().manual_seed(11)
    pages, pps, h, d = 6, 16, 2, 64
    cap, x = pages * pps, 16 // torch.empty((), dtype=dtype).element_size()
    perm = torch.randperm(cap, generator=gen)
    rows = torch.cat([torch.arange(10, 30), torch.arange(40, 43), torch.arange(50, 52), torch.arange(64, 72),
                      perm[:40]])
    rows = torch.unique(rows)  # distinct rows
    rows = rows[torch.randperm(len(rows), generator=gen)]
    rows = torch.cat([rows, rows[torch.randperm(len(rows), generator=gen)[:12]]])  # 12 duplicate rows, later
    rows = rows[torch.randperm(len(rows), generator=gen)]
    loc_map = torch.randperm(cap, generator=gen)  # loc -> row
    loc = torch.argsort(loc_map)[rows]
    n = len(loc)
    loc[torch.randperm(n, generator=gen)[:6]] = -1
    kept = loc.clone()
    if check == "off":  # the reference runs on the last writer of each row
        seen = set()
        for i in reversed(range(n)):
            r = int(loc_map[loc[i]]) if loc[i] >= 0 else -1
            if r in seen:
                kept[i] = -1
            seen.add(r)
    else:  # distinct rows, a few locs past loc_map
        first = {}
        for i in range(n):
            if loc[i] >= 0 and first.setdefault(int(loc_map[loc[i]]), i) != i:
                loc[i] = kept[i] = -1
        bad = torch.nonzero(loc >= 0).flatten()[torch.randperm(int((loc >= 0).sum()), generator=gen)[:4]]
        loc[bad] = cap + 5
        kept[bad] = -1
    k = torch.randn(n, h, d, generator=gen).to(dtype).to(DEVICE)
    v = torch.randn(n, h, d, generator=gen).to(dtype).to(DEVICE)
    pool = CanaryBuffer({"k": ((pages, h, d // x, pps, x), dtype), "v": ((pages, h, d, pps), dtype)}, seed=5)
    original, want = pool.raw.clone(), pool.clone()
    lm = loc_map.to(DEVICE)
    kvwrite.store_kv_head_major(k, v, want["k"], want["v"], kept.to(DEVICE), loc_map=lm, check="off", backend="torch")
    errs = kvwrite.ErrorBuffer(DEVICE)
    kvwrite.store_kv_head_major(k, v, pool["k"], pool["v"], loc.to(DEVICE), loc_map=lm, check=check, errors=errs,
                                backend=backend)
    assert_same_bytes(pool, want, original)
    err = errs.error()
    assert (err is None) if check == "off" else (err.count == 4 and err.token_index == int(bad.min()))
