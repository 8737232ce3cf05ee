"""Hybrid-linear recurrent-state pools (sized, budgeted, built), the Ascend
(npu) pool layouts stored through the torch backend, layout="HND" and reserve_padding_page=False."""
from __future__ import annotations

import json

import pytest
import torch

from config_models import TINY
from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec, cli
from kvwrite.config import ConfigError, KernelUnavailable, RecurrentState, UnsupportedCombination
from kvwrite.config.presets import PRESETS

GDN = RecurrentState("gdn", num_heads=4, head_dim=8, state_size=16, num_groups=2, conv_kernel=4)
HYBRID = ModelSpec("hybrid_linear", 4, num_kv_heads=2, head_dim=32, full_attention_layer_ids=[3],
                   linear_layer_ids=[0, 1, 2], linear_state=GDN)


def plan(model, **kw):
    kw.setdefault("page_size", 16)
    kw.setdefault("max_total_num_tokens", 64)
    return KVCacheConfigurator(model, **kw).plan()


def test_state_pool_is_sized_counted_and_built():
    p = plan(HYBRID, max_running_requests=5)
    st = p.state_pool()
    conv, ssm = st.buffers
    assert (conv.shape, conv.dtype) == ((6, 2 * 2 * 16 + 4 * 8, 3), "bfloat16")   # 5 + 1 slots
    assert (ssm.shape, ssm.dtype) == ((6, 4, 16, 8), "float32")
    per_slot = (96 * 3 * 2 + 4 * 16 * 8 * 4) * 3
    assert st.bytes_per_slot == per_slot and p.state_bytes == 6 * per_slot
    assert p.cell_size_bytes == 2 * 64 * 1 * 2                    # bytes per token: KV only
    assert p.total_bytes == p.kv_bytes + p.state_bytes
    d = json.loads(p.to_json())
    assert d["state_bytes"] == p.state_bytes and d["state_pools"][0]["slots"] == 6
    pool = p.build("cpu", backend="torch")
    assert pool.state(0)["conv"].shape == (6, 96, 3) and pool.state(2)["ssm"].dtype == torch.float32
    assert pool.nbytes == p.total_bytes
    with pytest.raises(Exception, match="state pool"):
        pool.state(3)                                              # the attention layer has no state


def test_state_counts_in_the_memory_budget():
    kv_only = plan(HYBRID, max_running_requests=1, max_total_num_tokens=None, memory_bytes=200_000)
    busy = plan(HYBRID, max_running_requests=8, max_total_num_tokens=None, memory_bytes=200_000)
    assert busy.max_total_num_tokens < kv_only.max_total_num_tokens
    for p in (busy, kv_only):   # engine sizing: the state first, then tokens * cell; padding page beside
        assert p.fixed_bytes == p.state_bytes
        assert p.state_bytes + p.max_total_num_tokens * p.cell_size_bytes <= 200_000
        assert p.total_bytes == p.state_bytes + (p.max_total_num_tokens + 16) * p.cell_size_bytes
    strict = plan(HYBRID, max_running_requests=8, max_total_num_tokens=None, memory_bytes=200_000, sizing="strict")
    assert strict.total_bytes <= 200_000


