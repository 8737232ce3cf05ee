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
# (swa_full_tokens_ratio=0.5); the int64 full->SWA loc map is overhead, not cell (as in SGLang).
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
    "gpt_oss": ("swa_hybrid", 24, 8 * 128 * 2 * (12 + 0.5 * 12)),
    "gemma2": ("swa_hybrid", 46, 16 * 256 * 2 * (23 + 0.5 * 23)),
    "gemma3": ("swa_hybrid", 48, 8 * 512 * 2 * (8 + 0.5 * 40)),   # layers 5, 11, ..., 47 global
    "llama4": ("swa_hybrid", 48, 8 * 256 * 2 * (12 + 0.5 * 36)),  # every 4th layer global
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


_L3G = ["sliding_attention"] * 3 + ["full_attention"]     # three sliding layers, then one global
_QN = ["linear_attention"] * 3 + ["full_attention"]

# More model types served today: the published config.json fields (of the named repo) that decide
# the KV cache. bf16 unless said; the bytes per token below are worked out by hand.
FIXTURES.update({
    "qwen3_5": ("Qwen/Qwen3.5-27B", dict(
        architectures=["Qwen3_5ForConditionalGeneration"], model_type="qwen3_5", torch_dtype="bfloat16",
        text_config=dict(model_type="qwen3_5_text", hidden_size=5120, num_hidden_layers=64, num_attention_heads=24,
                         num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         full_attention_interval=4, layer_types=_QN * 16))),
    "qwen3_5_moe": ("Qwen/Qwen3.5-35B-A3B", dict(
        architectures=["Qwen3_5MoeForConditionalGeneration"], model_type="qwen3_5_moe", torch_dtype="bfloat16",
        text_config=dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                         num_key_value_heads=2, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=32,
                         linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                         full_attention_interval=4, layer_types=_QN * 10))),
    "qwen2_vl": ("Qwen/Qwen2-VL-7B-Instruct", dict(
        architectures=["Qwen2VLForConditionalGeneration"], model_type="qwen2_vl", hidden_size=3584,
        num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, torch_dtype="bfloat16")),
    "qwen2_5_vl": ("Qwen/Qwen2.5-VL-7B-Instruct", dict(
        architectures=["Qwen2_5_VLForConditionalGeneration"], model_type="qwen2_5_vl", hidden_size=3584,
        num_attention_heads=28, num_key_value_heads=4, num_hidden_layers=28, torch_dtype="bfloat16")),
    "qwen3_vl": ("Qwen/Qwen3-VL-8B-Instruct", dict(
        architectures=["Qwen3VLForConditionalGeneration"], model_type="qwen3_vl",
        text_config=dict(model_type="qwen3_vl_text", hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, dtype="bfloat16"))),
    "minimax_m2": ("MiniMaxAI/MiniMax-M2", dict(
        architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", hidden_size=3072, num_hidden_layers=62,
        num_attention_heads=48, num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16")),
    "kimi_k25": ("moonshotai/Kimi-K2.5", dict(
        architectures=["KimiK25ForConditionalGeneration"], model_type="kimi_k25",
        text_config=dict(model_type="deepseek_v3", num_hidden_layers=61, num_attention_heads=64, kv_lora_rank=512,
                         qk_rope_head_dim=64, num_nextn_predict_layers=0, torch_dtype="bfloat16"))),
    "glm_moe_dsa": ("zai-org/GLM-5", dict(
        architectures=["GlmMoeDsaForCausalLM"], model_type="glm_moe_dsa", num_hidden_layers=78, num_attention_heads=64,
        kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128, num_nextn_predict_layers=1, dtype="bfloat16")),
    "glm4_moe_lite": ("zai-org/GLM-4.7-Flash", dict(
        architectures=["Glm4MoeLiteForCausalLM"], model_type="glm4_moe_lite", num_hidden_layers=47,
        num_attention_heads=20, kv_lora_rank=512, qk_rope_head_dim=64, num_nextn_predict_layers=1,
        dtype="bfloat16")),
    "mistral3": ("mistralai/Mistral-Small-3.1-24B-Instruct-2503", dict(
        architectures=["Mistral3ForConditionalGeneration"], model_type="mistral3", torch_dtype="bfloat16",
        text_config=dict(model_type="mistral", hidden_size=5120, num_hidden_layers=40, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, sliding_window=None))),
    "glm4": ("zai-org/GLM-4-9B-0414", dict(
        architectures=["Glm4ForCausalLM"], model_type="glm4", hidden_size=4096, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=2, head_dim=128, torch_dtype="bfloat16")),
    "glm4v": ("zai-org/GLM-4.1V-9B-Thinking", dict(
        architectures=["Glm4vForConditionalGeneration"], model_type="glm4v", torch_dtype="bfloat16",
        text_config=dict(model_type="glm4v_text", hidden_size=4096, num_hidden_layers=40, num_attention_heads=32,
                         num_key_value_heads=2))),
    "glm4v_moe": ("zai-org/GLM-4.5V", dict(
        architectures=["Glm4vMoeForConditionalGeneration"], model_type="glm4v_moe", torch_dtype="bfloat16",
        text_config=dict(model_type="glm4v_moe_text", hidden_size=4096, num_hidden_layers=46, num_attention_heads=96,
                         num_key_value_heads=8, head_dim=128))),
    "hunyuan_v1_dense": ("tencent/Hunyuan-7B-Instruct", dict(
        architectures=["HunYuanDenseV1ForCausalLM"], model_type="hunyuan_v1_dense", hidden_size=4096,
        num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16")),
    "ernie4_5": ("baidu/ERNIE-4.5-0.3B-PT", dict(
        architectures=["Ernie4_5ForCausalLM"], model_type="ernie4_5", hidden_size=1024, num_hidden_layers=18,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, torch_dtype="bfloat16")),
    "granitemoehybrid": ("ibm-granite/granite-4.0-h-small", dict(
        architectures=["GraniteMoeHybridForCausalLM"], model_type="granitemoehybrid", hidden_size=4096,
        num_hidden_layers=40, num_attention_heads=32, num_key_value_heads=8,
        layer_types=["attention" if i in (5, 15, 25, 35) else "mamba" for i in range(40)],
        mamba_n_heads=128, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_expand=2,
        torch_dtype="bfloat16")),
    "seed_oss": ("ByteDance-Seed/Seed-OSS-36B-Instruct", dict(
        architectures=["SeedOssForCausalLM"], model_type="seed_oss", hidden_size=5120, num_hidden_layers=64,
        num_attention_heads=80, num_key_value_heads=8, head_dim=128, torch_dtype="bfloat16")),
    "exaone4": ("LGAI-EXAONE/EXAONE-4.0-32B", dict(
        architectures=["Exaone4ForCausalLM"], model_type="exaone4", hidden_size=5120, num_hidden_layers=64,
        num_attention_heads=40, num_key_value_heads=8, head_dim=128, sliding_window=4096,
        sliding_window_pattern="LLLG", layer_types=_L3G * 16, torch_dtype="bfloat16")),
    "cohere2": ("CohereLabs/c4ai-command-r7b-12-2024", dict(
        architectures=["Cohere2ForCausalLM"], model_type="cohere2", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, sliding_window=4096, sliding_window_pattern=4,
        torch_dtype="bfloat16")),
    "mimo": ("XiaomiMiMo/MiMo-7B-RL", dict(
        architectures=["MiMoForCausalLM"], model_type="mimo", hidden_size=4096, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, num_nextn_predict_layers=1, torch_dtype="bfloat16")),
    "olmo2": ("allenai/OLMo-2-1124-7B", dict(
        architectures=["Olmo2ForCausalLM"], model_type="olmo2", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, torch_dtype="float32")),
    "olmo3": ("allenai/Olmo-3-7B-Instruct", dict(
        architectures=["Olmo3ForCausalLM"], model_type="olmo3", hidden_size=4096, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, sliding_window=4096, layer_types=_L3G * 8,
        torch_dtype="bfloat16")),
    "gemma": ("google/gemma-7b", dict(
        architectures=["GemmaForCausalLM"], model_type="gemma", hidden_size=3072, num_hidden_layers=28,
        num_attention_heads=16, num_key_value_heads=16, head_dim=256, torch_dtype="bfloat16")),
    "starcoder2": ("bigcode/starcoder2-7b", dict(
        architectures=["Starcoder2ForCausalLM"], model_type="starcoder2", hidden_size=4608, num_hidden_layers=32,
        num_attention_heads=36, num_key_value_heads=4, sliding_window=4096, torch_dtype="bfloat16")),
    "granite": ("ibm-granite/granite-3.3-8b-instruct", dict(
        architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=4096, num_hidden_layers=40,
        num_attention_heads=32, num_key_value_heads=8, torch_dtype="bfloat16")),
    "olmoe": ("allenai/OLMoE-1B-7B-0924", dict(
        architectures=["OlmoeForCausalLM"], model_type="olmoe", hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=16, num_key_value_heads=16, torch_dtype="bfloat16")),
    # transformers 5.25's Gemma4TextConfig / Gemma3nTextConfig defaults (its docs: "similar to
    # google/gemma-4-e2b-it" / "google/gemma-3n-E4B"), the fields spelled out
    "gemma4": ("google/gemma-4-e2b-it (transformers defaults)", dict(
        architectures=["Gemma4ForConditionalGeneration"], model_type="gemma4", torch_dtype="bfloat16",
        text_config=dict(model_type="gemma4_text", hidden_size=2304, num_hidden_layers=30, num_attention_heads=8,
                         num_key_value_heads=4, head_dim=256, global_head_dim=512, sliding_window=512,
                         num_kv_shared_layers=0, attention_k_eq_v=False))),
    "gemma3n": ("google/gemma-3n-E4B (transformers defaults)", dict(
        architectures=["Gemma3nForConditionalGeneration"], model_type="gemma3n", torch_dtype="bfloat16",
        text_config=dict(model_type="gemma3n_text", hidden_size=2048, num_hidden_layers=35, num_attention_heads=8,
                         num_key_value_heads=2, head_dim=256, sliding_window=512, num_kv_shared_layers=15))),
})
BYTES.update({
    # full layers 5, 11, .., 29: 4 heads x 512 (global_head_dim) x K+V x 2 B; 25 sliding: 4 x 256 x 2 x 2 B
    "gemma4": ("swa_hybrid", 30, 5 * 4 * 512 * 2 * 2 + 0.5 * 25 * 4 * 256 * 2 * 2),
    # layers 20-34 reuse layer 18's / 19's KV: 20 layers store, 4 full (4, 9, 14, 19) and 16 sliding
    "gemma3n": ("swa_hybrid", 35, 2 * 256 * 2 * 2 * (4 + 0.5 * 16)),
    "qwen3_5": ("hybrid_linear", 16, 4 * 512 * 16 * 2),
    "qwen3_5_moe": ("hybrid_linear", 10, 2 * 512 * 10 * 2),
    "qwen2_vl": ("mha", 28, 4 * 256 * 28 * 2),                  # 3584 / 28 = 128
    "qwen2_5_vl": ("mha", 28, 4 * 256 * 28 * 2),
    "qwen3_vl": ("mha", 36, 8 * 256 * 36 * 2),
    "minimax_m2": ("mha", 62, 8 * 256 * 62 * 2),
    "kimi_k25": ("mla", 61, 576 * 61 * 2),
    "glm_moe_dsa": ("dsa", 78, 576 * 78 * 2 + 132 * 78),
    "glm4_moe_lite": ("mla", 47, 576 * 47 * 2),
    "mistral3": ("mha", 40, 8 * 256 * 40 * 2),
    "glm4": ("mha", 40, 2 * 256 * 40 * 2),
    "glm4v": ("mha", 40, 2 * 256 * 40 * 2),                     # 4096 / 32 = 128
    "glm4v_moe": ("mha", 46, 8 * 256 * 46 * 2),
    "hunyuan_v1_dense": ("mha", 32, 8 * 256 * 32 * 2),
    "ernie4_5": ("mha", 18, 2 * 256 * 18 * 2),
    "granitemoehybrid": ("hybrid_linear", 4, 8 * 256 * 4 * 2),
    "seed_oss": ("mha", 64, 8 * 256 * 64 * 2),
    "exaone4": ("swa_hybrid", 64, 8 * 256 * 2 * (16 + 0.5 * 48)),  # LLLG: every 4th layer global
    "cohere2": ("swa_hybrid", 32, 8 * 256 * 2 * (8 + 0.5 * 24)),   # pattern 4
    "mimo": ("mha", 36, 8 * 256 * 36 * 2),
    "olmo2": ("mha", 32, 32 * 256 * 32 * 2),                    # float32 config: served float16
    "olmo3": ("swa_hybrid", 32, 32 * 256 * 2 * (8 + 0.5 * 24)),
    "gemma": ("mha", 28, 16 * 512 * 28 * 2),
    "starcoder2": ("mha", 32, 4 * 256 * 32 * 2),                # window on every layer: one full pool
    "granite": ("mha", 40, 8 * 256 * 40 * 2),
    "olmoe": ("mha", 16, 16 * 256 * 16 * 2),
})
STATE.update({
    "qwen3_5": ((2 * 16 * 128 + 48 * 128) * 3 * 2 + 48 * 128 * 128 * 4, 48),
    "qwen3_5_moe": ((2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4, 30),
    "granitemoehybrid": ((128 * 64 + 2 * 1 * 128) * 3 * 2 + 128 * 64 * 128 * 4, 36),
})


_LFM2_ATTN = (2, 5, 8, 10, 12, 14)
FIXTURES.update({
    "lfm2": ("LiquidAI/LFM2-1.2B", dict(
        architectures=["Lfm2ForCausalLM"], model_type="lfm2", hidden_size=2048, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, conv_L_cache=3,
        layer_types=["full_attention" if i in _LFM2_ATTN else "conv" for i in range(16)], torch_dtype="bfloat16")),
    "kimi_linear": ("moonshotai/Kimi-Linear-48B-A3B-Instruct", dict(
        architectures=["KimiLinearForCausalLM"], model_type="kimi_linear", hidden_size=2304, num_hidden_layers=27,
        num_attention_heads=32, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128,
        linear_attn_config=dict(full_attn_layers=[4, 8, 12, 16, 20, 24, 27],
                                kda_layers=[i for i in range(1, 28) if i not in (4, 8, 12, 16, 20, 24, 27)],
                                num_heads=32, head_dim=128, short_conv_kernel_size=4),
        torch_dtype="bfloat16")),
})
BYTES.update({
    "lfm2": ("hybrid_linear", 6, 8 * 128 * 6 * 2),                     # 2048 / 32 = 64
    "kimi_linear": ("mla_linear", 7, 576 * 7 * 2),                      # MLA on 7 of 27 layers
})
STATE.update({
    "lfm2": (2048 * 2 * 2, 10),                                          # conv [hidden, 3 - 1] bf16
    "kimi_linear": (3 * 32 * 128 * 3 * 2 + 32 * 128 * 128 * 4, 20),      # q/k/v convs bf16 + fp32 state
})


def test_every_issue_model_type_has_a_fixture():
    assert set(FIXTURES) == set(BYTES) and len(FIXTURES) == 22 + 30


@pytest.mark.parametrize("model_type", list(FIXTURES))
def test_bytes_per_token_by_hand(model_type):
    source, cfg = FIXTURES[model_type]
    spec = ModelSpec.from_hf_config(cfg, name=source)
    variant, kv_layers, cell = BYTES[model_type]
    assert (spec.variant, len(spec.kv_layer_ids)) == (variant, kv_layers), source
    assert spec.dtype in ("bfloat16", "float16"), source
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


def test_real_config_quirks():
    """gemma-3-12b's text_config has no head_dim (transformers fills 256, not 3840 / 16 = 240);
    gemma-3-4b's has no head counts (8 / 4 heads of 256); a float32 config is served in float16
    (TinyLlama: 22 layers x 4 KV heads x 64 x 2 x 2 B = 22,528 B a token)."""
    g12 = {**FIXTURES["gemma3"][1], "text_config": {k: v for k, v in FIXTURES["gemma3"][1]["text_config"].items()
                                                    if k != "head_dim"}}
    assert ModelSpec.from_hf_config(g12, reader="own").head_dim == 256
    g4 = dict(architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", torch_dtype="bfloat16",
              text_config=dict(model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34, sliding_window=1024))
    s4 = ModelSpec.from_hf_config(g4, name="google/gemma-3-4b-it", reader="own")
    assert (s4.num_kv_heads, s4.head_dim, len(s4.full_attention_layer_ids)) == (4, 256, 5)
    tiny = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=2048, num_hidden_layers=22,
                num_attention_heads=32, num_key_value_heads=4, torch_dtype="float32")   # TinyLlama-1.1B-Chat-v1.0
    t = ModelSpec.from_hf_config(tiny, reader="own")
    assert t.dtype == "float16"
    assert KVCacheConfigurator(t, max_total_num_tokens=4096).cell_size_bytes == 22_528


def test_transformers_5_resaved_layouts():
    """Nemotron-H re-saved with layers_block_type, DeepSeek V4 with layer_types + compress_rates,
    mamba_ssm_cache_dtype: the same spec as the original layout."""
    from kvwrite.config.presets import PRESETS
    nem = dict(FIXTURES["nemotron_h"][1])
    kinds = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}
    resaved = {**{k: v for k, v in nem.items() if k != "hybrid_override_pattern"},
               "layers_block_type": [kinds[c] for c in nem["hybrid_override_pattern"]],
               "mamba_ssm_cache_dtype": "bfloat16"}
    a, b = ModelSpec.from_hf_config(nem, reader="own"), ModelSpec.from_hf_config(resaved, reader="own")
    assert a.full_attention_layer_ids == b.full_attention_layer_ids and b.linear_state.ssm_dtype == "bfloat16"
    v4 = dict(PRESETS["deepseek-v4-flash"][1])
    names = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}
    n = v4["num_hidden_layers"]
    v4b = {**{k: v for k, v in v4.items() if k != "compress_ratios"},
           "layer_types": [names[r] for r in v4["compress_ratios"][:n]],
           "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}}
    assert ModelSpec.from_hf_config(v4b, reader="own") == ModelSpec.from_hf_config(v4, reader="own")


@pytest.mark.parametrize("model_type", list(FIXTURES))
def test_both_readers_agree(model_type):
    """With transformers installed (kvwrite[hf]), reading through its config classes gives the own
    reader's spec on every fixture."""
    pytest.importorskip("transformers")
    source, cfg = FIXTURES[model_type]
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        pytest.skip(f"transformers has no config class for {model_type}")
    assert ModelSpec.from_hf_config(cfg, reader="transformers") == ModelSpec.from_hf_config(cfg, reader="own"), source


def test_transformers_fills_what_the_config_leaves_out():
    """Through transformers (kvwrite[hf]): gemma-3-12b without head_dim reads 256, gemma-3-4b
    without head counts 4 KV heads of 256 — the own reader's defaults are transformers' ones."""
    pytest.importorskip("transformers")
    g = FIXTURES["gemma3"][1]
    g12 = {**g, "text_config": {k: v for k, v in g["text_config"].items() if k != "head_dim"}}
    g4 = {**g, "text_config": dict(model_type="gemma3_text", hidden_size=2560, num_hidden_layers=34,
                                   sliding_window=1024)}
    for cfg in (g12, g4):
        assert ModelSpec.from_hf_config(cfg, reader="transformers") == ModelSpec.from_hf_config(cfg, reader="own")
    assert ModelSpec.from_hf_config(g12, reader="transformers").head_dim == 256


@pytest.mark.parametrize("model_type, layer, kw", [
    ("kimi_linear", 3, dict(max_total_num_tokens=256, max_running_requests=2)),   # 43 MB of state a slot
    ("lfm2", 2, dict(memory_bytes=64 << 20))])                                    # SGLang's state share
def test_new_hybrids_build_and_store(model_type, layer, kw):
    """Kimi Linear (MLA + KDA state) and LFM2 (GQA + short-conv state) plan, build and store
    into an attention layer."""
    import torch
    spec = ModelSpec.from_hf_config(FIXTURES[model_type][1], reader="own")
    plan = KVCacheConfigurator(spec, page_size=16, **kw).plan()
    assert plan.max_running_requests >= 1 and plan.state_bytes == plan.fixed_bytes > 0
    pool = plan.build("cpu", check="guard", backend="torch")
    loc = torch.tensor([17, 40])
    args = [torch.randn(2, *shape).to(dtype) for _, shape, dtype in pool.planner.inputs(plan, layer)]
    pool.store(layer, loc, *args)
    pool.errors.raise_if_any()
    assert pool.layer(plan.pools[0].name, layer)[plan.pools[0].buffers[0].name].abs().sum() > 0
