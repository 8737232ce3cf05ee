"""KVCacheConfigurator.plan(): loc_space_scale / pool_page_size, cell sizes, budgets, invariants."""
from __future__ import annotations

import json

import pytest
from hypothesis import given, strategies as st

from config_models import KV_DTYPES, TINY, supported
from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec
from kvwrite.config import BudgetTooSmall, ConfigError, UnsupportedCombination, WindowDoesNotFit
from kvwrite.geometry import GeometryError

GiB = 2**30


def cfg(model, *, dcp=1, draft=False, tp=1, rank=0, **kw):
    if isinstance(model, str):
        model = ModelSpec.from_preset(model)
    kw.setdefault("page_size", 64)
    return KVCacheConfigurator(model, ParallelSpec(tp_size=tp, dcp_size=dcp, dcp_rank=rank, is_draft_worker=draft), **kw)


@pytest.mark.parametrize("dcp, draft, scale", [(1, False, 1), (1, True, 1), (4, False, 1), (4, True, 4), (8, True, 8)])
def test_loc_space_scale_and_pool_page_size(dcp, draft, scale):
    c = cfg("deepseek-v3", dcp=dcp, draft=draft, page_size=16, max_total_num_tokens=4096)
    assert c.loc_space_scale == scale and c.pool_page_size == 16 * scale
    plan = c.plan()
    assert plan.loc_space_scale == scale and plan.pool_page_size == 16 * scale
    assert all(p.geometry.pool_page_size == 16 * scale for p in plan.pools)


