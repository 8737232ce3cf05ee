"""Built-in presets: the attention fields of each model's public Hugging Face `config.json`
(copied here, so no network is needed), parsed by the same `from_hf_config` as a user's file."""
from __future__ import annotations

from kvwrite.config.errors import UnknownPreset
from kvwrite.config.hf import spec_from_hf_config
from kvwrite.config.model import ModelSpec, register_reader

_ALT_SWA = ["sliding_attention", "full_attention"]

# name -> (Hugging Face repo the figures come from, the config fields that matter)
PRESETS: dict[str, tuple[str, dict]] = {
    "llama-3.1-8b": ("meta-llama/Llama-3.1-8B", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, torch_dtype="bfloat16")),
    "llama-3.1-70b": ("meta-llama/Llama-3.1-70B", dict(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=8192,
        num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=80, torch_dtype="bfloat16")),
    "qwen3-8b": ("Qwen/Qwen3-8B", dict(
        architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, head_dim=128,
        num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=36, torch_dtype="bfloat16")),
    "deepseek-v3": ("deepseek-ai/DeepSeek-V3", dict(
        architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", num_hidden_layers=61,
        num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, num_nextn_predict_layers=1, torch_dtype="bfloat16")),
    "deepseek-v3.2": ("deepseek-ai/DeepSeek-V3.2-Exp", dict(
        architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32", num_hidden_layers=61,
        num_attention_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, index_head_dim=128, index_n_heads=64, index_topk=2048,
        num_nextn_predict_layers=1, torch_dtype="bfloat16")),
    "gpt-oss-120b": ("openai/gpt-oss-120b", dict(
        architectures=["GptOssForCausalLM"], model_type="gpt_oss", hidden_size=2880, head_dim=64,
        num_attention_heads=64, num_key_value_heads=8, num_hidden_layers=36, sliding_window=128,
        layer_types=_ALT_SWA * 18, torch_dtype="bfloat16")),
    "gemma-3-27b": ("google/gemma-3-27b-it", dict(
        architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", torch_dtype="bfloat16",
        text_config=dict(model_type="gemma3_text", hidden_size=5376, head_dim=128,
                         num_attention_heads=32, num_key_value_heads=16, num_hidden_layers=62,
                         sliding_window=1024, sliding_window_pattern=6))),
    "qwen3-next-80b-a3b": ("Qwen/Qwen3-Next-80B-A3B-Instruct", dict(
        architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", hidden_size=2048,
        head_dim=256, num_attention_heads=16, num_key_value_heads=2, num_hidden_layers=48,
        full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128,
        linear_value_head_dim=128, linear_conv_kernel_dim=4, torch_dtype="bfloat16")),
    # DeepSeek V4 (variant "dsv4"; the planner's defaults: page_size 256, fp8_e4m3, swa ratio 0.1).
    "deepseek-v4-flash": ("deepseek-ai/DeepSeek-V4-Flash", dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", max_position_embeddings=1048576, hidden_size=4096,
        num_hidden_layers=43, num_attention_heads=64, num_key_value_heads=1, head_dim=512,
        qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64, index_topk=512, sliding_window=128,
        compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0], num_nextn_predict_layers=1,
        torch_dtype="bfloat16")),
    "deepseek-v4-pro": ("deepseek-ai/DeepSeek-V4-Pro", dict(
        architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", max_position_embeddings=1048576, hidden_size=7168,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=1, head_dim=512,
        qk_rope_head_dim=64, index_head_dim=128, index_n_heads=64, index_topk=1024, sliding_window=128,
        compress_ratios=[128, 128] + [4, 128] * 29 + [4, 0], num_nextn_predict_layers=1,
        torch_dtype="bfloat16")),
}


def preset(name: str) -> ModelSpec:
    if name not in PRESETS:
        raise UnknownPreset(f"no preset {name!r}; presets: {', '.join(PRESETS)}")
    return spec_from_hf_config(PRESETS[name][1], name=name, reader="own")


def presets() -> dict[str, ModelSpec]:
    """Every built-in preset by name."""
    return {name: preset(name) for name in PRESETS}


def preset_source(name: str) -> str:
    return PRESETS[name][0]


register_reader("from_preset", preset)
