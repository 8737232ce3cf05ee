"""`engine=` decides the layout: the model as SGLang's / vLLM's code lays it out, refused where the
engine has none (each refusal naming the engine's rule), and a plan is built only into its own
engine's adapters. Figures: SGLang 0.5.23's sizing at 20 GiB per rank (bench/peers/
sglang_configurator.py runs its own code on the same configs)."""
from __future__ import annotations

import pytest

from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec
from kvwrite.config import EngineMismatch, UnsupportedCombination

GiB = 2**30


def _hf(model_type, arch, **fields):
    base = dict(model_type=model_type, architectures=[arch], hidden_size=4096, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, num_hidden_layers=12, torch_dtype="bfloat16")
    return ModelSpec.from_hf_config({**base, **fields}, reader="own")


SLIDING = {
    "cohere2": _hf("cohere2", "Cohere2ForCausalLM", sliding_window=4096, sliding_window_pattern=4),
    "exaone4": _hf("exaone4", "Exaone4ForCausalLM", sliding_window=4096, sliding_window_pattern="LLLG"),
    "gemma2": _hf("gemma2", "Gemma2ForCausalLM", sliding_window=4096),
    "llama4_text": _hf("llama4_text", "Llama4ForCausalLM", attention_chunk_size=8192),
}


def test_gemma3_is_one_full_pool_under_sglang():
    g = ModelSpec.from_preset("gemma-3-27b")
    sg = KVCacheConfigurator(g, memory_bytes=20 * GiB, engine="sglang").plan()
    own = KVCacheConfigurator(g, memory_bytes=20 * GiB).plan()
    assert (sg.variant, sg.engine, [p.name for p in sg.pools]) == ("mha", "sglang", ["kv"])
    assert sg.pools[0].layer_ids == tuple(range(62)) and "loc_map" not in sg.pools[0].kernel
    # 16 heads x (128 + 128) x 62 layers x 2 B = 507,904 B a token; 20 GiB // that, in 64-token pages
    assert sg.cell_size_bytes == 16 * 256 * 62 * 2 and sg.max_total_num_tokens == 42_240
    assert "disable_hybrid_swa_memory" in sg.engine_notes[0]
    assert (own.variant, own.engine, own.max_total_num_tokens) == ("swa_hybrid", "kvwrite", 50_752)


@pytest.mark.parametrize("name", sorted(SLIDING))
def test_sliding_models_sglang_does_not_split(name):
    spec = SLIDING[name]
    assert spec.variant == "swa_hybrid"
    plan = KVCacheConfigurator(spec, memory_bytes=GiB, engine="sglang").plan()
    assert plan.variant == "mha" and plan.pools[0].layer_ids == tuple(range(12))
    assert spec.architecture in plan.engine_notes[0]


def test_sglang_keeps_the_swa_pools_where_its_code_has_them():
    for spec in (ModelSpec.from_preset("gpt-oss-120b"),
                 _hf("llama4", "Llama4ForConditionalGeneration", text_config=dict(
                     num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     attention_chunk_size=8192))):
        plan = KVCacheConfigurator(spec, memory_bytes=GiB, engine="sglang").plan()
        assert plan.variant == "swa_hybrid" and [p.name for p in plan.pools] == ["full", "swa"]
        assert plan.engine_notes == ()


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_fp8_dsa_is_the_ds_mla_row(engine):
    d = ModelSpec.from_preset("deepseek-v3.2")
    plan = KVCacheConfigurator(d, memory_bytes=20 * GiB, kv_cache_dtype="fp8_e4m3", engine=engine).plan()
    assert plan.kv_cache_dtype == "fp8_ds_mla"
    assert plan.pool("kv").buffers[0].shape[-1] == 656
    # (656 + 132) x 61 = 48,068 B a token -> 446,720 tokens (SGLang's figure; raw 576-byte rows gave 497,216);
    # vLLM allocates 20 GiB // (48,068 x 64) = 6,980 blocks, block 0 its null block: 6,979 pages usable
    assert plan.cell_size_bytes == (656 + 132) * 61
    assert plan.max_total_num_tokens == (446_720 if engine == "sglang" else 6_979 * 64)
    assert "656" in plan.engine_notes[0]
    raw = KVCacheConfigurator(d, memory_bytes=20 * GiB, kv_cache_dtype="fp8_e4m3").plan()
    assert raw.kv_cache_dtype == "fp8_e4m3" and raw.max_total_num_tokens == 497_216


