"""ModelSpec / ParallelSpec: presets from the public configs, from_hf_config, named errors."""
from __future__ import annotations

import json

import pytest
import torch

import kvwrite
from kvwrite import ModelSpec, ParallelSpec
from kvwrite.config import SpecError, UnknownArchitecture, UnknownPreset, UnknownVariant
from kvwrite.config.presets import PRESETS

# (variant, layers, kv heads, head dim, kv layers, extra facts) from the models' public configs
EXPECTED = {
    "llama-3.1-8b": ("mha", 32, 8, 128, 32, {}),
    "llama-3.1-70b": ("mha", 80, 8, 128, 80, {}),
    "qwen3-8b": ("mha", 36, 8, 128, 36, {}),
    "deepseek-v3": ("mla", 61, 0, 0, 61, dict(kv_lora_rank=512, qk_rope_head_dim=64, num_draft_layers=1)),
    "deepseek-v3.2": ("dsa", 61, 0, 0, 61, dict(kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=128)),
    "gpt-oss-120b": ("swa_hybrid", 36, 8, 64, 36, dict(sliding_window=128, swa_layer_ids=tuple(range(0, 36, 2)),
                                                       full_attention_layer_ids=tuple(range(1, 36, 2)))),
    "gemma-3-27b": ("swa_hybrid", 62, 16, 128, 62, dict(sliding_window=1024,
                                                        full_attention_layer_ids=tuple(range(5, 62, 6)))),
    "qwen3-next-80b-a3b": ("hybrid_linear", 48, 2, 256, 12, dict(full_attention_layer_ids=tuple(range(3, 48, 4)))),
    "deepseek-v4-flash": ("dsv4", 43, 0, 512, 43, dict(qk_rope_head_dim=64, index_head_dim=128, sliding_window=128,
                                                       compress_ratios=(0, 0) + (4, 128) * 20 + (4,))),
    "deepseek-v4-pro": ("dsv4", 61, 0, 512, 61, dict(qk_rope_head_dim=64, index_head_dim=128, sliding_window=128,
                                                     compress_ratios=(128, 128) + (4, 128) * 29 + (4,))),
}


def test_presets_are_the_public_figures():
    specs = kvwrite.presets()
    assert list(specs) == list(EXPECTED)
    for name, (variant, layers, heads, dim, kv_layers, extra) in EXPECTED.items():
        s = specs[name]
        assert (s.variant, s.num_layers, s.num_kv_heads, s.head_dim, len(s.kv_layer_ids)) == \
            (variant, layers, heads, dim, kv_layers), name
        for k, v in extra.items():
            assert getattr(s, k) == v, (name, k)
        assert s.dtype == "bfloat16" and s.name == name
        assert ModelSpec.from_preset(name) == s
    gemma = specs["gemma-3-27b"]
    assert len(gemma.swa_layer_ids) == 52 and len(gemma.full_attention_layer_ids) == 10  # 5:1


def test_unknown_preset_names_the_presets():
    with pytest.raises(UnknownPreset, match="llama-3.1-8b"):
        ModelSpec.from_preset("llama-4")


@pytest.mark.parametrize("name", list(PRESETS))
def test_from_hf_config_reads_files_directories_and_dicts(tmp_path, name):
    cfg = PRESETS[name][1]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    by_file = ModelSpec.from_hf_config(str(tmp_path / "config.json"))
    by_dir = ModelSpec.from_hf_config(tmp_path)
    assert by_file == by_dir == ModelSpec.from_hf_config(cfg) == ModelSpec.from_preset(name)


def test_from_hf_config_other_architectures():
    mistral = dict(architectures=["MistralForCausalLM"], model_type="mistral", hidden_size=4096,
                   num_attention_heads=32, num_key_value_heads=8, num_hidden_layers=32, sliding_window=4096,
                   torch_dtype="bfloat16")
    s = ModelSpec.from_hf_config(mistral)
    assert (s.variant, s.num_kv_heads, s.head_dim) == ("mha", 8, 128)
    qwen2 = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, num_attention_heads=28,
                 num_key_value_heads=4, num_hidden_layers=28, torch_dtype="float16")
    s = ModelSpec.from_hf_config(qwen2)
    assert (s.head_dim, s.num_kv_heads, s.torch_dtype) == (128, 4, torch.float16)
    v2 = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", num_hidden_layers=27,
              kv_lora_rank=512, qk_rope_head_dim=64)
    s = ModelSpec.from_hf_config(v2)
    assert (s.variant, s.num_layers, s.kv_lora_rank, s.num_draft_layers) == ("mla", 27, 512, 1)
    # architecture name alone (model_type missing) is enough
    s = ModelSpec.from_hf_config({k: v for k, v in qwen2.items() if k != "model_type"})
    assert s.variant == "mha"
    # layer_types wins over the pattern
    g = json.loads(json.dumps(PRESETS["gemma-3-27b"][1]))
    g["text_config"]["num_hidden_layers"] = 4
    g["text_config"]["layer_types"] = ["sliding_attention", "full_attention", "sliding_attention", "full_attention"]
    s = ModelSpec.from_hf_config(g)
    assert s.swa_layer_ids == (0, 2) and s.full_attention_layer_ids == (1, 3)


