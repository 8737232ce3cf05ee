"""`engine=` decides the layout: the model as SGLang's / vLLM's code lays it out, refused where the
engine has none (each refusal naming the engine's rule), and a plan is built only into its own
engine's adapters. Figures: SGLang 0.5.23's sizing at 20 GiB per rank (bench/peers/
sglang_configurator.py runs its own code on the same configs)."""
from __future__ import annotations

import pytest

from helpers import BACKENDS
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


def _gemma4(**text):
    base = dict(model_type="gemma4_text", hidden_size=2304, num_hidden_layers=30, num_attention_heads=8,
                num_key_value_heads=4, head_dim=256, global_head_dim=512, sliding_window=512)
    return ModelSpec.from_hf_config(dict(architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4",
                                         torch_dtype="bfloat16", text_config={**base, **text}), reader="own")


def test_gemma4_full_layers_have_their_own_heads_and_sharing_layers_store_nothing():
    """K reused as V (attention_k_eq_v): the full layers take num_global_key_value_heads of
    global_head_dim; the last 12 layers reuse layer 16's / 17's KV. SGLang allocates every layer
    (the shared ones unused): 5 x 2 x 512 x 2 x 2 + 0.8 x 25 x 4 x 256 x 2 x 2 = 102,400 B a token
    (its own KVCacheConfigurator: bench/results/peers/sglang-configurator.md); kvwrite's layout
    gives a shared layer its source's buffers: 3 full + 15 sliding copies."""
    spec = _gemma4(num_kv_shared_layers=12, attention_k_eq_v=True, num_global_key_value_heads=2)
    assert spec.kv_source(25) == 16 and spec.kv_source(29) == 17 and spec.kv_source(17) is None
    sg = KVCacheConfigurator(spec, memory_bytes=20 * GiB, page_size=1, engine="sglang").plan()
    assert sg.cell_size_bytes == 5 * 2 * 512 * 4 + 0.8 * 25 * 4 * 256 * 4 == 102_400
    assert sg.max_total_num_tokens == 209_715
    assert sg.pool("full").buffers[0].shape[-2:] == (2, 512) and sg.pool("swa").buffers[0].shape[-2:] == (4, 256)
    own = KVCacheConfigurator(spec, max_total_num_tokens=2048, page_size=16, swa_full_tokens_ratio=0.5).plan()
    assert [p.spec.num_buffers for p in own.pools] == [3, 15]
    assert own.cell_size_bytes == 3 * 2 * 512 * 4 + 0.5 * 15 * 4 * 256 * 4
    import torch
    from kvwrite.config import LayerHasNoKV
    pool = own.build("cpu", check="guard", backend="torch")
    k = torch.ones(1, 2, 512, dtype=torch.bfloat16)
    pool.map_swa(torch.arange(64), torch.arange(64))   # full locs 0-63 -> SWA rows 0-63
    pool.store(17, torch.tensor([3]), k, k)          # K reused as V: the V argument from K
    pool.errors.raise_if_any()
    assert torch.equal(pool.layer("full", 29)["v"].reshape(-1, 2, 512)[3], k[0])   # layer 29 reads 17's
    with pytest.raises(LayerHasNoKV, match="layer 29 reuses layer 17's KV"):
        pool.store(29, torch.tensor([3]), k, k)


def test_gemma3n_is_one_pool_under_sglang_and_shares_layers_in_kvwrite():
    """SGLang turns hybrid SWA off for Gemma 3n and allocates all 35 layers: 35 x 2 x 256 x 2 x 2 =
    71,680 B a token, 299,593 tokens in 20 GiB (its own code gives the same); vLLM and kvwrite
    give the 15 KV-shared layers no memory of their own."""
    cfg = dict(architectures=["Gemma3nForConditionalGeneration"], model_type="gemma3n", torch_dtype="bfloat16",
               text_config=dict(model_type="gemma3n_text", hidden_size=2048, num_hidden_layers=35,
                                num_attention_heads=8, num_key_value_heads=2, head_dim=256, sliding_window=512,
                                num_kv_shared_layers=15))
    spec = ModelSpec.from_hf_config(cfg, reader="own")
    assert spec.kv_source(20) == 18 and spec.kv_source(24) == 19   # sliding / full sources (SGLang's rule)
    sg = KVCacheConfigurator(spec, memory_bytes=20 * GiB, page_size=1, engine="sglang").plan()
    assert (sg.variant, sg.cell_size_bytes, sg.max_total_num_tokens) == ("mha", 35 * 2048, 299_593)
    vl = KVCacheConfigurator(spec, memory_bytes=20 * GiB, page_size=1, engine="vllm").plan()
    # vLLM: 16 sliding + 4 full layers with a cache -> group size 4 (16 >= 1.5 x 4): 5 groups, 4 tensors
    assert vl.variant == "swa_grouped" and vl.pool("kv").spec.num_buffers == 4
    assert vl.max_total_num_tokens + 1 == 20 * GiB // (4 * 2048)


