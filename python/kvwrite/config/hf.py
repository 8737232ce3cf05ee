"""`ModelSpec.from_hf_config`: a local Hugging Face `config.json` -> ModelSpec (no network)."""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from kvwrite.config.errors import SpecError, UnknownArchitecture
from kvwrite.config.model import ModelSpec, register_reader


def _load(path_or_dict: "str | os.PathLike | Mapping[str, Any]") -> dict[str, Any]:
    if isinstance(path_or_dict, Mapping):
        return dict(path_or_dict)
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no Hugging Face config at {path!r} (give a config.json or its directory)")
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _get(cfg: Mapping[str, Any], key: str, default: Any = None, *, required: bool = True) -> Any:
    if key in cfg and cfg[key] is not None:
        return cfg[key]
    if required and default is None:
        raise SpecError(f"config.json ({cfg.get('model_type')}) lacks {key!r}")
    return default


def _dtype(cfg: Mapping[str, Any]) -> str:
    return str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16")


def _draft_layers(cfg: Mapping[str, Any]) -> int:
    """MTP layers if the model has them (DeepSeek, Qwen3-Next), else one (an EAGLE draft)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        if cfg.get(key):
            return int(cfg[key])
    return 1


def _mha_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    heads = int(_get(cfg, "num_attention_heads"))
    head_dim = cfg.get("head_dim") or int(_get(cfg, "hidden_size")) // heads
    return dict(num_layers=int(_get(cfg, "num_hidden_layers")),
                num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
                head_dim=int(head_dim), dtype=_dtype(cfg), num_draft_layers=_draft_layers(cfg))


def _dense(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # Llama, Mistral, Qwen2/3: every layer full attention. (Mistral-7B-v0.1's sliding window
    # applies to every layer; one full pool serves it, as engines do.)
    return dict(variant="mha", **_mha_fields(cfg))


def _mla(cfg: Mapping[str, Any], variant: str = "mla") -> dict[str, Any]:
    out = dict(variant=variant, num_layers=int(_get(cfg, "num_hidden_layers")),
               kv_lora_rank=int(_get(cfg, "kv_lora_rank")),
               qk_rope_head_dim=int(_get(cfg, "qk_rope_head_dim")), dtype=_dtype(cfg),
               num_draft_layers=_draft_layers(cfg))
    if variant == "dsa":
        out["index_head_dim"] = int(_get(cfg, "index_head_dim"))
    return out


def _layer_kinds(cfg: Mapping[str, Any], n: int, default: Callable[[int], str]) -> list[str]:
    types = cfg.get("layer_types")
    if types:
        if len(types) != n:
            raise SpecError(f"config.json layer_types has {len(types)} entries for {n} layers")
        return list(types)
    return [default(i) for i in range(n)]


def _swa(cfg: Mapping[str, Any], default: Callable[[int], str]) -> dict[str, Any]:
    out = dict(variant="swa_hybrid", **_mha_fields(cfg))
    kinds = _layer_kinds(cfg, out["num_layers"], default)
    out["sliding_window"] = int(_get(cfg, "sliding_window"))
    out["swa_layer_ids"] = [i for i, t in enumerate(kinds) if t == "sliding_attention"]
    out["full_attention_layer_ids"] = [i for i, t in enumerate(kinds) if t == "full_attention"]
    if len(out["swa_layer_ids"]) + len(out["full_attention_layer_ids"]) != out["num_layers"]:
        raise SpecError(f"config.json layer_types has kinds other than sliding/full attention: {sorted(set(kinds))}")
    return out


def _gpt_oss(cfg: Mapping[str, Any]) -> dict[str, Any]:
    # gpt-oss alternates sliding (even layers) and full attention.
    return _swa(cfg, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")


def _gemma3(cfg: Mapping[str, Any]) -> dict[str, Any]:
    text = dict(cfg.get("text_config") or cfg)
    text.setdefault("torch_dtype", cfg.get("torch_dtype"))
    pattern = int(text.get("sliding_window_pattern") or 6)  # 5 local : 1 global
    return _swa(text, lambda i: "full_attention" if (i + 1) % pattern == 0 else "sliding_attention")


def _qwen3_next(cfg: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(variant="hybrid_linear", **_mha_fields(cfg))
    interval = int(cfg.get("full_attention_interval") or 4)
    kinds = _layer_kinds(cfg, out["num_layers"],
                         lambda i: "full_attention" if (i + 1) % interval == 0 else "linear_attention")
    out["full_attention_layer_ids"] = [i for i, t in enumerate(kinds) if t == "full_attention"]
    return out


# model_type -> (architecture class names, parser)
ARCHITECTURES: dict[str, tuple[tuple[str, ...], Callable[[Mapping[str, Any]], dict[str, Any]]]] = {
    "llama": (("LlamaForCausalLM",), _dense),
    "mistral": (("MistralForCausalLM",), _dense),
    "qwen2": (("Qwen2ForCausalLM",), _dense),
    "qwen3": (("Qwen3ForCausalLM",), _dense),
    "deepseek_v2": (("DeepseekV2ForCausalLM",), _mla),
    "deepseek_v3": (("DeepseekV3ForCausalLM",), _mla),
    "deepseek_v32": (("DeepseekV32ForCausalLM",), lambda c: _mla(c, "dsa")),
    "gpt_oss": (("GptOssForCausalLM",), _gpt_oss),
    "gemma3": (("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"), _gemma3),
    "gemma3_text": (("Gemma3ForCausalLM",), _gemma3),
    "qwen3_next": (("Qwen3NextForCausalLM",), _qwen3_next),
}


def supported() -> list[str]:
    return sorted({a for archs, _ in ARCHITECTURES.values() for a in archs})


def spec_from_hf_config(path_or_dict: "str | os.PathLike | Mapping[str, Any]", *, name: str = "") -> ModelSpec:
    cfg = _load(path_or_dict)
    model_type = cfg.get("model_type")
    archs = list(cfg.get("architectures") or [])
    if model_type not in ARCHITECTURES:
        by_arch = [t for t, (names, _) in ARCHITECTURES.items() if any(a in names for a in archs)]
        if not by_arch:
            raise UnknownArchitecture(
                f"config.json has model_type={model_type!r}, architectures={archs}; supported: "
                f"{', '.join(supported())} (model_type {', '.join(sorted(ARCHITECTURES))})")
        model_type = by_arch[0]
    fields = ARCHITECTURES[model_type][1](cfg)
    return ModelSpec(name=name or str(cfg.get("_name_or_path") or model_type), **fields)


register_reader("from_hf_config", spec_from_hf_config)