@pytest.mark.parametrize("case, engine, words", [
    (dict(preset="gpt-oss-120b", parallel=ParallelSpec(8, 2)), "sglang", "logical_token_capacity"),
    (dict(preset="deepseek-v3.2", page_size=16), "sglang", "deepseek_v2.py"),
    (dict(preset="deepseek-v3", parallel=ParallelSpec(1, 4)), "sglang", "parallel_hook.py"),
    (dict(preset="deepseek-v3", parallel=ParallelSpec(1, 4)), "vllm", "config/parallel.py"),
])
def test_refusals_name_the_engine_rule(case, engine, words):
    case = dict(case)
    spec = ModelSpec.from_preset(case.pop("preset"))
    with pytest.raises(UnsupportedCombination, match=words) as err:
        KVCacheConfigurator(spec, memory_bytes=20 * GiB, engine=engine, **case).plan()
    assert f"engine={engine!r}" in str(err.value)
    KVCacheConfigurator(spec, memory_bytes=20 * GiB, engine="kvwrite", **case).plan()   # kvwrite's own layout


def test_a_plan_is_built_only_into_its_engines_adapters():
    plan = KVCacheConfigurator(ModelSpec("mha", 2, num_kv_heads=2, head_dim=32), max_total_num_tokens=64,
                               page_size=16, engine="sglang").plan()
    assert plan.to_dict()["engine"] == "sglang"
    plan.require_engine("sglang")
    with pytest.raises(EngineMismatch, match="sglang's layout.*vllm's adapters.*engine='vllm'"):
        plan.require_engine("vllm")
    with pytest.raises(EngineMismatch):
        plan.build("cpu", engine="vllm")
    assert plan.build("cpu", engine="sglang").plan is plan


def test_engine_argument_sets_the_parallel_engine():
    c = KVCacheConfigurator(ModelSpec("mha", 2, num_kv_heads=2, head_dim=32), ParallelSpec(8, 2),
                            max_total_num_tokens=64, engine="vllm")
    assert c.parallel.engine == "vllm" and c.plan().parallel.engine == "vllm"
    assert "engine='vllm'" in repr(c)


def test_vllm_groups_sliding_layers_and_shares_their_tensors():
    """gemma-3-27b under vLLM: 52 sliding + 10 full layers -> group size 10, 6 sliding groups and
    1 full group over one block pool; 10 tensors (one per position in a group), so a block costs
    10 layers' pages: 20 GiB // (10 x 16 x 256 x 2 B) = 262,144 one-token blocks (vLLM's own
    get_kv_cache_config_from_groups gives the same: bench/results/peers/vllm-configurator.md)."""
    g = ModelSpec.from_preset("gemma-3-27b")
    plan = KVCacheConfigurator(g, memory_bytes=20 * GiB, page_size=1, engine="vllm").plan()
    kv = plan.pool("kv")
    assert plan.variant == "swa_grouped" and len(plan.pools) == 1 and kv.layer_ids == tuple(range(62))
    assert kv.spec.num_buffers == 10 and "7 groups of 10" in plan.engine_notes[0]
    assert plan.max_total_num_tokens + 1 == 262_144 and plan.kv_bytes == 20 * GiB
    full = [i for i in range(62) if (i + 1) % 6 == 0]
    assert sorted(kv.spec.slot(i) for i in full) == list(range(10))   # the full group uses every tensor once


def test_grouped_layers_store_into_their_shared_tensor():
    import torch

    spec = ModelSpec("swa_hybrid", 6, num_kv_heads=1, head_dim=16, sliding_window=8,
                     swa_layer_ids=[0, 1, 3, 4], full_attention_layer_ids=[2, 5], dtype="float32")
    plan = KVCacheConfigurator(spec, max_total_num_tokens=32, page_size=4, engine="vllm").plan()
    kv = plan.pool("kv")
    assert kv.spec.num_buffers == 2 and kv.to_dict()["buffer_slots"] == [kv.spec.slot(i) for i in range(6)]
    pool = plan.build("cpu", check="guard", backend="torch", engine="vllm")
    k = torch.arange(16, dtype=torch.float32).reshape(1, 1, 16)
    pool.store(2, torch.tensor([5]), k, k + 100)
    pool.errors.raise_if_any()
    partner = next(i for i in (0, 1, 3, 4) if kv.spec.slot(i) == kv.spec.slot(2))
    assert torch.equal(pool.layer("kv", partner)["k"].reshape(-1, 16)[5], k[0, 0])   # the same memory
    other = next(i for i in range(6) if kv.spec.slot(i) != kv.spec.slot(2))
    assert not pool.layer("kv", other)["k"].reshape(-1, 16)[5].eq(k[0, 0]).all()
