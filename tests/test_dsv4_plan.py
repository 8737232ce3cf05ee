"""The "dsv4" variant: ModelSpec from a DeepSeek V4 config.json, the sub-pools and their
geometry, the sizing (hand-checked), draft and DCP handling, `kvwrite plan`, stores through a
built pool."""
from __future__ import annotations

import json
import math

import pytest
import torch

import kvwrite
from kvwrite import cli
from kvwrite.config import KVCacheConfigurator, ModelSpec, ParallelSpec, SpecError, UnsupportedCombination
from kvwrite.config.presets import PRESETS
from kvwrite.ops.dsv4 import kv_page_bytes

GiB = 2**30
SUBPOOLS = ["swa", "c4", "c4_indexer", "c4_state", "c4_indexer_state", "c128", "c128_state"]


def flash():
    return ModelSpec.from_preset("deepseek-v4-flash")


def plan(model=None, parallel=None, **kw):
    kw.setdefault("memory_bytes", 40 * GiB)
    return KVCacheConfigurator(model or flash(), parallel, page_size=kw.pop("page_size", 256),
                               kv_cache_dtype="fp8_e4m3", swa_full_tokens_ratio=kw.pop("ratio", 0.1), **kw).plan()


def test_from_hf_config_reads_the_published_fields(tmp_path):
    cfg = dict(PRESETS["deepseek-v4-flash"][1])
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + 1     # + the MTP layer
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = ModelSpec.from_hf_config(tmp_path)
    assert (m.variant, m.num_layers, m.head_dim, m.qk_rope_head_dim, m.index_head_dim, m.sliding_window) == \
        ("dsv4", 43, 512, 64, 128, 128)
    assert m.compress_ratios == tuple(cfg["compress_ratios"][:43]) and m.num_draft_layers == 1
    assert (m.compress_ratios.count(0), m.compress_ratios.count(4), m.compress_ratios.count(128)) == (2, 21, 20)
    pro = ModelSpec.from_preset("deepseek-v4-pro")
    assert (pro.num_layers, pro.compress_ratios.count(4), pro.compress_ratios.count(128)) == (61, 30, 31)
    with pytest.raises(SpecError, match="one compress ratio per layer"):
        ModelSpec("dsv4", 3, head_dim=512, qk_rope_head_dim=64, index_head_dim=128, sliding_window=128,
                  compress_ratios=(0, 4))
    with pytest.raises(SpecError, match="head_dim=512"):
        ModelSpec("dsv4", 1, head_dim=576, qk_rope_head_dim=64, sliding_window=128, compress_ratios=(0,))