def test_gemma4_under_vllm_unifies_page_sizes_by_block_size():
    """vLLM 0.32 (kv_cache_utils.unify_kv_cache_spec_page_size): a full layer's page at 64 tokens is
    4 heads x 512 x K+V x 2 B x 64 = 524,288 B, a sliding layer's 262,144 B, so the sliding layers
    take 128-token blocks. 25 sliding + 5 full layers -> group size 5: a block costs 5 x 524,288 =
    2,621,440 B (40,960 B a 64-token page's token); 20 GiB // that = 8,192 blocks, block 0 the null
    block (vLLM's own get_kv_cache_config_from_groups: 8,192, bench/results/peers/vllm-configurator.md)."""
    spec = _gemma4(num_kv_shared_layers=0, attention_k_eq_v=False)
    plan = KVCacheConfigurator(spec, memory_bytes=20 * GiB, page_size=64, engine="vllm").plan()
    full, swa = plan.pool("full"), plan.pool("swa")
    assert plan.variant == "swa_grouped" and "unify_kv_cache_spec_page_size" in plan.engine_notes[0]
    assert (full.geometry.page_size, swa.geometry.page_size) == (64, 128)
    assert full.geometry.num_pages == swa.geometry.num_pages == 8_192
    assert full.buffers[0].shape == (8_192, 64, 4, 512) and swa.buffers[0].shape == (8_192, 128, 4, 256)
    assert plan.cell_size_bytes == 5 * 524_288 // 64 == 40_960
    assert plan.max_total_num_tokens == 8_191 * 64 and plan.kv_bytes == 20 * GiB
    assert swa.spec.alias == "full" and swa.bytes == 0 and swa.space.name == "swa_x2"
    assert swa.space.page_size == 128 and swa.space.num_locs == 8_192 * 128


def test_gemma4_31b_shape_under_vllm_gives_the_full_layers_the_larger_block():
    """16 sliding KV heads, 4 global (K = V): a sliding layer's 64-token page is 16 x 256 x 2 x 2 B x 64
    = 1,048,576 B, a full layer's 4 x 512 x 2 x 2 B x 64 = 524,288 B, so the full layers take 128-token
    blocks. 50 sliding + 10 full -> group size 10: 10 x 1,048,576 B a block, 2,048 blocks in 20 GiB
    (vLLM's own figure for the same config: bench/results/peers/vllm-configurator.md)."""
    spec = _gemma4(num_hidden_layers=60, num_attention_heads=32, num_key_value_heads=16, num_global_key_value_heads=4,
                   attention_k_eq_v=True, sliding_window=1024, num_kv_shared_layers=0)
    plan = KVCacheConfigurator(spec, memory_bytes=20 * GiB, page_size=64, engine="vllm").plan()
    full, swa = plan.pool("full"), plan.pool("swa")
    assert (full.geometry.page_size, swa.geometry.page_size) == (128, 64)
    assert full.space.name == "full_x2" and swa.space.name == "full" and swa.spec.alias == "full"
    assert plan.cell_size_bytes == 10 * 1_048_576 // 64 and full.geometry.num_pages == 2_048
    assert plan.kv_bytes == 20 * GiB and full.buffers[0].shape == (2_048, 128, 4, 512)