def test_state_pool_defaults_to_sglangs_memory_share():
    """No max_running_requests: SGLang's mamba_full_memory_ratio 0.9 gives the state 0.9 / 1.9
    of the budget, K = (share - per_slot) // per_slot request slots, K + 1 allocated."""
    per_slot = (96 * 3 * 2 + 4 * 16 * 8 * 4) * 3
    p = plan(HYBRID, max_total_num_tokens=None, memory_bytes=10**6)
    k = int((10**6 * 0.9 / 1.9 - per_slot) // per_slot)
    assert p.max_running_requests == k == 59 and p.state_pool().slots == 60
    assert p.state_bytes == 60 * per_slot
    assert p.max_total_num_tokens == (10**6 - 60 * per_slot) // 256 // 16 * 16       # 256 B a token
    # a token count only: state memory = 0.9 x the KV memory of those tokens
    t = plan(HYBRID, max_total_num_tokens=16 * 1024)
    assert t.max_running_requests == int(16 * 1024 * 256 * 0.9 // per_slot) - 1
    with pytest.raises(ConfigError, match="no request slot"):
        plan(HYBRID, max_total_num_tokens=64)


def test_max_running_requests_applies_only_to_slot_pools():
    with pytest.raises(ConfigError, match="has none; leave it unset"):
        plan(TINY["mha"], max_running_requests=4)
    with pytest.raises(ConfigError, match="has none"):     # the MTP draft of a hybrid is plain attention
        KVCacheConfigurator(HYBRID, ParallelSpec(is_draft_worker=True), page_size=16, max_total_num_tokens=64,
                            max_running_requests=4)
    with pytest.raises(Exception, match="linear_layer_ids and linear_state together"):
        ModelSpec("hybrid_linear", 4, num_kv_heads=2, head_dim=32, full_attention_layer_ids=[3], linear_state=GDN)


def test_plan_cli_shows_the_split(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps(PRESETS["qwen3-next-80b-a3b"][1]))
    rc = cli.main(["plan", "--config", str(tmp_path), "--max-tokens", "4096", "--max-running-requests", "16"])
    out = capsys.readouterr().out
    assert rc == 0 and "state_bytes=" in out and "16 + 1 request slots" in out and "kv_bytes=" in out
    rc = cli.main(["plan", "--config", str(tmp_path), "--max-tokens", "4096"])
    assert rc == 2 and "give max_running_requests" in capsys.readouterr().err


def _store(pool, plan_, n=9, seed=0):
    g = torch.Generator().manual_seed(seed)
    loc = plan_.allocator().alloc(n)[:n]
    loc[3] = -1
    for layer in sorted(pool._layers):
        pool.store(layer, loc, *pool.sample_inputs(layer, n, g))
    return loc


def test_hnd_layout_plans_and_stores_head_major():
    nhd, hnd = plan(TINY["mha"]), plan(TINY["mha"], layout="HND")
    assert hnd.pool("kv").buffers[0].shape == (5, 2, 16, 32) and nhd.pool("kv").buffers[0].shape == (5, 16, 2, 32)
    assert hnd.cell_size_bytes == nhd.cell_size_bytes and hnd.to_dict()["layout"] == "HND"
    a, b = nhd.build("cpu", backend="torch"), hnd.build("cpu", backend="torch")
    _store(a, nhd)
    _store(b, hnd)
    for layer in (0, 1):
        for name in ("k", "v"):
            assert torch.equal(a.layer("kv", layer)[name], b.layer("kv", layer)[name].transpose(1, 2))
    with pytest.raises(UnsupportedCombination, match="no head axis"):
        plan(TINY["mla"], layout="HND")


def test_no_padding_page_for_the_minus_one_convention():
    p = plan(TINY["mha"], reserve_padding_page=False)
    assert p.pool("kv").geometry.num_pages == 4 and p.spaces["full"].num_locs == 64
    assert p.kv_bytes == p.cell_size_bytes * 64                  # no extra page
    alloc = p.allocator()
    assert alloc.usable_locs == 64 and int(alloc.alloc(16)[0]) == 0   # page 0 is handed out
    pool = p.build("cpu", backend="torch")
    loc = torch.tensor([0, -1, 5])
    k, v = pool.sample_inputs(0, 3, torch.Generator().manual_seed(1))
    pool.store(0, loc, k, v)
    assert torch.equal(pool.layer("kv", 0)["k"][0, 0], k[0]) and torch.equal(pool.layer("kv", 0)["k"][0, 5], k[2])
    assert plan(TINY["mha"]).pool("kv").geometry.num_pages == 5     # the default keeps page 0


def test_ascend_mha_layout_is_one_tensor_for_all_layers():
    gpu, npu = plan(TINY["mha"]), plan(TINY["mha"], target="npu")
    assert npu.kv_bytes == gpu.kv_bytes and npu.pool("kv").buffers[0].stacked
    a, b = gpu.build("cpu", backend="torch"), npu.build("cpu")
    assert b.backend == "torch"
    k0, k1 = b.layer("kv", 0)["k"], b.layer("kv", 1)["k"]
    assert k0.shape == (5, 16, 2, 32) and k0.untyped_storage().data_ptr() == k1.untyped_storage().data_ptr()
    _store(a, gpu)
    _store(b, npu)
    for layer in (0, 1):
        assert all(torch.equal(a.layer("kv", layer)[n], b.layer("kv", layer)[n]) for n in ("k", "v"))
    with pytest.raises(KernelUnavailable, match="torch backend only"):
        npu.build("cpu", backend="triton")


def test_ascend_mla_keeps_nope_and_rope_apart():
    p = plan(TINY["mla"], target="npu")
    k, v = p.pool("kv").buffers
    assert (k.shape, v.shape) == ((5, 16, 1, 128), (5, 16, 1, 16)) and p.pool("kv").op == "store_kv"
    assert p.cell_size_bytes == plan(TINY["mla"]).cell_size_bytes
    pool = p.build("cpu")
    loc = torch.tensor([17, -1, 40])
    kv_c, k_pe = pool.sample_inputs(1, 3, torch.Generator().manual_seed(2))
    pool.store(1, loc, kv_c, k_pe)
    buf = pool.layer("kv", 1)
    assert torch.equal(buf["k"][1, 1, 0], kv_c[0]) and torch.equal(buf["v"][2, 8, 0], k_pe[2])
    with pytest.raises(TypeError, match="no scales"):
        pool.store(1, loc, kv_c, k_pe, scale=torch.ones(()))


def test_ascend_swa_and_state_layouts():
    p = plan(TINY["swa_hybrid"], target="npu", max_total_num_tokens=64)
    assert [s.name for s in p.pools] == ["full", "swa"] and all(b.stacked for b in p.pool("swa").buffers if b.per_layer)
    pool = p.build("cpu")
    pool.map_swa(torch.arange(16, 32), torch.arange(16, 32))
    k, v = pool.sample_inputs(0, 2, torch.Generator().manual_seed(3))
    pool.store(0, torch.tensor([16, 20]), k, v)
    assert torch.equal(pool.layer("swa", 0)["k"][1, 4], k[1])
    conv = plan(HYBRID, target="npu", max_running_requests=2).state_pool().buffers[0]
    assert conv.shape == (3, 3, 96) and conv.stacked           # window-major, as SGLang's NPU Mamba pool


def test_ascend_refusals_are_named():
    with pytest.raises(UnsupportedCombination, match="kv_cache_dtype='auto'"):
        plan(TINY["mha"], target="npu", kv_cache_dtype="fp8_e4m3")
    with pytest.raises(UnsupportedCombination, match="Ascend"):
        plan(TINY["dsa"], target="npu")
    with pytest.raises(ConfigError, match="target must be one of"):
        plan(TINY["mha"], target="tpu")