def test_plan_sub_pools_geometry_and_sizing_by_hand():
    p = plan(max_running_requests=256)
    assert [s.name for s in p.pools] == SUBPOOLS
    g = {s.name: s.geometry for s in p.pools}
    pages = p.max_total_num_tokens // 256 + 1                # + the padding page
    assert (g["c4"].pool_page_size, g["c4_indexer"].pool_page_size, g["c128"].pool_page_size) == (64, 64, 2)
    assert g["c4"].num_pages == g["c128"].num_pages == g["c4_indexer"].num_pages == pages
    swa_pages = int((pages - 1) * 256 * 0.1) // 256 + 1      # SGLang: int(full * ratio) in whole pages
    assert g["swa"].num_pages == swa_pages and g["swa"].pool_page_size == 256
    assert g["c4_state"].capacity == -(-(swa_pages * 8 + 8 + 1) // 4) * 4     # ring 8 per 256-token SWA page
    assert g["c128_state"].capacity == -(-(257 * 128 + 128 + 1) // 128) * 128
    shape = {s.name: s.buffers[0].shape for s in p.pools}
    assert shape["swa"] == (swa_pages, 149760) and shape["c4"] == (pages, 37440)
    assert shape["c128"] == (pages, 1728) and shape["c4_indexer"] == (pages, 64 * 132)
    assert shape["c4_state"][1] == 2 * 2 * 512 and shape["c4_indexer_state"][1] == 2 * 2 * 128
    assert shape["c128_state"][1] == 2 * 512
    # total bytes written out: 43 SWA layers, 21 c4 layers, 20 c128 layers, fp32 states, loc map
    full_locs = pages * 256
    c128_state = 20 * g["c128_state"].capacity * 1024 * 4
    total = (43 * swa_pages * kv_page_bytes(256) + full_locs * 8
             + 21 * pages * (kv_page_bytes(64) + 64 * 132)
             + 21 * g["c4_state"].capacity * (2048 + 512) * 4
             + 20 * pages * kv_page_bytes(2) + c128_state)
    assert p.total_bytes == total and p.fixed_bytes == c128_state
    # SGLang's bytes per full token, page-padded KV rows (585 B at 256 and 64 rows, 864 B at 2), the
    # c4 states priced per SWA slot (ring 8 per 256-token page)
    cell = (0.1 * 585 * 43 + 585 * 21 / 4 + 864 * 20 / 128 + 132 * 21 / 4 + 0.1 * 8 / 256 * (2048 + 512) * 4 * 21)
    assert p.cell_size_bytes == pytest.approx(cell)
    tokens = int((40 * GiB - c128_state) / cell) // 256 * 256     # SGLang: int(avail / cell), whole pages
    assert p.max_total_num_tokens == tokens


def test_engine_defaults_auto_ratio_and_request_estimate():
    """kv_cache_dtype "auto" is V4's native fp8; swa_full_tokens_ratio defaults to SGLang's V4 0.1
    (Python and CLI alike); c128 request slots: SGLang's estimate tokens / context * 512 in [2048, 4096]."""
    c = KVCacheConfigurator(flash(), memory_bytes=40 * GiB)
    p = c.plan()
    assert (c.page_size, c.kv_cache_dtype, c.swa_full_tokens_ratio) == (256, "fp8_e4m3", 0.1)
    full = int(40 * GiB / p.cell_size_bytes)
    assert p.max_running_requests == max(min(int(full / 1048576 * 512), 4096), 2048) == 2959
    assert p.pool("c128_state").geometry.capacity == -(-(2960 * 128 + 129) // 128) * 128
    small = KVCacheConfigurator(flash(), max_total_num_tokens=8192, max_running_requests=3).plan()
    assert small.max_running_requests == 3 and small.pool("c128_state").geometry.capacity == 768   # (4 * 128 + 129) up to 128
    with pytest.raises(UnsupportedCombination, match="no kv_cache_dtype='int8'.*fp8_e4m3"):
        KVCacheConfigurator(flash(), memory_bytes=GiB, kv_cache_dtype="int8")


def test_draft_worker_under_dcp_has_the_swa_pool_only_paged_in_pool_page_size():
    p = plan(parallel=ParallelSpec(dcp_size=4, is_draft_worker=True))
    assert [s.name for s in p.pools] == ["swa"] and p.model.compress_ratios == (0,)
    swa = p.pool("swa")
    assert p.pool_page_size == 1024 and swa.geometry.pool_page_size == 1024 and swa.addressing == "virtual"
    assert swa.buffers[0].shape[1] == kv_page_bytes(1024) == 598464
    p.verify()


def test_dcp_target_pools_are_sharded_and_store_by_page():
    m = ModelSpec("dsv4", 2, head_dim=512, qk_rope_head_dim=64, index_head_dim=128, sliding_window=128,
                  compress_ratios=(0, 4), name="tiny")
    p = plan(m, ParallelSpec(dcp_size=2, dcp_rank=1), memory_bytes=None, max_total_num_tokens=1024, ratio=1.0)
    assert {s.name: s.addressing for s in p.pools} == {
        "swa": "sharded", "c4": "sharded", "c4_indexer": "sharded", "c4_state": "local", "c4_indexer_state": "local"}
    pool = p.build("cpu", check="guard", backend="torch")
    pages = p.pool("swa").geometry.num_pages
    full = torch.arange(0, 2 * pages * 256, 97)
    pool.map_swa(full, full)                              # identity full -> swa
    kv = torch.randn(full.shape[0], 512)
    pool.store(1, full, kv)
    pool.errors.raise_if_any()
    ref = torch.zeros(2 * pages, kv_page_bytes(256), dtype=torch.uint8)
    kvwrite.store_dsv4_kv(kv, ref, full, backend="torch")   # one cache of every virtual page
    assert torch.equal(pool.layer("swa", 1)["kv"], ref[1::2])   # rank 1 holds pages 1, 3, ...
    with pytest.raises(UnsupportedCombination, match="multiple of 128"):
        plan(m, page_size=64)


def test_cli_plan_shows_every_sub_pool(capsys):
    rc = cli.main(["plan", "--preset", "deepseek-v4-flash", "--memory", "40GiB", "--json"])
    d = json.loads(capsys.readouterr().out)
    assert rc == 0 and d["page_size"] == 256 and d["kv_cache_dtype"] == "fp8_e4m3"
    assert [s["name"] for s in d["pools"]] == SUBPOOLS and d["sizing"] == "engine"
    assert d["max_total_num_tokens"] == KVCacheConfigurator(flash(), memory_bytes=40 * GiB).plan().max_total_num_tokens


def test_default_request_slots_message_names_the_c128_state_and_the_knob():
    """20 GiB per rank without max_running_requests: SGLang's default 2,048 request slots put
    ~21.5 GB in the c128 state ring; the message says so and names max_running_requests."""
    from kvwrite.config import BudgetTooSmall
    from kvwrite import KVCacheConfigurator, ModelSpec

    spec = ModelSpec.from_preset("deepseek-v4-flash")
    with pytest.raises(BudgetTooSmall, match=r"c128 compress-state ring .* 2048 request slots \(max_running_requests "
                                              r"unset.*takes 21506293760 bytes.*give max_running_requests=\d+ or fewer"):
        KVCacheConfigurator(spec, memory_bytes=20 * 2**30).plan()
    plan = KVCacheConfigurator(spec, memory_bytes=20 * 2**30, max_running_requests=64).plan()
    assert plan.max_total_num_tokens == 2_930_944


# --- FP4 records (store_dsv4_kv_fp4) under the engines' kv_cache_dtype names --------------------------

TINY = dict(head_dim=512, qk_rope_head_dim=64, index_head_dim=128, sliding_window=128, name="tiny")


@pytest.mark.parametrize("engine,kv,fmt,per_token", [
    ("sglang", "fp4_e2m1", "mxfp4", 368), ("sglang", "nvfp4", "nvfp4", 384),
    ("kvwrite", "nvfp4_fi_ds_mla", "nvfp4", 384), ("kvwrite", "nvfp4_v41", "nvfp4_v41", 288)])
def test_fp4_plans_size_by_hand(engine, kv, fmt, per_token):
    """Every V4 KV pool holds `per_token` bytes a token, pages without padding; SGLang's NVFP4 pool
    regroups its rows into 64 / 64 / 2-token pages (one flat slot space)."""
    p = KVCacheConfigurator(flash(), ParallelSpec(engine=engine), page_size=256, kv_cache_dtype=kv,
                            swa_full_tokens_ratio=0.1, memory_bytes=40 * GiB, max_running_requests=256).plan()
    pools = {s.name: s for s in p.pools}
    assert [s.name for s in p.pools] == SUBPOOLS and p.kv_cache_dtype == kv
    pages = p.max_total_num_tokens // 256 + 1
    swa_pages = int((pages - 1) * 256 * 0.1) // 256 + 1
    regroup = kv == "nvfp4" and engine == "sglang"
    for name, tokens, k in (("swa", 256, 64), ("c4", 64, 64), ("c128", 2, 2)):
        s, n = pools[name], swa_pages if name == "swa" else pages
        pps = k if regroup else tokens
        assert s.op == "store_dsv4_kv_fp4" and f"fmt={fmt}" in s.kernel
        assert s.geometry.pool_page_size == pps and s.buffers[0].shape == (n * tokens // pps, pps * per_token)
        assert s.geometry.capacity == n * tokens and s.spec.regrouped == regroup
    assert pools["c4_indexer"].buffers[0].shape == (pages, 64 * 132)       # the indexer stays fp8
    # SGLang's cell: the fp8 formula with kv(p) = per_token (no page padding)
    cell = (0.1 * per_token * 43 + per_token * 21 / 4 + per_token * 20 / 128 + 132 * 21 / 4
            + 0.1 * 8 / 256 * (2048 + 512) * 4 * 21)
    assert p.cell_size_bytes == pytest.approx(cell)
    fixed = 20 * pools["c128_state"].geometry.capacity * 1024 * 4
    assert p.max_total_num_tokens == int((40 * GiB - fixed) / cell) // 256 * 256
    p.verify()
    for name in ("swa", "c4", "c128"):   # an allocator of 256-token pages hands out whole pool pages
        pools[name].check_allocator(pools[name].space.page_size, pools[name].space.num_locs)


def test_fp4_token_counts_by_hand_against_fp8():
    """A 2-layer model (SWA + c4) at 1 GiB: tokens = budget // cell, cell by hand per record."""
    m = ModelSpec("dsv4", 2, compress_ratios=(0, 4), **TINY)
    states = 0.5 * 8 / 256 * (2048 + 512) * 4       # c4 states at ratio 0.5, one c4 layer
    for kv, per in (("fp8_e4m3", 585), ("nvfp4_fi_ds_mla", 384), ("fp4_e2m1", 368), ("nvfp4_v41", 288)):
        p = KVCacheConfigurator(m, page_size=256, kv_cache_dtype=kv, swa_full_tokens_ratio=0.5,
                                memory_bytes=GiB).plan()
        cell = 0.5 * per * 2 + per / 4 + 132 / 4 + states
        assert p.cell_size_bytes == pytest.approx(cell)
        assert p.max_total_num_tokens == int(GiB / cell) // 256 * 256
    # by hand: cell = 1.25 * kv + 33 (indexer) + 160 (states): fp8 924.25 B -> 1,161,728 tokens, nvfp4 673 B
    # -> 1,595,392, mxfp4 653 B -> 1,644,288, nvfp4_v41 553 B -> 1,941,504 (int(2**30 / cell) in 256-pages)
    got = [KVCacheConfigurator(m, page_size=256, kv_cache_dtype=kv, swa_full_tokens_ratio=0.5,
                               memory_bytes=GiB).plan().max_total_num_tokens
           for kv in ("fp8_e4m3", "nvfp4_fi_ds_mla", "fp4_e2m1", "nvfp4_v41")]
    assert got == [1_161_728, 1_595_392, 1_644_288, 1_941_504]


@pytest.mark.parametrize("engine,kv,fmt", [("sglang", "nvfp4", "nvfp4"), ("sglang", "fp4_e2m1", "mxfp4"),
                                           ("kvwrite", "nvfp4_v41", "nvfp4_v41")])
def test_fp4_pool_stores_and_round_trips(engine, kv, fmt):
    """plan.build().store() writes the record `store_dsv4_kv_fp4` writes into the SWA pool (through
    the loc map), and dequant reads the values back within the format's error."""
    m = ModelSpec("dsv4", 1, compress_ratios=(0,), **TINY)
    p = KVCacheConfigurator(m, ParallelSpec(engine=engine), page_size=256, kv_cache_dtype=kv,
                            swa_full_tokens_ratio=1.0, max_total_num_tokens=512).plan()
    pool = p.build("cpu", check="guard", backend="torch")
    full = torch.tensor([256, 300, 511, 600, -1])
    swa = torch.tensor([700, 257, 300, 256, -1])
    pool.map_swa(full[:4], swa[:4])
    kv_in = torch.randn(5, 512, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    pool.store(0, full, kv_in)
    pool.errors.raise_if_any()
    cache = pool.layer("swa", 0)["kv"]
    ref = torch.zeros_like(cache)
    kvwrite.store_dsv4_kv_fp4(kv_in, ref, swa, fmt=fmt, backend="torch")
    assert torch.equal(cache, ref)
    back = kvwrite.dequant_dsv4_kv_fp4(cache, swa[:4], fmt=fmt)
    x = kv_in[:4].float()
    assert back[:, 448 if fmt != "nvfp4_v41" else 512:].equal(x[:, 448 if fmt != "nvfp4_v41" else 512:])
    assert ((back - x).abs() <= x.abs().amax() * 0.5).all()   # within an e2m1 step of its block
    assert (back - x).abs().mean() < 0.2 * x.abs().mean()


def test_fp4_engine_names_and_refusals():
    with pytest.raises(UnsupportedCombination, match="no DeepSeek V4 kv_cache_dtype 'nvfp4_fi_ds_mla'"):
        KVCacheConfigurator(flash(), ParallelSpec(engine="sglang"), kv_cache_dtype="nvfp4_fi_ds_mla", memory_bytes=GiB)
    with pytest.raises(UnsupportedCombination, match="dcp_size=2"):
        KVCacheConfigurator(flash(), ParallelSpec(engine="sglang", tp_size=2, dcp_size=2), kv_cache_dtype="nvfp4",
                            memory_bytes=GiB)
    with pytest.raises(UnsupportedCombination, match="multiple of 256"):
        KVCacheConfigurator(flash(), ParallelSpec(engine="sglang"), page_size=128, kv_cache_dtype="nvfp4",
                            memory_bytes=GiB)
    with pytest.raises(UnsupportedCombination, match="vLLM's layout of variant 'dsv4'.*engine='kvwrite' \\(its record"):
        KVCacheConfigurator(flash(), ParallelSpec(engine="vllm"), kv_cache_dtype="nvfp4_fi_ds_mla", memory_bytes=GiB)
    notes = KVCacheConfigurator(flash(), ParallelSpec(engine="sglang"), kv_cache_dtype="fp4_e2m1",
                                memory_bytes=40 * GiB, max_running_requests=256).plan().engine_notes
    assert any("PR #37138" in n for n in notes)
    with pytest.raises(UnsupportedCombination, match="fp4_e2m1"):   # not a V4-less variant's format
        KVCacheConfigurator(ModelSpec("mla", 2, kv_lora_rank=512, qk_rope_head_dim=64), kv_cache_dtype="fp4_e2m1",
                            memory_bytes=GiB)


def test_cli_plan_shows_fp4_capacity_against_fp8(capsys):
    rc = cli.main(["plan", "--preset", "deepseek-v4-flash", "--memory", "40GiB", "--kv-cache-dtype", "nvfp4",
                   "--max-running-requests", "256"])
    out = capsys.readouterr().out
    fp8 = KVCacheConfigurator(flash(), ParallelSpec(engine="sglang"), memory_bytes=40 * GiB,
                              max_running_requests=256).plan().max_total_num_tokens
    fp4 = KVCacheConfigurator(flash(), ParallelSpec(engine="sglang"), kv_cache_dtype="nvfp4", memory_bytes=40 * GiB,
                              max_running_requests=256).plan().max_total_num_tokens
    assert rc == 0 and "584 -> 384 B a token: 1.52x the tokens per GiB" in out
    assert f"{fp4:,} tokens against {fp8:,} with the fp8 record ({fp4 / fp8:.2f}x" in out
    for kv, per, ratio in (("fp4_e2m1", 368, "1.59x"), ("nvfp4_v41", 288, "2.03x")):
        cli.main(["plan", "--preset", "deepseek-v4-flash", "--engine", "kvwrite", "--kv-cache-dtype", kv,
                  "--max-running-requests", "256"])
        assert f"584 -> {per} B a token: {ratio} the tokens per GiB" in capsys.readouterr().out