def test_gemma4_k_eq_v_under_vllm_stores_k_as_v_into_shared_memory():
    """K reused as V, 2 global KV heads: a full layer's token is 2 x 512 x 2 x 2 B = 4,096 B, a
    sliding layer's 4 x 256 x 2 x 2 B = 4,096 B: one block size. 15 sliding + 3 full layers with a
    cache (12 KV-shared) -> group size 3: 3 x 4,096 = 12,288 B a token, 20 GiB // (12,288 x 64) =
    27,306 blocks (vLLM's own figure). Sliding layer 0 and full layer 5 are both first in their
    groups: the same bytes, each read with its own shape."""
    import torch

    spec = _gemma4(num_kv_shared_layers=12, attention_k_eq_v=True, num_global_key_value_heads=2)
    big = KVCacheConfigurator(spec, memory_bytes=20 * GiB, page_size=64, engine="vllm").plan()
    assert big.cell_size_bytes == 3 * 4_096 and big.max_total_num_tokens == (27_306 - 1) * 64
    plan = KVCacheConfigurator(spec, max_total_num_tokens=64, page_size=16, engine="vllm").plan()
    full, swa = plan.pool("full"), plan.pool("swa")
    assert (full.geometry.page_size, swa.geometry.page_size) == (16, 16)
    assert full.spec.slot(full.layer_ids.index(5)) == swa.spec.slot(swa.layer_ids.index(0)) == 0
    pool = plan.build("cpu", check="guard", backend="torch", engine="vllm")
    assert pool.nbytes == plan.total_bytes == 3 * 5 * 16 * 4_096
    k = torch.randn(1, 2, 512).to(torch.bfloat16)
    pool.store(5, torch.tensor([3]), k, k)          # K reused as V
    pool.errors.raise_if_any()
    assert torch.equal(pool.layer("full", 5)["v"].reshape(-1, 2, 512)[3], k[0])
    assert pool.layer("full", 29)["k"] is pool.layer("full", 17)["k"]   # KV-shared layer 29 reads 17's copy
    row = pool.layer("swa", 0)["k"].reshape(-1, 4, 256)[3]    # the same 2 KiB, as 4 x 256
    assert torch.equal(row.reshape(-1), k[0].reshape(-1))
    pool.store(0, torch.tensor([swa.geometry.capacity]), row[None], row[None])   # past the sliding blocks
    with pytest.raises(Exception, match="capacity"):
        pool.errors.raise_if_any()


def test_vllm_layouts_kvwrite_does_not_plan_are_refused():
    with pytest.raises(UnsupportedCombination, match="does not plan vLLM's layout of variant"):
        KVCacheConfigurator(ModelSpec.from_preset("deepseek-v4-flash"), memory_bytes=20 * GiB,
                            max_running_requests=8, engine="vllm")


@pytest.mark.parametrize("tp, page, block, state", [(1, 64, 576, 1_097_728), (1, 1, 544, 1_097_728),
                                                     (8, 64, 192, 137_216), (8, 1, 144, 137_216)])
