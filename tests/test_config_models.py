"""from_hf_config for the model types people serve. Each fixture holds the
published config.json fields (that matter for the KV cache) of one real model, named; each test
states the bytes per token worked out by hand (bf16 = 2 bytes; K and V; kv_heads x head_dim)."""
from __future__ import annotations

import pytest

from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec

# model_type -> (Hugging Face repo, config.json fields)
FIXTURES = {
    "llama": ("meta-llama/Llama-3.1-8B-Instruct", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=32, torch_dtype="bfloat16")),
    "mistral": ("mistralai/Mistral-Nemo-Instruct-2407", dict(
        architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=5120, head_dim=128,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=40, sliding_window=None,
        torch_dtype="bfloat16")),
    "mixtral": ("mistralai/Mixtral-8x7B-Instruct-v0.1", dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=32, sliding_window=None, torch_dtype="bfloat16")),
    "qwen2": ("Qwen/Qwen2.5-7B-Instruct", dict(
        architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, num_attention_heads=28,
        num_key_value_heads=4, num_hidden_layers=28, sliding_window=131072, use_sliding_window=False,
        max_window_layers=28, torch_dtype="bfloat16")),
    "qwen2_moe": ("Qwen/Qwen1.5-MoE-A2.7B", dict(
        architectures=["Qwen2MoeForCausalLM"], model_type="qwen2_moe", hidden_size=2048, num_attention_heads=16,
        num_key_value_heads=16, num_hidden_layers=24, torch_dtype="bfloat16")),
    "qwen3": ("Qwen/Qwen3-8B", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, head_dim=128,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36, torch_dtype="bfloat16")),
    "qwen3_moe": ("Qwen/Qwen3-30B-A3B", dict(
        architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", hidden_size=2048, head_dim=128,
        num_attention_heads=32, num_key_value_heads=4, num_hidden_layers=48, torch_dtype="bfloat16")),
    "phi3": ("microsoft/Phi-3-mini-4k-instruct", dict(
        architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, num_attention_heads=32,
        num_key_value_heads=32, num_hidden_layers=32, sliding_window=2047, torch_dtype="bfloat16")),
    "glm4_moe": ("zai-org/GLM-4.5-Air", dict(
        architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", hidden_size=4096, head_dim=128,
        num_attention_heads=96, num_key_value_heads=8, num_hidden_layers=46, num_nextn_predict_layers=1,
        torch_dtype="bfloat16")),
    "deepseek_v2": ("deepseek-ai/DeepSeek-V2-Lite", dict(
        architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=27,
        num_attention_heads=16, kv_lora_rank=512, qk_rope_head_dim=64, torch_dtype="bfloat16")),
    "deepseek_v3": ("deepseek-ai/DeepSeek-V3", dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=61,
        num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, num_nextn_predict_layers=1,
        torch_dtype="bfloat16")),
    "kimi_k2": ("moonshotai/Kimi-K2-Instruct", dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2", num_hidden_layers=61,
        num_attention_heads=64, kv_lora_rank=512, qk_rope_head_dim=64, num_nextn_predict_layers=0,
        torch_dtype="bfloat16")),
    "deepseek_v32": ("deepseek-ai/DeepSeek-V3.2-Exp", dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_hidden_layers=61,
        kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, num_nextn_predict_layers=1,
        torch_dtype="bfloat16")),
    "gpt_oss": ("openai/gpt-oss-20b", dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, head_dim=64,
        num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=24, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 12, torch_dtype="bfloat16")),
    "gemma2": ("google/gemma-2-27b-it", dict(
        architectures=["Gemma2ForCausalLM"], model_type="gemma2", hidden_size=4608, head_dim=128,
        num_attention_heads=32, num_key_value_heads=16, num_hidden_layers=46, sliding_window=4096,
        torch_dtype="bfloat16")),
    "gemma3": ("google/gemma-3-12b-it", dict(
        architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", torch_dtype="bfloat16",
        text_config=dict(model_type="gemma3_text", hidden_size=3840, head_dim=256, num_attention_heads=16,
                         num_key_value_heads=8, num_hidden_layers=48, sliding_window=1024,
                         sliding_window_pattern=6))),
    "llama4": ("meta-llama/Llama-4-Scout-17B-16E-Instruct", dict(
        architectures=["Llama4ForConditionalGeneration"], model_type="llama4", torch_dtype="bfloat16",
        text_config=dict(model_type="llama4_text", hidden_size=5120, head_dim=128, num_attention_heads=40,
                         num_key_value_heads=8, num_hidden_layers=48, attention_chunk_size=8192))),
    "qwen3_next": ("Qwen/Qwen3-Next-80B-A3B-Instruct", dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048, head_dim=256,
        num_attention_heads=16, num_key_value_heads=2, num_hidden_layers=48, full_attention_interval=4,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, torch_dtype="bfloat16")),
    "nemotron_h": ("nvidia/Nemotron-H-8B-Base-8K", dict(
        architectures=["NemotronHForCausalLM"], model_type="nemotron_h", hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, attention_head_dim=128, num_hidden_layers=52,
        hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
        mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, expand=2,
        torch_dtype="bfloat16")),
    "falcon_h1": ("tiiuae/Falcon-H1-0.5B-Instruct", dict(
        architectures=["FalconH1ForCausalLM"], model_type="falcon_h1", hidden_size=1024, head_dim=64,
        num_attention_heads=8, num_key_value_heads=2, num_hidden_layers=36, mamba_d_ssm=1536, mamba_n_heads=24,
        mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, torch_dtype="bfloat16")),
    "jamba": ("ai21labs/Jamba-v0.1", dict(
        architectures=["JambaForCausalLM"], model_type="jamba", hidden_size=4096, num_attention_heads=32,
        num_key_value_heads=8, num_hidden_layers=32, attn_layer_period=8, attn_layer_offset=4, mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, torch_dtype="bfloat16")),
    "minimax": ("MiniMaxAI/MiniMax-Text-01-hf", dict(
        architectures=["MiniMaxForCausalLM"], model_type="minimax", hidden_size=6144, head_dim=128,
        num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80,
        layer_types=(["linear_attention"] * 7 + ["full_attention"]) * 10, torch_dtype="bfloat16")),
}

