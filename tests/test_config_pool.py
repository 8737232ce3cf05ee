"""Built pools: store routing per variant, guard never trips on the allocator's locs, the
SGLang #33348 regression, out-of-tree variants, missing kernels."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

import kvwrite
from config_models import KV_DTYPES, TINY, supported
from conftest import DEVICE
from helpers import BACKENDS
from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec, VariantPlanner, register_variant
from kvwrite.config import (BufferSpec, KernelUnavailable, LayerHasNoKV, PoolSpec, SpecError, UnknownVariant)
from kvwrite.config.scales import FP8
from kvwrite.config.variants import unregister_variant
from kvwrite.geometry import GeometryError, PageGeometry

ALL_BACKENDS = ["torch", *BACKENDS]


def build(variant, *, kv="auto", page=4, tokens=32, dcp=1, rank=0, draft=False, backend="torch", check="guard",
          model=None, scales="unit", **kw):
    """A built pool; fp8 pools get explicit unit scales unless `scales` says otherwise."""
    model = model or TINY[variant]
    conf = KVCacheConfigurator(model, ParallelSpec(dcp_size=dcp, dcp_rank=rank, is_draft_worker=draft),
                               page_size=page, kv_cache_dtype=kv, max_total_num_tokens=tokens, **kw)
    if scales == "unit":
        scales = 1.0 if kv in FP8 else None
    return conf.plan().build(DEVICE, check=check, backend=backend, scales=scales)


def rows(t):
    """[pages, pps, ...] -> [rows, ...]"""
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def untouched(pool, except_=()):
    for name, layers in pool.buffers.items():
        for i, bufs in enumerate(layers):
            lid = pool.plan.pool(name).layer_ids[i]
            if (name, lid) in except_:
                continue
            assert all(int(t.view(torch.uint8).count_nonzero()) == 0 for t in bufs.values()), (name, lid)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mha_store_lands_in_its_layer(backend):
    pool = build("mha", backend=backend)
    locs = pool.allocator().alloc(12)
    k, v = pool.sample_inputs(1, 12, torch.Generator().manual_seed(0))
    pool.store(1, locs, k, v)
    pool.errors.raise_if_any()
    b = pool.layer("kv", 1)
    assert torch.equal(rows(b["k"])[locs], k) and torch.equal(rows(b["v"])[locs], v)
    assert int(rows(b["k"]).count_nonzero()) == int(k.count_nonzero())
    untouched(pool, {("kv", 1)})


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_swa_layers_translate_through_the_loc_map(backend):
    pool = build("swa_hybrid", backend=backend)
    full, swa = pool.allocator("full"), pool.allocator("swa")
    locs = full.alloc(16)
    swa_locs = swa.alloc(8)
    pool.map_swa(locs[8:], swa_locs)            # the first 8 slid out of the window: -1
    g = torch.Generator().manual_seed(1)
    k, v = pool.sample_inputs(0, 16, g)
    pool.store(0, locs, k, v)                   # SWA layer
    kf, vf = pool.sample_inputs(1, 16, g)
    pool.store(1, locs, kf, vf)                 # full layer
    pool.errors.raise_if_any()
    s = pool.layer("swa", 0)
    assert torch.equal(rows(s["k"])[swa_locs], k[8:]) and torch.equal(rows(s["v"])[swa_locs], v[8:])
    assert int(rows(s["k"]).count_nonzero()) == int(k[8:].count_nonzero())
    assert torch.equal(rows(pool.layer("full", 1)["k"])[locs], kf)
    untouched(pool, {("swa", 0), ("full", 1)})
    with pytest.raises(ValueError, match="full allocator"):
        pool.map_swa(torch.tensor([full.num_locs]), torch.tensor([0]))


@pytest.mark.parametrize("rank", [0, 1])
def test_dcp_sharded_store_keeps_this_ranks_tokens(rank):
    pool = build("mha", dcp=2, rank=rank)
    alloc = pool.allocator()
    assert alloc.page_size == 8 and pool.plan.pool("kv").geometry.pool_page_size == 4
    locs = alloc.alloc(16)
    k, v = pool.sample_inputs(0, 16, torch.Generator().manual_seed(2))
    pool.store(0, locs, k, v)
    mine = locs % 2 == rank
    kc = rows(pool.layer("kv", 0)["k"])
    assert torch.equal(kc[locs[mine] // 2], k[mine])
    assert int(kc.count_nonzero()) == int(k[mine].count_nonzero())


def test_hybrid_linear_layer_map():
    pool = build("hybrid_linear")
    locs = pool.allocator().alloc(8)
    k, v = pool.sample_inputs(3, 8, torch.Generator().manual_seed(3))
    pool.store(3, locs, k, v)
    assert torch.equal(rows(pool.buffers["kv"][0]["k"])[locs], k)
    for layer, msg in ((0, "linear-attention layer"), (4, "outside the model's 4 layers")):
        with pytest.raises(LayerHasNoKV, match=msg):
            pool.store(layer, locs, k, v)
    assert len(pool.buffers["kv"]) == 1


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_mla_and_dsa_store_rows_and_indexer(backend):
    pool = build("dsa", backend=backend)
    locs = pool.allocator().alloc(8)
    kv_c, k_pe, index_k = pool.sample_inputs(1, 8, torch.Generator().manual_seed(4))
    pool.store(1, locs, kv_c, k_pe, index_k)
    pool.errors.raise_if_any()
    assert torch.equal(rows(pool.layer("kv", 1)["kv"])[locs], torch.cat([kv_c, k_pe], 1))
    cache = pool.layer("indexer", 1)["index_k"]
    twin = torch.zeros_like(cache)
    kvwrite.store_indexer_k(index_k, twin, locs, backend="torch")
    assert torch.equal(cache, twin) and int(cache.count_nonzero()) > 0
    got = kvwrite.read_indexer_k(cache, locs, 128)
    assert torch.allclose(got.float(), index_k.float(), rtol=0.13, atol=1e-2)
    untouched(pool, {("kv", 1), ("indexer", 1)})


def test_fp8_formats_take_scales():
    pool = build("mha", kv="fp8_e4m3")
    locs = pool.allocator().alloc(4)
    k, v = pool.sample_inputs(0, 4, torch.Generator().manual_seed(5))
    pool.store(0, locs, k, v, k_scale=torch.tensor(0.5), v_scale=torch.tensor([2.0]))
    b = pool.layer("kv", 0)
    assert torch.equal(rows(b["k"])[locs], (k.float() / 0.5).to(torch.float8_e4m3fn))
    assert torch.equal(rows(b["v"])[locs], (v.float() / 2.0).to(torch.float8_e4m3fn))
    pool.store(1, locs, k, v)                            # the build-time scales: 1.0, explicitly
    assert torch.equal(rows(pool.layer("kv", 1)["k"])[locs], k.float().to(torch.float8_e4m3fn))
    scaled = build("mha", kv="fp8_e4m3", scales={"k_scale": 0.5, "v_scale": torch.tensor([2.0])})
    scaled.store(0, locs, k, v)
    b = scaled.layer("kv", 0)
    assert torch.equal(rows(b["k"])[locs], (k.float() / 0.5).to(torch.float8_e4m3fn))
    assert torch.equal(rows(b["v"])[locs], (v.float() / 2.0).to(torch.float8_e4m3fn))
    mla = build("mla", kv="fp8_ds_mla")
    locs = mla.allocator().alloc(4)
    kv_c, k_pe = mla.sample_inputs(0, 4, torch.Generator().manual_seed(6))
    mla.store(0, locs, kv_c, k_pe)
    back = kvwrite.dequant_ds_mla(rows(mla.layer("kv", 0)["kv"])[locs], 128)
    assert torch.allclose(back[:, :128].float(), kv_c.float(), rtol=0.07, atol=0.02)
    assert torch.equal(back[:, 128:].to(torch.bfloat16), k_pe)


def test_minimax_sparse_stores_main_and_index():
    pool = build("minimax_sparse")
    locs = pool.allocator().alloc(8)
    k, v, idx = pool.sample_inputs(0, 8, torch.Generator().manual_seed(7))
    pool.store(0, locs, k, v, idx)
    assert torch.equal(rows(pool.layer("kv", 0)["k"])[locs], k)
    assert torch.equal(rows(pool.layer("index", 0)["k"])[locs][:, 0], idx)
    assert "v" not in pool.layer("index", 0)
    untouched(pool, {("kv", 0), ("index", 0)})


def test_store_argument_errors():
    pool = build("dsa")
    locs = pool.allocator().alloc(4)
    kv_c, k_pe, idx = pool.sample_inputs(0, 4)
    with pytest.raises(TypeError, match=r"\(layer_id, loc, kv_c, k_pe, index_k\)"):
        pool.store(0, locs, kv_c, k_pe)
    with pytest.raises(TypeError, match="takes scales"):
        pool.store(0, locs, kv_c, k_pe, idx, k_scale=torch.tensor(1.0))
    with pytest.raises(ValueError, match="check must be one of"):
        pool.plan.build(DEVICE, check="strict")


@pytest.mark.parametrize("variant, kv, bad", [
    ("mha", "auto", "k_scale"), ("mha", "auto", "k_global_scale"), ("mha", "fp8_e4m3", "k_global_scale"),
    ("mha", "nvfp4", "v_scale"), ("mla", "auto", "scale"), ("mla", "fp8_ds_mla", "scale"),
    ("mla", "fp8_e5m2", "global_scale"), ("dsa", "fp8_ds_mla", "scale"),
    ("minimax_sparse", "auto", "index_scale"), ("minimax_sparse", "nvfp4", "index_scale")])
def test_a_scale_that_does_not_apply_is_an_error(variant, kv, bad):
    pool = build(variant, kv=kv)
    locs = pool.allocator().alloc(2)
    lid = pool.plan.model.kv_layer_ids[0]
    tensors = pool.sample_inputs(lid, 2)
    before = [t.clone() for layers in pool.buffers.values() for d in layers for t in d.values()]
    with pytest.raises(TypeError, match=f"store\\(\\) for variant '{variant}' with kv_cache_dtype='{kv}' "
                       f"takes .*got \\['{bad}'\\]"):
        pool.store(lid, locs, *tensors, **{bad: torch.tensor(1.0)})
    after = [t for layers in pool.buffers.values() for d in layers for t in d.values()]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(after, before))


def test_fp8_pools_take_their_scales_at_build():
    for variant, kv, need in (("mha", "fp8_e4m3", "'k_scale': ..., 'v_scale': ..."),
                              ("mla", "fp8_e4m3fnuz", "'scale': ..."),
                              ("minimax_sparse", "fp8_e5m2", "'k_scale': ..., 'v_scale': ..., 'index_scale'")):
        with pytest.raises(ValueError, match=f"needs its fp8 scales at build: build\\(..., scales=\\{{{need}"):
            build(variant, kv=kv, scales=None)
    with pytest.raises(ValueError, match="has no fp8 scales"):
        build("mha", scales=1.0)
    with pytest.raises(ValueError, match=r"scales \['scale'\] do not apply"):
        build("mha", kv="fp8_e4m3", scales={"scale": 1.0, "k_scale": 1.0, "v_scale": 1.0})
    with pytest.raises(ValueError, match=r"needs scales \['v_scale'\]"):
        build("mha", kv="fp8_e4m3", scales={"k_scale": 1.0})
    with pytest.raises(ValueError, match="v_scale must have shape"):
        build("mha", kv="fp8_e4m3", scales={"k_scale": 1.0, "v_scale": torch.ones(2, 2)})


def test_e4m3fnuz_pools_store_through_every_backend():
    for backend in ALL_BACKENDS:
        pool = build("mla", kv="fp8_e4m3fnuz", backend=backend, scales={"scale": 0.5})
        locs = pool.allocator().alloc(4)
        kv_c, k_pe = pool.sample_inputs(0, 4, torch.Generator().manual_seed(1))
        pool.store(0, locs, kv_c, k_pe)
        got = rows(pool.layer("kv", 0)["kv"])[locs]
        assert got.dtype == torch.float8_e4m3fnuz
        want = (torch.cat([kv_c, k_pe], -1).float() / 0.5).clamp(-240, 240).to(torch.float8_e4m3fnuz)
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), backend


def test_pool_check_defaults_to_the_process_default():
    assert build("mha", check=None).check == kvwrite.validate.DEFAULT_CHECK == "off"


# --- the invariant: stores fed the allocator's locs never trip guard mode ------------------------

@st.composite
def built_cases(draw):
    variant = draw(st.sampled_from(sorted(TINY)))
    kv = draw(st.sampled_from([k for k in KV_DTYPES if supported(variant, k)]))
    dcp = draw(st.sampled_from([1, 2, 3, 4, 8]))
    return dict(variant=variant, kv=kv, page=draw(st.sampled_from([1, 2, 4, 16])), dcp=dcp,
                rank=draw(st.integers(0, dcp - 1)), draft=draw(st.booleans()),
                tokens=draw(st.integers(32, 96)), n=draw(st.integers(1, 40)), seed=draw(st.integers(0, 99)),
                backend=draw(st.sampled_from(ALL_BACKENDS)))


@given(c=built_cases())
def test_allocator_locs_never_trip_guard(c):
    pool = build(c["variant"], kv=c["kv"], page=c["page"], tokens=c["tokens"], dcp=c["dcp"], rank=c["rank"],
                 draft=c["draft"], backend=c["backend"])
    plan, g = pool.plan, torch.Generator().manual_seed(c["seed"])
    full = plan.allocator()
    everything = full.alloc(full.usable_locs)             # the whole loc space, last page included
    pick = torch.randperm(everything.numel() - 3, generator=g)[:c["n"]]   # distinct locs: a repeat is
    loc = torch.cat([everything[pick], everything[-3:], torch.tensor([-1])]).to(DEVICE)   # a duplicate write
    if "swa" in plan.spaces:
        swa = plan.allocator("swa")
        swa_locs = swa.alloc(swa.usable_locs)
        pool.map_swa(everything[-swa_locs.numel():], swa_locs)
    for lid in plan.model.kv_layer_ids:
        pool.store(lid, loc, *pool.sample_inputs(lid, loc.numel(), g))
    assert pool.errors.error() is None
    # ... and a loc beyond the allocator's space does trip it
    bad = torch.tensor([int(everything[0]), 2 * full.num_locs + c["rank"]], device=DEVICE)  # this rank's
    lid = plan.model.kv_layer_ids[-1]
    if lid in plan.model.swa_layer_ids:
        lid = plan.model.full_attention_layer_ids[-1]
    pool.store(lid, bad, *pool.sample_inputs(lid, 2, g))
    err = pool.errors.error()
    assert err is not None and err.token_index == 1 and err.loc == int(bad[1])


# --- SGLang #33348 --------------------------------------------------------------------------------

@pytest.mark.parametrize("variant", ["mha", "mla"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_33348_draft_pool_with_per_rank_page_size(variant, backend):
    """A DCP-4 draft worker whose pool keeps the per-rank page size (sized for the virtual space,
    pages of page_size): check_allocator refuses it; built anyway, guard mode reports the write
    into the tail of the allocator's last page."""
    page, dcp, per_rank = 4, 4, 32
    conf = KVCacheConfigurator(TINY[variant], ParallelSpec(dcp_size=dcp, is_draft_worker=True), page_size=page,
                               max_total_num_tokens=per_rank)
    plan = conf.plan()
    alloc = plan.allocator()
    assert (alloc.page_size, alloc.num_locs) == (page * dcp, (per_rank + page) * dcp)
    plan.check_allocator(alloc.page_size, alloc.num_locs)          # the fix passes
    buggy_geometry = PageGeometry(page_size=page, num_pages=per_rank * dcp // page + 1)   # scale 1
    buggy = plan.replace_geometry("kv", buggy_geometry)
    with pytest.raises(GeometryError, match="allocator pages hold 16 locs but the pool's pages hold "
                                            "pool_page_size=4"):
        buggy.check_allocator(alloc.page_size, alloc.num_locs)
    with pytest.raises(GeometryError):
        buggy.build(DEVICE)                                         # build verifies by default
    pool = buggy.build(DEVICE, check="guard", backend=backend, verify=False)
    good = plan.build(DEVICE, check="guard", backend=backend)
    locs = alloc.alloc(alloc.usable_locs)
    last_page = locs[-alloc.page_size:]                             # the allocator's last page
    tail_start = buggy_geometry.capacity                            # first loc the buggy pool lacks
    assert int(last_page[0]) < tail_start <= int(last_page[-1])
    loc = torch.cat([locs[:5], last_page]).to(DEVICE)
    inputs = pool.sample_inputs(0, loc.numel(), torch.Generator().manual_seed(8))
    pool.store(0, loc, *inputs)
    good.store(0, loc, *inputs)
    assert good.errors.error() is None
    err = pool.errors.error()
    first = 5 + (tail_start - int(last_page[0]))
    assert (err.token_index, err.loc, err.page) == (first, tail_start, tail_start // page)
    assert err.count == int(last_page[-1]) - tail_start + 1 and err.num_pages == buggy_geometry.num_pages
    with pytest.raises(kvwrite.OutOfBoundsWrite, match=f"token {first} writes loc {tail_start}"):
        pool.errors.raise_if_any()


# --- out-of-tree variants and missing kernels -------------------------------------------------------

class SharedKV(VariantPlanner):
    """K and V share one cache (an out-of-tree variant: one buffer, stored with store_kv)."""

    fields = frozenset({"num_kv_heads", "head_dim"})

    def check_model(self, spec):
        if not spec.num_kv_heads or not spec.head_dim:
            raise SpecError("shared_kv needs num_kv_heads and head_dim")

    def pools(self, ctx):
        return [PoolSpec("kv", tuple(range(ctx.model.num_layers)),
                         (BufferSpec("k", (ctx.heads, ctx.model.head_dim), ctx.dtype),), "store_kv")]

    def inputs(self, plan, layer_id):
        return [("k", (plan.model.num_kv_heads, plan.model.head_dim), plan.model.torch_dtype)]

    def store(self, pool, layer_id, loc, tensors, scales):
        (k,) = tensors
        c = pool.layer("kv", layer_id)["k"]
        pool.ops["kv"](k, k, c, c, loc, **pool.op_kwargs("kv"))


def test_register_variant_plugs_in_a_planner():
    register_variant("shared_kv", SharedKV())
    try:
        with pytest.raises(ValueError, match="already registered"):
            register_variant("shared_kv", SharedKV())
        spec = ModelSpec("shared_kv", 2, num_kv_heads=2, head_dim=16)
        with pytest.raises(SpecError, match="does not use kv_lora_rank"):
            ModelSpec("shared_kv", 2, num_kv_heads=2, head_dim=16, kv_lora_rank=4)
        conf = KVCacheConfigurator(spec, page_size=4, max_total_num_tokens=16)
        assert conf.cell_size_bytes == 2 * 16 * 2 * 2
        pool = conf.plan().build(DEVICE, check="guard")
        locs = pool.allocator().alloc(4)
        (k,) = pool.sample_inputs(1, 4)
        pool.store(1, locs, k)
        assert torch.equal(rows(pool.layer("kv", 1)["k"])[locs], k)
        with pytest.raises(TypeError, match="VariantPlanner"):
            register_variant("other", object())
    finally:
        unregister_variant("shared_kv")
    with pytest.raises(UnknownVariant, match="shared_kv"):
        ModelSpec("shared_kv", 2, num_kv_heads=2, head_dim=16)


def test_missing_kernel_is_a_named_error(monkeypatch):
    monkeypatch.delattr(kvwrite, "store_indexer_k")
    with pytest.raises(KernelUnavailable, match="variant 'dsa' .*sub-pool 'indexer'.*kvwrite.store_indexer_k"):
        build("dsa")
    build("mla")   # unaffected
    import kvwrite.ops.mla as mla_op
    monkeypatch.setattr(mla_op, "FORMATS", {k: v for k, v in mla_op.FORMATS.items() if k != "nvfp4"})
    with pytest.raises(KernelUnavailable, match="kv_cache_dtype='nvfp4'.*does not support"):
        build("mla", kv="nvfp4")

    def old_store_kv(k, v, k_cache, v_cache, loc, *, check="off", errors=None, backend="auto"):
        raise AssertionError("not called")
    monkeypatch.setattr(kvwrite, "store_kv", old_store_kv)
    with pytest.raises(KernelUnavailable, match=r"sub-pool 'swa'.*store_kv\(loc_map=\.\.\.\)"):
        build("swa_hybrid")
    with pytest.raises(KernelUnavailable, match=r"sharded.*store_kv\(dcp_rank=, dcp_size="):
        build("mha", dcp=2)


@pytest.mark.parametrize("variant", ["mha", "swa_hybrid", "minimax_sparse"])
def test_nvfp4_pools_store_with_global_scales(variant):
    pool = build(variant, kv="nvfp4")
    full = pool.allocator()
    locs = full.alloc(8)
    if variant == "swa_hybrid":
        pool.map_swa(locs, pool.allocator("swa").alloc(8))
    lid = pool.plan.model.kv_layer_ids[0]
    sub = "swa" if variant == "swa_hybrid" else "kv"
    tensors = pool.sample_inputs(lid, 8, torch.Generator().manual_seed(9))
    gk, gv = torch.tensor(0.5), torch.tensor([2.0])
    scales = dict(k_global_scale=gk, v_global_scale=gv)
    if variant == "minimax_sparse":
        scales["index_global_scale"] = torch.tensor(0.25)
    pool.store(lid, locs, *tensors, **scales)
    pool.errors.raise_if_any()
    b = pool.layer(sub, lid)
    rows_at = pool.shared[sub]["loc_map"][locs] if variant == "swa_hybrid" else locs
    for name, x, g in (("k", tensors[0], gk), ("v", tensors[1], gv)):
        back = kvwrite.dequant_nvfp4(rows(b[name])[rows_at], rows(b[f"{name}_scale"])[rows_at], g)
        amax = x.float().abs().reshape(8, -1, 16).amax(-1, keepdim=True)
        err = (back.reshape(8, -1, 16) - x.float().reshape(8, -1, 16)).abs()
        assert bool((err <= amax / 4 + 1e-6).all())      # within a quarter of the block's amax
        assert int(b[name].count_nonzero()) > 0
    if variant == "minimax_sparse":
        ib = pool.layer("index", lid)
        back = kvwrite.dequant_nvfp4(rows(ib["k"])[locs], rows(ib["k_scale"])[locs], torch.tensor(0.25))
        assert back.shape == (8, 1, 32) and torch.allclose(back[:, 0], tensors[2].float(), atol=0.5 * float(tensors[2].float().abs().max()))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("variant", ["mla", "dsa"])
def test_mla_nvfp4_pools(variant, backend):
    pool = build(variant, kv="nvfp4", backend=backend, dcp=2, rank=1)
    locs = pool.allocator().alloc(8)
    tensors = pool.sample_inputs(1, 8, torch.Generator().manual_seed(10))
    g = torch.tensor(0.5)
    pool.store(1, locs, *tensors, global_scale=g)
    pool.errors.raise_if_any()
    b = pool.layer("kv", 1)
    assert set(b) == {"kv", "kv_scale"} and b["kv"].shape[-1] == 72 and b["kv_scale"].shape[-1] == 9
    twin, twin_scale = torch.zeros_like(b["kv"]), torch.zeros_like(b["kv_scale"])
    kvwrite.store_mla(tensors[0], tensors[1], twin, locs, kv_cache_dtype="nvfp4", scale_cache=twin_scale,
                      global_scale=g, dcp_rank=1, dcp_size=2, backend="torch")
    assert torch.equal(b["kv"], twin) and torch.equal(b["kv_scale"].view(torch.uint8), twin_scale.view(torch.uint8))
    mine = locs[locs % 2 == 1] // 2
    back = kvwrite.dequant_nvfp4(rows(b["kv"])[mine], rows(b["kv_scale"])[mine], g)
    x = torch.cat(tensors[:2], 1)[locs % 2 == 1].float()
    amax = x.reshape(x.shape[0], -1, 16).abs().amax(-1, keepdim=True)
    assert bool(((back - x).reshape(x.shape[0], -1, 16).abs() <= amax / 4 + 1e-6).all())


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("variant, kv", [(v, k) for v in sorted(TINY) for k in KV_DTYPES if supported(v, k)])
def test_a_rank_without_tokens_in_the_batch(variant, kv, backend):
    """A DCP rank that owns none of a batch's tokens (and an all-padding batch) writes nothing."""
    pool = build(variant, kv=kv, dcp=2, rank=1, backend=backend)
    loc = torch.tensor([8, 10, -1, 16], device=DEVICE)           # all even: rank 0's
    lid = pool.plan.model.kv_layer_ids[-1]
    if "swa" in pool.plan.spaces:
        pool.map_swa(loc[loc >= 0], torch.tensor([8, 10, 12]))
    pool.store(lid, loc, *pool.sample_inputs(lid, 4))
    pool.store(lid, torch.tensor([-1, -1], device=DEVICE), *pool.sample_inputs(lid, 2))
    assert pool.errors.error() is None
    sharded = [p.name for p in pool.plan.pools if p.sharded]
    untouched(pool, {(p.name, lid) for p in pool.plan.pools if p.name not in sharded})