def test_vllm_keeps_qwen3_next_gdn_states_in_kv_blocks(tp, page, block, state):
    """Qwen3-Next under vLLM 0.32: a GDN layer's state is conv 3 x 8,192/tp + recurrent 32/tp x 128 x
    128 values, bf16 (1,097,728 B at tp 1); an attention token 2/tp KV heads (at least 1) x 256 x 2
    x 2 B (2,048 B at tp 1). The block grows in multiples of max(16, page) until a page holds a state
    (tp 1, page 64: 64 x ceil(1,097,728 / (64 x 2,048)) = 576 tokens, 1,179,648 B pages); 36 GDN +
    12 attention layers -> 4 groups of 12: a block costs 12 pages, 20 GiB // (12 x 1,179,648) = 1,517
    blocks (vLLM's own _align_hybrid_block_size and get_kv_cache_config_from_groups give the same:
    bench/results/peers/vllm-configurator.md)."""
    plan = KVCacheConfigurator(ModelSpec.from_preset("qwen3-next-80b-a3b"), ParallelSpec(tp), page_size=page,
                               memory_bytes=20 * GiB, engine="vllm").plan()
    attn = max(1, 2 // tp) * 256 * 2 * 2
    kv, st = plan.pool("kv"), plan.pool("state")
    assert plan.variant == "linear_grouped" and plan.page_size == block and f"from {page} to {block}" in plan.engine_notes[0]
    assert kv.spec.num_buffers == st.spec.num_buffers == 12 and plan.state_pools == () and plan.fixed_bytes == 0
    assert plan.cell_size_bytes == 12 * attn and st.bytes == 0 and st.spec.alias == "kv"
    assert sum(b.bytes for b in st.buffers) // st.geometry.num_pages == state <= block * attn
    blocks = 20 * GiB // (12 * block * attn)
    assert kv.geometry.num_pages == blocks and plan.max_total_num_tokens == (blocks - 1) * block
    if (tp, page) == (1, 64):
        assert blocks == 1_517


@pytest.mark.parametrize("backend", ["torch", *BACKENDS])
def test_vllm_gdn_layout_stores_k_v_and_shares_blocks_with_the_states(backend):
    """A block is K | V of one attention layer or one GDN layer's state (the rest padding), in the
    same block-major copy: attention layer 3 and GDN layer 0 are both first in their groups. The
    K / V caches are strided by the page (every backend, the C++ fast path on the second call)."""
    import torch

    plan = KVCacheConfigurator(ModelSpec.from_preset("qwen3-next-80b-a3b"), ParallelSpec(8), page_size=64,
                               max_total_num_tokens=4 * 192, engine="vllm").plan()
    pool = plan.build("cpu", check="guard", backend=backend, engine="vllm")
    assert pool.nbytes == plan.total_bytes == 12 * 5 * 192 * 1024
    k = torch.randn(2, 1, 256).to(torch.bfloat16)
    for _ in range(2):
        pool.store(3, torch.tensor([5, 200]), k, k + 1)
        pool.errors.raise_if_any()
    kc, vc = pool.layer("kv", 3)["k"], pool.layer("kv", 3)["v"]
    assert torch.equal(kc[0, 5], k[0]) and torch.equal(vc[1, 8], k[1] + 1)
    conv = pool.state(0)["conv"]                            # [blocks, 3, 1024]: block 1's first bytes are K
    assert conv.shape == (5, 3, 1024) and pool.state(0)["ssm"].shape == (5, 4, 128, 128)
    assert torch.equal(conv[1].reshape(-1)[8 * 256:9 * 256], k[1, 0])   # block 1, token 8 of layer 3's K
    with pytest.raises(Exception, match="linear-attention layer"):
        pool.store(0, torch.tensor([1]), k[:1], k[:1])
    pool.store(3, torch.tensor([5 * 192]), k[:1], k[:1])   # past the blocks
    with pytest.raises(Exception, match="capacity"):
        pool.errors.raise_if_any()


def test_vllm_dsa_under_dcp_shards_the_indexer_cache_and_the_model_table_says_so():
    """vLLM shards the DSA indexer cache over the DCP ranks like the MLA cache: a rank's token costs
    (576 x 2 + 132) x 61 = 78,324 B at dcp 2 as at dcp 1 (20 GiB // (78,324 x 64) = 4,284 blocks, vLLM's
    own figure); kvwrite's indexer store translates the virtual loc to the rank's row."""
    import torch

    from kvwrite.config.modeltypes import table
    from kvwrite.reference.indexer_k import read_indexer_k

    d = ModelSpec.from_preset("deepseek-v3.2")
    plan = KVCacheConfigurator(d, ParallelSpec(8, 2, dcp_rank=1), memory_bytes=20 * GiB, engine="vllm").plan()
    one = KVCacheConfigurator(d, ParallelSpec(8, 1), memory_bytes=20 * GiB, engine="vllm").plan()
    assert plan.cell_size_bytes == one.cell_size_bytes == (576 * 2 + 132) * 61
    assert plan.max_total_num_tokens == one.max_total_num_tokens == (4_284 - 1) * 64
    assert [p.addressing for p in plan.pools] == ["sharded", "sharded"] and "dcp_sharded" in plan.engine_notes[0]
    small = KVCacheConfigurator(d.replace(num_layers=1), ParallelSpec(8, 2, dcp_rank=1), max_total_num_tokens=128,
                                engine="vllm").plan()
    pool = small.build("cpu", check="guard", backend="torch", engine="vllm")
    kv_c, k_pe, index_k = pool.sample_inputs(0, 2, torch.Generator().manual_seed(0))
    pool.store(0, torch.tensor([7, 8]), kv_c, k_pe, index_k)   # 7 is rank 1's row 3; 8 rank 0's
    pool.errors.raise_if_any()
    cache = pool.layer("indexer", 0)["index_k"]
    got = read_indexer_k(cache, torch.tensor([3, 4]), 128)
    assert torch.allclose(got[0], index_k[0].float(), rtol=0.07, atol=1e-3) and not got[1].any()
    assert torch.equal(pool.layer("kv", 0)["kv"].reshape(-1, 576)[3, :512], kv_c[0])
    rows = {line.split(" | ")[0].strip("| "): line for line in table().splitlines()[2:]}
    assert "one full pool (hybrid SWA memory off)" in rows["gemma3"]
    assert "full + SWA pools" in rows["gpt_oss"] and "indexer cache DCP-sharded" in rows["deepseek_v32"]


def test_vllm_has_no_draft_worker_pools():
    with pytest.raises(UnsupportedCombination, match="_annotate_eagle_groups"):
        KVCacheConfigurator(ModelSpec.from_preset("deepseek-v3"), ParallelSpec(8, 1, is_draft_worker=True),
                            memory_bytes=GiB, engine="vllm")