# model_type -> (variant, KV layers, bytes per token by hand). SWA: full layers + 0.5 x SWA layers
# (swa_full_tokens_ratio=0.5) + 8 bytes of the int64 full->SWA loc map.
BYTES = {
    "llama": ("mha", 32, 8 * (128 + 128) * 32 * 2),
    "mistral": ("mha", 40, 8 * 256 * 40 * 2),                     # head_dim 128, not 5120 / 32
    "mixtral": ("mha", 32, 8 * 256 * 32 * 2),
    "qwen2": ("mha", 28, 4 * 256 * 28 * 2),                       # 3584 / 28 = 128
    "qwen2_moe": ("mha", 24, 16 * 256 * 24 * 2),                  # 2048 / 16 = 128
    "qwen3": ("mha", 36, 8 * 256 * 36 * 2),
    "qwen3_moe": ("mha", 48, 4 * 256 * 48 * 2),
    "phi3": ("mha", 32, 32 * (96 + 96) * 32 * 2),                 # 3072 / 32 = 96
    "glm4_moe": ("mha", 46, 8 * 256 * 46 * 2),
    "deepseek_v2": ("mla", 27, (512 + 64) * 27 * 2),
    "deepseek_v3": ("mla", 61, 576 * 61 * 2),
    "kimi_k2": ("mla", 61, 576 * 61 * 2),
    "deepseek_v32": ("dsa", 61, 576 * 61 * 2 + (128 + 4) * 61),  # + fp8 indexer K and its fp32 scale
    "gpt_oss": ("swa_hybrid", 24, 8 * 128 * 2 * (12 + 0.5 * 12) + 8),
    "gemma2": ("swa_hybrid", 46, 16 * 256 * 2 * (23 + 0.5 * 23) + 8),
    "gemma3": ("swa_hybrid", 48, 8 * 512 * 2 * (8 + 0.5 * 40) + 8),   # layers 5, 11, ..., 47 global
    "llama4": ("swa_hybrid", 48, 8 * 256 * 2 * (12 + 0.5 * 36) + 8),  # every 4th layer global
    "qwen3_next": ("hybrid_linear", 12, 2 * 512 * 12 * 2),
    "nemotron_h": ("hybrid_linear", 4, 8 * 256 * 4 * 2),
    "falcon_h1": ("hybrid_linear", 36, 2 * 128 * 36 * 2),
    "jamba": ("hybrid_linear", 4, 8 * 256 * 4 * 2),                  # layers 4, 12, 20, 28
    "minimax": ("hybrid_linear", 10, 8 * 256 * 10 * 2),
}