def test_from_hf_config_errors():
    with pytest.raises(UnknownArchitecture, match="LlamaForCausalLM") as info:
        ModelSpec.from_hf_config({"model_type": "falcon", "architectures": ["FalconForCausalLM"]})
    assert "Qwen3NextForCausalLM" in str(info.value) and "GptOssForCausalLM" in str(info.value)
    with pytest.raises(SpecError, match="kv_lora_rank"):
        ModelSpec.from_hf_config({"model_type": "deepseek_v3", "num_hidden_layers": 3, "qk_rope_head_dim": 64})
    with pytest.raises(FileNotFoundError, match="config.json"):
        ModelSpec.from_hf_config("/nonexistent/dir")


MHA = dict(num_kv_heads=2, head_dim=64)
BAD_SPECS = [
    (dict(variant="mha", num_layers=2, head_dim=64), SpecError, "needs num_kv_heads"),
    (dict(variant="mha", num_layers=2, **MHA, kv_lora_rank=512), SpecError, "does not use kv_lora_rank"),
    (dict(variant="mla", num_layers=2, kv_lora_rank=512), SpecError, "needs qk_rope_head_dim"),
    (dict(variant="mla", num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, num_kv_heads=8), SpecError,
     "does not use num_kv_heads"),
    (dict(variant="dsa", num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64), SpecError, "needs index_head_dim"),
    (dict(variant="dsa", num_layers=2, kv_lora_rank=512, qk_rope_head_dim=64, index_head_dim=100), SpecError,
     "multiple of 128"),
    (dict(variant="swa_hybrid", num_layers=4, **MHA, swa_layer_ids=[0, 1], full_attention_layer_ids=[2, 3]),
     SpecError, "needs sliding_window"),
    (dict(variant="swa_hybrid", num_layers=4, **MHA, sliding_window=8, swa_layer_ids=[0, 1, 2],
          full_attention_layer_ids=[2, 3]), SpecError, "partition"),
    (dict(variant="swa_hybrid", num_layers=4, **MHA, sliding_window=8, swa_layer_ids=[0, 1, 2, 3]), SpecError,
     "needs both"),
    (dict(variant="hybrid_linear", num_layers=4, **MHA), SpecError, "needs full_attention_layer_ids"),
    (dict(variant="hybrid_linear", num_layers=4, **MHA, full_attention_layer_ids=[4]), SpecError, "outside"),
    (dict(variant="hybrid_linear", num_layers=4, **MHA, full_attention_layer_ids=[1, 1]), SpecError, "duplicate"),
    (dict(variant="minimax_sparse", num_layers=2, **MHA), SpecError, "needs index_head_dim"),
    (dict(variant="mha", num_layers=0, **MHA), SpecError, "num_layers must be >= 1"),
    (dict(variant="mha", num_layers=2, num_kv_heads=-1, head_dim=64), SpecError, "non-negative"),
    (dict(variant="mha", num_layers=2, **MHA, dtype="int8"), SpecError, "dtype must be one of"),
    (dict(variant="gqa", num_layers=2, **MHA), UnknownVariant, "variants: mha, mla"),
]


@pytest.mark.parametrize("kw, exc, msg", BAD_SPECS, ids=[m for _, _, m in BAD_SPECS])
def test_inconsistent_spec_is_a_named_error(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        ModelSpec(**kw)


def test_spec_normalises_and_drafts():
    s = ModelSpec("swa_hybrid", 4, num_kv_heads=8, head_dim=64, sliding_window=16, swa_layer_ids=[2, 0],
                  full_attention_layer_ids=(3, 1), dtype=torch.float16, num_draft_layers=2)
    assert s.swa_layer_ids == (0, 2) and s.dtype == "float16" and s.torch_dtype == torch.float16
    d = s.draft()
    assert (d.variant, d.num_layers, d.num_kv_heads, d.head_dim) == ("mha", 2, 8, 64)
    m = ModelSpec.from_preset("deepseek-v3").draft()
    assert (m.variant, m.num_layers, m.kv_lora_rank) == ("mla", 1, 512)
    assert ModelSpec.from_preset("qwen3-next-80b-a3b").draft().variant == "mha"
    assert json.loads(json.dumps(s.to_dict()))["swa_layer_ids"] == [0, 2]


def test_parallel_spec():
    assert ParallelSpec().kv_heads_per_rank(8) == 8
    assert ParallelSpec(tp_size=4).kv_heads_per_rank(8) == 2
    assert ParallelSpec(tp_size=16).kv_heads_per_rank(8) == 1   # replicated
    with pytest.raises(SpecError, match="not divisible"):
        ParallelSpec(tp_size=3).kv_heads_per_rank(8)
    with pytest.raises(SpecError, match="not a multiple"):
        ParallelSpec(tp_size=12).kv_heads_per_rank(8)
    for kw, msg in ((dict(tp_size=0), "tp_size"), (dict(dcp_size=2, dcp_rank=2), "dcp_rank"),
                    (dict(dcp_size=True), "dcp_size"), (dict(is_draft_worker=1), "is_draft_worker")):
        with pytest.raises(SpecError, match=msg):
            ParallelSpec(**kw)