def test_draft_worker_covers_the_virtual_space():
    """Issue example: 4096 per rank, dcp 4 -> the replicated draft pool covers 16384 locs in
    pages of page_size * 4, and serves the shared DCP allocator exactly."""
    target = cfg("deepseek-v3", dcp=4, page_size=64, max_total_num_tokens=4096).plan()
    draft = cfg("deepseek-v3", dcp=4, draft=True, page_size=64, max_total_num_tokens=4096).plan()
    assert target.max_total_num_tokens == 4096 and draft.max_total_num_tokens == 16384
    g = draft.pool("kv").geometry
    assert (g.page_size, g.loc_space_scale, g.pool_page_size, g.num_pages) == (64, 4, 256, 16384 // 256 + 1)
    # one shared allocator: the virtual space of 4 ranks of 4096 + a padding page each
    assert target.spaces["full"] == draft.spaces["full"]
    alloc = draft.allocator()
    assert (alloc.num_locs, alloc.page_size) == ((4096 + 64) * 4, 256)
    draft.check_allocator(alloc.page_size, alloc.num_locs)
    target.check_allocator(alloc.page_size, alloc.num_locs)
    assert target.pool("kv").geometry.capacity == 4096 + 64   # per rank
    assert draft.pool("kv").layer_ids == (0,)                 # the MTP layer


def test_cell_size_bytes_formulas():
    c = lambda name, kv="auto", **kw: cfg(name, kv_cache_dtype=kv, max_total_num_tokens=4096, **kw).cell_size_bytes
    assert c("llama-3.1-8b") == 8 * (128 + 128) * 32 * 2
    assert c("llama-3.1-8b", "fp8_e4m3") == 8 * 256 * 32
    assert c("llama-3.1-8b", "nvfp4") == 8 * 2 * (64 + 8) * 32          # e2m1 pairs + e4m3 per 16
    assert c("llama-3.1-70b", tp=8) == 1 * 256 * 80 * 2
    assert c("llama-3.1-70b", tp=16) == 1 * 256 * 80 * 2                # replicated heads
    assert c("deepseek-v3") == 576 * 61 * 2
    assert c("deepseek-v3", "fp8_e4m3") == 576 * 61
    assert c("deepseek-v3", "fp8_ds_mla") == 656 * 61
    assert c("deepseek-v3", "nvfp4") == (288 + 36) * 61
    assert c("deepseek-v3.2") == 576 * 61 * 2 + 132 * 61
    assert c("deepseek-v3.2", "fp8_ds_mla", dcp=4) == 656 * 61 + 4 * 132 * 61   # indexer: virtual loc
    assert c("deepseek-v3.2", "fp8_ds_mla", dcp=4, draft=True) == 656 + 132       # per virtual token
    assert c("qwen3-next-80b-a3b", max_running_requests=8) == 2 * 512 * 12 * 2   # the state is per request
    # hybrid SWA: F * n_full + r * S * n_swa (SGLang's cell: the int64 full->swa loc map is overhead)
    assert c("gpt-oss-120b") == pytest.approx(8 * 128 * 2 * 18 * (1 + 0.8))
    assert c("gemma-3-27b", swa_full_tokens_ratio=0.5) == 16 * 256 * 2 * (10 + 0.5 * 52)


def test_dcp_kv_heads_follow_sglang_and_vllm():
    """SGLang: max(1, H // (tp // dcp)) heads per rank; vLLM: H // tp with dcp <= tp // H."""
    llama = ModelSpec.from_preset("llama-3.1-8b")                      # 8 KV heads
    p = cfg(llama, tp=8, dcp=4, memory_bytes=20 * GiB).plan()
    assert p.pool("kv").buffers[0].shape[2] == 4                      # 8 // (8 // 4)
    assert p.cell_size_bytes == 4 * 256 * 32 * 2 and p.max_total_num_tokens == 327_680   # SGLang's figures
    assert p.total_bytes == 20 * GiB + p.overhead_bytes and p.overhead_bytes == 64 * 4 * 256 * 32 * 2
    draft = cfg(llama, tp=8, dcp=4, draft=True, max_total_num_tokens=4096).plan()
    assert draft.pool("kv").buffers[0].shape[2] == 1                  # drafts never join the DCP group
    assert ParallelSpec(tp_size=8, dcp_size=2).kv_heads_per_rank(2) == 1
    assert ParallelSpec(tp_size=16, dcp_size=2).kv_heads_per_rank(8) == 1
    vllm = ParallelSpec(tp_size=8, dcp_size=2, engine="vllm")
    assert vllm.kv_heads_per_rank(4) == 1 and vllm.kv_heads_per_rank(1, mla=True) == 1
    with pytest.raises(ConfigError, match="dcp_size <= tp_size // num_kv_heads"):
        ParallelSpec(tp_size=8, dcp_size=4, engine="vllm").kv_heads_per_rank(8)
    with pytest.raises(ConfigError, match="multiple of dcp_size"):
        ParallelSpec(tp_size=6, dcp_size=4)


@pytest.mark.parametrize("name", ["llama-3.1-8b", "deepseek-v3", "deepseek-v3.2", "gpt-oss-120b",
                                  "gemma-3-27b", "qwen3-next-80b-a3b"])
@pytest.mark.parametrize("dcp, draft", [(1, False), (4, False), (4, True)])
@pytest.mark.parametrize("sizing", ["engine", "strict"])
def test_memory_budget_is_filled_with_whole_pages(name, dcp, draft, sizing):
    budget = 20 * GiB
    state = dict(max_running_requests=64) if name == "qwen3-next-80b-a3b" and not draft else {}
    c = cfg(name, dcp=dcp, draft=draft, memory_bytes=budget, sizing=sizing, **state)
    plan = c.plan()
    pages = plan.max_total_num_tokens // plan.pool_page_size
    assert plan.max_total_num_tokens == pages * plan.pool_page_size
    if sizing == "strict":
        assert plan.total_bytes <= budget
        assert c.total_bytes_for(pages + 1) > budget     # the largest whole number of pages
    else:   # SGLang: tokens = (budget - fixed) // cell in whole pages; padding page, loc map beside
        page_bytes = plan.cell_size_bytes * plan.pool_page_size
        assert pages * page_bytes + plan.fixed_bytes <= budget < (pages + 1) * page_bytes + plan.fixed_bytes
        assert plan.total_bytes == pytest.approx(pages * page_bytes + plan.fixed_bytes + plan.overhead_bytes, abs=1)
    if plan.variant != "swa_hybrid":        # every pool: its pages plus one padding page
        assert plan.kv_bytes == plan.cell_size_bytes * (plan.max_total_num_tokens + plan.pool_page_size)
        assert plan.overhead_bytes == plan.cell_size_bytes * plan.pool_page_size
    assert plan.total_bytes == plan.kv_bytes + plan.state_bytes    # the recurrent state counts too
    assert plan.fixed_bytes == plan.state_bytes and (plan.state_bytes > 0) == (plan.variant == "hybrid_linear")


def test_max_total_num_tokens_rounds_down_and_both_limits():
    plan = cfg("llama-3.1-8b", max_total_num_tokens=1000).plan()
    assert plan.max_total_num_tokens == 960 and plan.pool("kv").geometry.num_pages == 16
    with pytest.raises(ConfigError, match="less than one page"):
        cfg("llama-3.1-8b", max_total_num_tokens=63).plan()
    with pytest.raises(BudgetTooSmall, match="needs"):
        cfg("llama-3.1-8b", max_total_num_tokens=10**6, memory_bytes=GiB).plan()
    both = cfg("llama-3.1-8b", max_total_num_tokens=1000, memory_bytes=GiB).plan()
    assert both.max_total_num_tokens == 960 and both.memory_bytes == GiB
    with pytest.raises(ConfigError, match="give memory_bytes"):
        cfg("llama-3.1-8b")


@pytest.mark.parametrize("sizing, pages", [("engine", 1), ("strict", 2)])
def test_too_small_a_budget_names_the_minimum(sizing, pages):
    c = cfg("deepseek-v3", memory_bytes=1000, sizing=sizing)
    with pytest.raises(BudgetTooSmall, match="needs") as info:
        c.plan()
    minimum = info.value.minimum_bytes
    assert minimum == pages * 64 * 576 * 2 * 61    # one page (+ the padding page when strict)
    assert cfg("deepseek-v3", memory_bytes=minimum, sizing=sizing).plan().max_total_num_tokens == 64
    with pytest.raises(BudgetTooSmall):
        cfg("deepseek-v3", memory_bytes=minimum - 1, sizing=sizing).plan()


def test_swa_pool_by_ratio_and_window_refusal():
    plan = cfg("gemma-3-27b", page_size=16, max_total_num_tokens=16000, swa_full_tokens_ratio=0.5).plan()
    full, swa = plan.pool("full"), plan.pool("swa")
    assert full.layer_ids == tuple(range(5, 62, 6)) and len(swa.layer_ids) == 52
    assert full.geometry.num_pages == 1001 and swa.geometry.num_pages == 501
    assert plan.spaces["swa"].num_locs == 501 * 16
    assert swa.buffers[-1].name == "loc_map" and swa.buffers[-1].shape == (1001 * 16,)
    with pytest.raises(WindowDoesNotFit, match="sliding window of 1024"):
        cfg("gemma-3-27b", page_size=16, max_total_num_tokens=1024).plan()
    with pytest.raises(BudgetTooSmall, match="window") as info:
        cfg("gemma-3-27b", page_size=16, memory_bytes=10**6).plan()
    ok = cfg("gemma-3-27b", page_size=16, memory_bytes=info.value.minimum_bytes).plan()
    assert (ok.pool("swa").geometry.num_pages - 1) * 16 > 1024 + 16    # SGLang's floor: window + page
    with pytest.raises(ConfigError, match="swa_full_tokens_ratio"):
        cfg("gemma-3-27b", max_total_num_tokens=4096, swa_full_tokens_ratio=0)


def test_hybrid_linear_plans_only_full_attention_layers():
    plan = cfg("qwen3-next-80b-a3b", tp=2, max_total_num_tokens=4096, max_running_requests=4).plan()
    (kv,) = plan.pools
    assert kv.layer_ids == tuple(range(3, 48, 4))
    assert [b.shape for b in kv.buffers] == [(65, 64, 1, 256)] * 2


def test_unsupported_combinations_are_named():
    with pytest.raises(UnsupportedCombination, match="fp8_ds_mla"):
        cfg("llama-3.1-8b", kv_cache_dtype="fp8_ds_mla", max_total_num_tokens=4096)
    with pytest.raises(UnsupportedCombination, match="multiples of 16"):
        cfg(ModelSpec("mha", 1, num_kv_heads=1, head_dim=40), kv_cache_dtype="nvfp4", max_total_num_tokens=64)
    with pytest.raises(UnsupportedCombination, match="multiple of 128"):
        cfg(ModelSpec("mla", 1, kv_lora_rank=96, qk_rope_head_dim=32), kv_cache_dtype="fp8_ds_mla",
            max_total_num_tokens=64)
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        cfg("llama-3.1-8b", kv_cache_dtype="int4", max_total_num_tokens=64)


def test_plan_to_dict_is_json():
    plan = cfg("deepseek-v3.2", dcp=2, kv_cache_dtype="fp8_ds_mla", memory_bytes=GiB).plan()
    d = json.loads(plan.to_json())
    assert d["max_total_num_tokens"] == plan.max_total_num_tokens and d["total_bytes"] == plan.total_bytes
    assert [p["name"] for p in d["pools"]] == ["kv", "indexer"]
    kv, idx = d["pools"]
    assert kv["addressing"] == "sharded" and idx["addressing"] == "virtual"
    # SGLang's index pages: 64 rows on every worker, over the whole virtual space
    assert kv["buffers"][0]["shape"][2] == 656 and idx["geometry"]["pool_page_size"] == 64
    assert idx["geometry"]["num_pages"] == 2 * kv["geometry"]["num_pages"]
    assert kv["allocator"] == idx["allocator"] == d["allocators"]["full"]
    assert kv["op"] == "store_mla" and idx["op"] == "store_indexer_k"


def test_check_allocator_refuses_mismatches():
    plan = cfg("deepseek-v3.2", dcp=4, max_total_num_tokens=4096).plan()
    space = plan.spaces["full"]
    plan.check_allocator(space.page_size, space.num_locs)
    with pytest.raises(GeometryError, match="sub-pool 'kv'"):
        plan.check_allocator(64, space.num_locs)          # per-rank pages against a sharded pool
    with pytest.raises(GeometryError, match="sub-pool 'indexer'"):
        plan.pool("indexer").check_allocator(space.page_size, space.num_locs + space.page_size)
    with pytest.raises(GeometryError, match="multiples of 4"):
        plan.pool("kv").check_allocator(space.page_size + 1, space.num_locs)


# --- the invariants, over every variant x kv_cache_dtype x page size x dcp x draft x budget -----

@st.composite
def plan_cases(draw):
    variant = draw(st.sampled_from(sorted(TINY)))
    return dict(variant=variant, kv=draw(st.sampled_from([k for k in KV_DTYPES if supported(variant, k)])),
                page=draw(st.sampled_from([1, 4, 16, 64, 128])), dcp=draw(st.sampled_from([1, 2, 4, 8])),
                draft=draw(st.booleans()), tp=draw(st.sampled_from([1, 8])),
                budget=draw(st.integers(2**16, 2**34)), ratio=draw(st.sampled_from([0.25, 0.5, 0.8, 1.0])),
                rank=draw(st.integers(0, 7)))


@given(c=plan_cases())
def test_plan_invariants(c):
    conf = KVCacheConfigurator(TINY[c["variant"]], ParallelSpec(tp_size=c["tp"], dcp_size=c["dcp"],
                                                                dcp_rank=c["rank"] % c["dcp"],
                                                                is_draft_worker=c["draft"]),
                               page_size=c["page"], kv_cache_dtype=c["kv"], memory_bytes=c["budget"],
                               swa_full_tokens_ratio=c["ratio"], sizing="strict")
    try:
        plan = conf.plan()
    except BudgetTooSmall as err:
        assert err.minimum_bytes > c["budget"]
        return
    assert plan.total_bytes <= c["budget"]
    assert conf.total_bytes_for(plan.max_total_num_tokens // plan.pool_page_size + 1) > c["budget"]
    assert plan.pool_page_size == c["page"] * conf.loc_space_scale
    assert plan.loc_space_scale == (c["dcp"] if c["draft"] and c["dcp"] > 1 else 1)
    for p in plan.pools:
        g, space = p.geometry, p.space
        assert g.capacity % g.pool_page_size == 0
        # pool page size == the allocator's page granularity (in local rows for a sharded pool)
        local = c["dcp"] if p.sharded else 1
        index_pages = p.spec.virtual and c["dcp"] > 1    # SGLang's page_size-row index pages
        assert g.pool_page_size * (c["dcp"] if index_pages and not c["draft"] else local) == space.page_size \
            or (index_pages and g.pool_page_size == c["page"])
        assert g.capacity * local >= space.num_locs        # covers the allocator's loc space
        p.check_allocator(space.page_size, space.num_locs)
        if c["draft"]:
            assert p.addressing in ("local", "virtual")
        assert p.bytes == sum(b.bytes * (len(p.layer_ids) if b.per_layer else 1) for b in p.buffers)
    assert plan.total_bytes == sum(p.bytes for p in plan.pools)


@pytest.mark.parametrize("draft", [False, True])
def test_dsa_indexer_uses_sglangs_index_pages_under_dcp(draft):
    """SGLang's DSA indexer cache keeps 64-token index pages on target and draft workers alike
    (DSATokenToKVPool.index_page_size; its readers view the buffer in rows of 64 tokens), over
    the virtual loc space: loc 300's fp32 scale sits at byte 4 * 64 * 132 + 64 * 128 + 44 * 4."""
    import torch
    plan = cfg("deepseek-v3.2", dcp=4, draft=draft, max_total_num_tokens=4096).plan()
    idx = plan.pool("indexer")
    assert idx.geometry.pool_page_size == 64 and idx.addressing == "virtual"
    assert idx.geometry.capacity >= plan.spaces["full"].num_locs
    plan.verify()
    pool = plan.build("cpu", check="guard", backend="torch")
    loc = torch.tensor([300])
    bf = torch.bfloat16
    index_k = torch.full((1, 128), 448.0, dtype=bf)             # amax 448 -> scale 1.0
    pool.store(0, loc, torch.zeros(1, 512, dtype=bf), torch.zeros(1, 64, dtype=bf), index_k)
    pool.errors.raise_if_any()
    flat = pool.layer("indexer", 0)["index_k"].reshape(-1)
    assert flat[42160:42164].view(torch.float32).item() == 1.0
    codes = set(range(4 * 8448 + 44 * 128, 4 * 8448 + 45 * 128))     # the e4m3 codes of page 4, row 44
    assert set(flat.nonzero().reshape(-1).tolist()) <= codes | set(range(42160, 42164))