# recurrent state bytes per request slot and layer (tp=1), by hand
STATE = {
    "qwen3_next": ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4, 36),   # conv bf16 + ssm fp32
    "nemotron_h": ((128 * 64 + 2 * 8 * 128) * 3 * 2 + 128 * 64 * 128 * 4, 24),
    "falcon_h1": ((24 * 64 + 2 * 1 * 128) * 3 * 2 + 24 * 64 * 128 * 4, 36),
    "jamba": (8192 * 3 * 2 + 8192 * 16 * 4, 28),
    "minimax": (64 * 128 * 128 * 2, 70),                                            # model dtype, no conv
}


def test_every_issue_model_type_has_a_fixture():
    assert set(FIXTURES) == set(BYTES) and len(FIXTURES) == 22


@pytest.mark.parametrize("model_type", list(FIXTURES))
def test_bytes_per_token_by_hand(model_type):
    source, cfg = FIXTURES[model_type]
    spec = ModelSpec.from_hf_config(cfg, name=source)
    variant, kv_layers, cell = BYTES[model_type]
    assert (spec.variant, len(spec.kv_layer_ids)) == (variant, kv_layers), source
    kw = dict(max_running_requests=3) if model_type in STATE else {}
    c = KVCacheConfigurator(spec, page_size=16, max_total_num_tokens=32768, swa_full_tokens_ratio=0.5, **kw)
    assert c.cell_size_bytes == pytest.approx(cell), source
    plan = c.plan()
    if model_type in STATE:
        per_layer, layers = STATE[model_type]
        st = plan.state_pool()
        assert len(st.layer_ids) == layers and st.slots == 4
        assert plan.state_bytes == per_layer * layers * 4 and st.bytes_per_slot == per_layer * layers
    else:
        assert plan.state_pools == ()


def test_layer_maps():
    spec = lambda t: ModelSpec.from_hf_config(FIXTURES[t][1])  # noqa: E731
    assert spec("gemma2").swa_layer_ids == tuple(range(0, 46, 2))
    l4 = spec("llama4")
    assert l4.full_attention_layer_ids == tuple(range(3, 48, 4)) and l4.sliding_window == 8192
    assert spec("nemotron_h").full_attention_layer_ids == (7, 18, 29, 40)
    assert len(spec("nemotron_h").linear_layer_ids) == 24
    fh = spec("falcon_h1")
    assert fh.full_attention_layer_ids == fh.linear_layer_ids == tuple(range(36))
    assert spec("jamba").full_attention_layer_ids == (4, 12, 20, 28)
    assert spec("minimax").full_attention_layer_ids == tuple(range(7, 80, 8))


def test_mtp_draft_layers_for_the_draft_worker():
    spec = lambda t: ModelSpec.from_hf_config(FIXTURES[t][1])  # noqa: E731
    assert spec("glm4_moe").num_draft_layers == 1 and spec("kimi_k2").num_draft_layers == 1   # 0 MTP: EAGLE
    draft = KVCacheConfigurator(spec("glm4_moe"), ParallelSpec(is_draft_worker=True), page_size=16,
                                max_total_num_tokens=256).plan()
    assert draft.pool("kv").layer_ids == (0,) and draft.cell_size_bytes == 8 * 256 * 2
    dsv3 = ModelSpec.from_hf_config({**FIXTURES["deepseek_v3"][1], "num_nextn_predict_layers": 2})
    assert dsv3.draft().num_layers == 2
    # a hybrid model's MTP draft is plain attention: no recurrent state, so no max_running_requests
    d = KVCacheConfigurator(spec("qwen3_next"), ParallelSpec(is_draft_worker=True), page_size=16,
                            max_total_num_tokens=256).plan()
    assert d.variant == "mha" and d.state_pools == ()


def test_state_shapes_under_tp():
    qn = ModelSpec.from_hf_config(FIXTURES["qwen3_next"][1]).linear_state
    assert qn.shapes(2) == {"conv": ((2 * 16 * 128 + 32 * 128) // 2, 3), "ssm": (16, 128, 128)}
    fh = ModelSpec.from_hf_config(FIXTURES["falcon_h1"][1]).linear_state
    # n_groups=1 is replicated to tp=4 (one group per rank), as vLLM / SGLang shard it
    assert fh.shapes(4) == {"conv": ((24 * 64 + 2 * 4 * 128) // 4, 3), "ssm": (6, 64, 128)}
