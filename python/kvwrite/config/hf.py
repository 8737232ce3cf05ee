"""`ModelSpec.from_hf_config`: a local Hugging Face `config.json` -> ModelSpec (no network).

Every field is read through a typed accessor (`_Config`): a config that is not a JSON object,
lacks a field its model type needs, has one of the wrong type, or whose head dim does not divide
is a one-line `MalformedConfig` naming the field, never a traceback or a silently floored value.
"""
from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

from kvwrite.config.errors import MalformedConfig, UnknownArchitecture
from kvwrite.config.model import ModelSpec, RecurrentState, register_reader

_REQUIRED = object()


def _show(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None), list, dict)) else repr(value)
    text = text if len(text) <= 40 else text[:37] + "..."
    return f"{text} ({type(value).__name__})"


class _Config:
    """One JSON object of a config.json (the top level, or a nested `text_config`)."""

    def __init__(self, data: Any, where: str) -> None:
        if not isinstance(data, Mapping):
            raise MalformedConfig(f"{where} must be a JSON object, got {_show(data)}")
        self.data, self.where = data, where
        mt = data.get("model_type")
        self.model_type = mt if isinstance(mt, str) else None

    def fail(self, message: str) -> MalformedConfig:
        kind = f" (model_type {self.model_type})" if self.model_type else ""
        return MalformedConfig(f"{self.where}{kind}: {message}")

    def has(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def int(self, key: str, default: Any = _REQUIRED, *, minimum: int = 1) -> int:
        v = self.data.get(key)
        if v is None:
            if default is _REQUIRED:
                raise self.fail(f"lacks {key!r}")
            return default
        if isinstance(v, bool) or not isinstance(v, int):
            raise self.fail(f"field {key!r} must be an integer, got {_show(v)}")
        if v < minimum:
            raise self.fail(f"field {key!r} must be >= {minimum}, got {v}")
        return v

    def first_int(self, keys: tuple[str, ...], default: Any = _REQUIRED, *, minimum: int = 1) -> int:
        for k in keys:
            if self.has(k):
                return self.int(k, minimum=minimum)
        if default is _REQUIRED:
            raise self.fail(f"lacks {' / '.join(repr(k) for k in keys)}")
        return default

    def str(self, key: str, default: Any = _REQUIRED) -> str:
        v = self.data.get(key)
        if v is None:
            if default is _REQUIRED:
                raise self.fail(f"lacks {key!r}")
            return default
        if not isinstance(v, str):
            raise self.fail(f"field {key!r} must be a string, got {_show(v)}")
        return v

    def list(self, key: str, item: type, n: int | None = None) -> list | None:
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, list) or not all(isinstance(x, item) and not isinstance(x, bool) for x in v):
            raise self.fail(f"field {key!r} must be a list of {item.__name__}, got {_show(v)}")
        if n is not None and len(v) != n:
            raise self.fail(f"field {key!r} has {len(v)} entries for {n} layers")
        return list(v)

    def sub(self, key: str) -> "_Config | None":
        v = self.data.get(key)
        if v is None:
            return None
        if not isinstance(v, Mapping):
            raise self.fail(f"field {key!r} must be a JSON object, got {_show(v)}")
        return _Config(v, f"{self.where} {key}")


def _load(path_or_dict: Any) -> _Config:
    if isinstance(path_or_dict, Mapping):
        return _Config(path_or_dict, "config.json")
    if not isinstance(path_or_dict, (str, os.PathLike)):
        raise MalformedConfig(f"a config must be a JSON object (dict) or the path of a config.json, got "
                              f"{_show(path_or_dict)}")
    path = os.fspath(path_or_dict)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no Hugging Face config at {path!r} (give a config.json or its directory)")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except UnicodeDecodeError as err:
        raise MalformedConfig(f"{path} is not UTF-8 text ({err.reason} at byte {err.start})") from None
    except json.JSONDecodeError as err:
        raise MalformedConfig(f"{path} is not valid JSON: {err.msg} (line {err.lineno} column {err.colno})") from None
    except RecursionError:
        raise MalformedConfig(f"{path} nests too deeply to parse") from None
    return _Config(data, path)


# --- shared field readers ------------------------------------------------------------------------

def _dtype(cfg: _Config, outer: _Config | None = None) -> str:
    """The dtype the engines serve the model in (SGLang's and vLLM's `--dtype auto`): the
    config's, but float16 for a float32 model."""
    for c in (cfg, outer):
        if c is not None:
            for key in ("torch_dtype", "dtype"):
                if c.has(key):
                    name = c.str(key)
                    return "float16" if name in ("float32", "float", "fp32") else name
    return "bfloat16"


def _draft_layers(cfg: _Config) -> int:
    """MTP layers if the model has them (DeepSeek, GLM-4.5, Qwen3-Next), else one (an EAGLE draft)."""
    for key in ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers"):
        if cfg.int(key, 0, minimum=0):
            return cfg.int(key)
    return 1


def _heads(cfg: _Config) -> tuple[int, int, int]:
    """(attention heads, KV heads, head dim); without `head_dim` it is hidden_size / heads, which
    must divide."""
    heads = cfg.int("num_attention_heads")
    kv = cfg.int("num_key_value_heads", heads)
    if kv > heads or heads % kv:
        raise cfg.fail(f"num_key_value_heads={kv} must divide num_attention_heads={heads}")
    head_dim = cfg.first_int(("head_dim", "attention_head_dim"), None)
    if head_dim is None:
        hidden = cfg.int("hidden_size")
        if hidden % heads:
            raise cfg.fail(f"hidden_size={hidden} is not divisible by num_attention_heads={heads} and there is "
                           f"no head_dim")
        head_dim = hidden // heads
    return heads, kv, head_dim


def _mha_fields(cfg: _Config, outer: _Config | None = None) -> dict[str, Any]:
    _, kv, head_dim = _heads(cfg)
    return dict(num_layers=cfg.int("num_hidden_layers"), num_kv_heads=kv, head_dim=head_dim,
                dtype=_dtype(cfg, outer), num_draft_layers=_draft_layers(cfg))


def _kinds(cfg: _Config, n: int, default: Callable[[int], str], known: tuple[str, ...]) -> list[str]:
    kinds = cfg.list("layer_types", str, n)
    kinds = kinds if kinds is not None else [default(i) for i in range(n)]
    bad = sorted(set(kinds) - set(known))
    if bad:
        raise cfg.fail(f"layer_types has kinds {bad}; this model type has {list(known)}")
    return kinds


# --- per model type ------------------------------------------------------------------------------

def _dense(cfg: _Config, outer: _Config | None = None) -> dict[str, Any]:
    # Llama, Mistral, Mixtral, Qwen2/3 (+MoE), Phi-3, GLM-4.5: every layer full attention. A
    # sliding window on every layer (Mistral-7B-v0.1, Phi-3-mini, StarCoder2) is served by one
    # full pool, as engines do; a layer_types list that mixes sliding and full layers (or a
    # sliding_window_pattern: Cohere2, EXAONE 4) makes it an SWA hybrid.
    fields = _mha_fields(cfg, outer)
    pattern = _pattern(cfg) if cfg.has("sliding_window") else None
    default = pattern or (lambda i: "full_attention")
    kinds = _kinds(cfg, fields["num_layers"], default, ("full_attention", "sliding_attention"))
    if len(set(kinds)) == 2:
        return _swa(cfg, default, outer)
    return dict(variant="mha", **fields)


def _pattern(cfg: _Config) -> Callable[[int], str] | None:
    """sliding_window_pattern: an int p (layer i full when (i + 1) % p == 0: Cohere2, Gemma 3) or
    a string of L (local) / G (global) repeated over the layers (EXAONE 4)."""
    p = cfg.raw("sliding_window_pattern")
    if isinstance(p, str) and p and set(p) <= set("LG"):
        return lambda i: "full_attention" if p[i % len(p)] == "G" else "sliding_attention"
    if p is not None:
        n = cfg.int("sliding_window_pattern")
        return lambda i: "full_attention" if (i + 1) % n == 0 else "sliding_attention"
    return None


def _text_dense(cfg: _Config) -> dict[str, Any]:
    """A multimodal wrapper (Mistral 3, Qwen2/2.5/3-VL, GLM-4.1V / 4.5V): the language model's
    text_config (older Qwen2-VL configs keep it at the top level)."""
    return _dense(_text(cfg), cfg)


def _mla(cfg: _Config, variant: str = "mla") -> dict[str, Any]:
    outer, cfg = cfg, _text(cfg)   # Kimi K2.5 nests its DeepSeek-V3 text_config
    out = dict(variant=variant, num_layers=cfg.int("num_hidden_layers"), kv_lora_rank=cfg.int("kv_lora_rank"),
               qk_rope_head_dim=cfg.int("qk_rope_head_dim"), dtype=_dtype(cfg, outer),
               num_draft_layers=_draft_layers(cfg))
    if variant == "dsa":
        out["index_head_dim"] = cfg.int("index_head_dim")
    return out


def _swa(cfg: _Config, default: Callable[[int], str], outer: _Config | None = None, *,
         window_key: str = "sliding_window", sliding: str = "sliding_attention") -> dict[str, Any]:
    out = dict(variant="swa_hybrid", **_mha_fields(cfg, outer))
    kinds = _kinds(cfg, out["num_layers"], default, (sliding, "full_attention"))
    out["sliding_window"] = cfg.int(window_key)
    out["swa_layer_ids"] = [i for i, t in enumerate(kinds) if t == sliding]
    out["full_attention_layer_ids"] = [i for i, t in enumerate(kinds) if t == "full_attention"]
    if not out["swa_layer_ids"] or not out["full_attention_layer_ids"]:
        only = "sliding" if out["swa_layer_ids"] else "full"
        raise cfg.fail(f"every layer is {only} attention; an SWA hybrid needs both kinds")
    return out


def _alternating(cfg: _Config) -> dict[str, Any]:
    # gpt-oss and Gemma 2: sliding (even layers) and full attention (odd layers) alternate.
    return _swa(cfg, lambda i: "sliding_attention" if i % 2 == 0 else "full_attention")


def _text(cfg: _Config) -> _Config:
    """The language model's config: the nested `text_config` of a multimodal model, else cfg."""
    return cfg.sub("text_config") or cfg


def _gemma3(cfg: _Config) -> dict[str, Any]:
    text = _text(cfg)
    # transformers' Gemma3TextConfig defaults (what the engines load): head_dim 256, 8 / 4 heads
    defaults = {"head_dim": 256, "num_attention_heads": 8, "num_key_value_heads": 4, "sliding_window": 4096}
    text = _Config({**text.data, **{k: v for k, v in defaults.items() if text.raw(k) is None}}, text.where)
    pattern = text.int("sliding_window_pattern", 6)  # 5 local : 1 global
    return _swa(text, lambda i: "full_attention" if (i + 1) % pattern == 0 else "sliding_attention", cfg)


def _kv_sharing(kinds: list[str], shared: int) -> list[tuple[int, int]]:
    """The last `shared` layers reuse the KV of the last earlier layer of their own kind (Gemma 3n,
    Gemma 4: transformers' kv_sharing_modes, SGLang's kv_shared_layer_index)."""
    first = len(kinds) - shared
    out = []
    for i in range(first, len(kinds)):
        src = [j for j in range(first) if kinds[j] == kinds[i]]
        out.append((i, src[-1]))
    return out


def _gemma_shared(cfg: _Config, pattern: int, head_dim: int, outer: _Config, *, last_full: bool) -> dict[str, Any]:
    """Gemma 3n / 4: sliding layers with every `pattern`-th layer global, KV-shared last layers."""
    n = cfg.int("num_hidden_layers")
    default = {"head_dim": head_dim, "num_attention_heads": 8, "sliding_window": 512}
    cfg = _Config({**cfg.data, **{k: v for k, v in default.items() if cfg.raw(k) is None}}, cfg.where)
    kinds = _kinds(cfg, n, lambda i: "full_attention" if (i + 1) % pattern == 0 else "sliding_attention",
                   ("full_attention", "sliding_attention"))
    if last_full:   # transformers forces Gemma 4's last layer global
        kinds[-1] = "full_attention"
    out = _swa(_Config({**cfg.data, "layer_types": kinds}, cfg.where), lambda i: kinds[i], outer)
    shared = cfg.int("num_kv_shared_layers", 0, minimum=0)
    if shared >= n:
        raise cfg.fail(f"num_kv_shared_layers={shared} leaves no layer that stores KV ({n} layers)")
    out["kv_sharing"] = _kv_sharing(kinds, shared) if shared else []
    missing = sorted({kinds[a] for a, _ in out["kv_sharing"]} - set(kinds[:n - shared]))
    if missing:
        raise cfg.fail(f"KV-shared layers of kind {missing} have no earlier layer of that kind to reuse")
    return out


def _gemma4(cfg: _Config) -> dict[str, Any]:
    # Gemma 4: full-attention layers with their own head dim (global_head_dim, default 512) and, with
    # attention_k_eq_v (K reused as V), num_global_key_value_heads; the last num_kv_shared_layers reuse
    # an earlier layer's KV (transformers' Gemma4TextConfig).
    text = _text(cfg)
    out = _gemma_shared(text, 6, 256, cfg, last_full=True)
    out["global_head_dim"] = text.int("global_head_dim", 512)
    k_eq_v = text.raw("attention_k_eq_v")
    if k_eq_v is not None and not isinstance(k_eq_v, bool):
        raise text.fail(f"field 'attention_k_eq_v' must be a boolean, got {_show(k_eq_v)}")
    if k_eq_v and text.has("num_global_key_value_heads"):
        out["num_global_kv_heads"] = text.int("num_global_key_value_heads")
    return out


def _gemma3n(cfg: _Config) -> dict[str, Any]:
    # Gemma 3n: 4 sliding layers then a global one; the last num_kv_shared_layers (default 15)
    # reuse the KV of the last earlier layer of their kind (transformers' Gemma3nTextConfig).
    text = _text(cfg)
    if not text.has("num_kv_shared_layers"):
        text = _Config({**text.data, "num_kv_shared_layers": 15}, text.where)
    return _gemma_shared(text, 5, 256, cfg, last_full=False)


def _llama4(cfg: _Config) -> dict[str, Any]:
    # Llama 4: chunked-local attention (RoPE) layers, and every 4th layer global (NoPE). The
    # chunked layers go in the SWA pool with window attention_chunk_size, as SGLang sizes them.
    text = _text(cfg)
    n = text.int("num_hidden_layers")
    no_rope = text.list("no_rope_layers", int)
    if no_rope and len(no_rope) != n:
        raise text.fail(f"field 'no_rope_layers' has {len(no_rope)} entries for {n} layers")
    interval = text.int("no_rope_layer_interval", 4)
    chunked = (lambda i: no_rope[i] != 0) if no_rope else (lambda i: (i + 1) % interval != 0)
    return _swa(text, lambda i: "chunked_attention" if chunked(i) else "full_attention", cfg,
                window_key="attention_chunk_size", sliding="chunked_attention")


def _ssm_dtype(cfg: _Config) -> str:
    """SGLang's Mamba SSM state dtype: the config's mamba_ssm_dtype (or transformers'
    mamba_ssm_cache_dtype), else float32."""
    for key in ("mamba_ssm_dtype", "mamba_ssm_cache_dtype"):
        if cfg.has(key):
            return cfg.str(key)
    return "float32"


def _hybrid(cfg: _Config, kinds: list[str], state: RecurrentState, attention: str = "full_attention",
            linear: tuple[str, ...] = ("linear_attention",), both: str = "") -> dict[str, Any]:
    out = dict(variant="hybrid_linear", **_mha_fields(cfg))
    out["full_attention_layer_ids"] = [i for i, t in enumerate(kinds) if t in (attention, both)]
    out["linear_layer_ids"] = [i for i, t in enumerate(kinds) if t in linear or t == both]
    if not out["full_attention_layer_ids"]:
        raise cfg.fail("no layer has attention; a hybrid-linear model needs at least one")
    out["linear_state"] = state if out["linear_layer_ids"] else None
    return out


def _deepseek_v4(cfg: _Config) -> dict[str, Any]:
    # compress_ratios has one entry per layer plus the MTP layer(s): the first num_hidden_layers.
    n = cfg.int("num_hidden_layers")
    ratios = cfg.list("compress_ratios", int)
    if ratios is None and cfg.has("layer_types"):
        # transformers 5 re-saves them as layer_types + compress_rates {kind: ratio}
        rates = cfg.raw("compress_rates")
        if not isinstance(rates, dict) or not all(isinstance(v, int) for v in rates.values()):
            raise cfg.fail(f"field 'compress_rates' must map layer kinds to ratios, got {_show(rates)}")
        kinds = cfg.list("layer_types", str, n)
        bad = sorted(set(kinds) - set(rates) - {"sliding_attention"})
        if bad:
            raise cfg.fail(f"layer_types has kinds {bad} that compress_rates does not give a ratio")
        ratios = [rates.get(k, 0) for k in kinds]
    if ratios is None:
        raise cfg.fail("compress_ratios is missing (a DeepSeek V4 config lists one ratio per layer)")
    if len(ratios) < n:
        raise cfg.fail(f"compress_ratios has {len(ratios)} entries for {n} layers")
    return dict(variant="dsv4", num_layers=n, head_dim=cfg.int("head_dim"),
                qk_rope_head_dim=cfg.int("qk_rope_head_dim"), index_head_dim=cfg.int("index_head_dim"),
                sliding_window=cfg.int("sliding_window"), compress_ratios=ratios[:n],
                dtype=_dtype(cfg), num_draft_layers=_draft_layers(cfg))


def _qwen3_next(cfg: _Config) -> dict[str, Any]:
    # Qwen3-Next; Qwen3.5 (+MoE) nest the same fields in text_config
    outer, cfg = cfg, _text(cfg)
    if not cfg.has("torch_dtype") and not cfg.has("dtype") and outer is not cfg:
        cfg = _Config({**cfg.data, "dtype": _dtype(cfg, outer)}, cfg.where)
    n = cfg.int("num_hidden_layers")
    interval = cfg.int("full_attention_interval", 4)
    kinds = _kinds(cfg, n, lambda i: "full_attention" if (i + 1) % interval == 0 else "linear_attention",
                   ("full_attention", "linear_attention"))
    state = RecurrentState("gdn", num_heads=cfg.int("linear_num_value_heads"), head_dim=cfg.int("linear_value_head_dim"),
                           state_size=cfg.int("linear_key_head_dim"), num_groups=cfg.int("linear_num_key_heads"),
                           conv_kernel=cfg.int("linear_conv_kernel_dim"), ssm_dtype=_ssm_dtype(cfg),
                           conv_dtype=_dtype(cfg))
    return _hybrid(cfg, kinds, state)


def _mamba2(cfg: _Config, heads: str, head_dim: str, groups: tuple[str, ...], state: str, kernel: tuple[str, ...],
            intermediate: str | None = None) -> RecurrentState:
    H, P = cfg.int(heads), cfg.int(head_dim)
    if intermediate and cfg.has(intermediate) and cfg.int(intermediate) != H * P:
        raise cfg.fail(f"{intermediate}={cfg.int(intermediate)} is not {heads} x {head_dim} = {H * P}")
    return RecurrentState("mamba2", num_heads=H, head_dim=P, state_size=cfg.int(state),
                          num_groups=cfg.first_int(groups), conv_kernel=cfg.first_int(kernel),
                          ssm_dtype=_ssm_dtype(cfg), conv_dtype=_dtype(cfg))


_BLOCKS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}


def _nemotron_h(cfg: _Config) -> dict[str, Any]:
    # hybrid_override_pattern: one character a layer, "M" Mamba2, "*" attention, "-" MLP, "E" MoE;
    # transformers 5 re-saves it as layers_block_type, one kind a layer.
    blocks = cfg.list("layers_block_type", str)
    if blocks is not None and not cfg.has("hybrid_override_pattern"):
        bad = sorted(set(blocks) - set(_BLOCKS))
        if bad:
            raise cfg.fail(f"layers_block_type has kinds {bad}; expected {sorted(_BLOCKS)}")
        pattern = "".join(_BLOCKS[b] for b in blocks)
        n = cfg.int("num_hidden_layers", len(pattern))
        cfg = _Config({**cfg.data, "num_hidden_layers": n}, cfg.where)
    else:
        pattern = cfg.str("hybrid_override_pattern")
        n = cfg.int("num_hidden_layers")
    if len(pattern) != n or set(pattern) - set("M*-E"):
        raise cfg.fail(f"hybrid_override_pattern must have {n} characters of M * - E, got {_show(pattern)}")
    state = _mamba2(cfg, "mamba_num_heads", "mamba_head_dim", ("n_groups", "mamba_n_groups"), "ssm_state_size",
                    ("conv_kernel", "mamba_d_conv"))
    return _hybrid(cfg, list(pattern), state, attention="*", linear=("M",))


def _granite_hybrid(cfg: _Config) -> dict[str, Any]:
    # Granite 4.0-H: layer_types of "mamba" (Mamba2) and "attention" layers
    n = cfg.int("num_hidden_layers")
    kinds = cfg.list("layer_types", str, n)
    if kinds is None:
        raise cfg.fail("layer_types is missing (a granitemoehybrid config lists mamba / attention per layer)")
    kinds = ["full_attention" if k in ("attention", "full_attention") else k for k in kinds]
    state = _mamba2(cfg, "mamba_n_heads", "mamba_d_head", ("mamba_n_groups",), "mamba_d_state", ("mamba_d_conv",))
    return _hybrid(cfg, kinds, state, linear=("mamba", "linear_attention"))


def _lfm2(cfg: _Config) -> dict[str, Any]:
    # LFM2: gated short-conv blocks ("conv") beside GQA layers ("full_attention"); the conv state
    # [hidden, conv_L_cache - 1] per request in the model dtype
    n = cfg.int("num_hidden_layers")
    kinds = cfg.list("layer_types", str, n)
    if kinds is None:
        idx = cfg.list("full_attn_idxs", int)
        if idx is None:
            raise cfg.fail("lacks 'layer_types' / 'full_attn_idxs' (which layers have attention)")
        kinds = ["full_attention" if i in idx else "conv" for i in range(n)]
    state = RecurrentState("shortconv", num_heads=cfg.int("hidden_size"), conv_kernel=cfg.int("conv_L_cache"),
                           ssm_dtype=_dtype(cfg), conv_dtype=_dtype(cfg))
    return _hybrid(cfg, kinds, state, linear=("conv",))


def _kimi_linear(cfg: _Config) -> dict[str, Any]:
    # Kimi Linear: MLA layers beside Kimi Delta Attention layers. The published config lists them
    # in linear_attn_config (1-based full_attn_layers); transformers 5 re-saves layer_types.
    n = cfg.int("num_hidden_layers")
    lin = cfg.sub("linear_attn_config")
    kinds = cfg.list("layer_types", str, n)
    if kinds is None:
        if lin is None:
            raise cfg.fail("lacks 'linear_attn_config' / 'layer_types' (which layers are MLA)")
        full = lin.list("full_attn_layers", int) or []
        kinds = ["full_attention" if i + 1 in full else "linear_attention" for i in range(n)]
    src = lin or cfg
    heads = src.first_int(("num_heads", "linear_num_heads"))
    head_dim = src.first_int(("head_dim", "linear_head_dim"))
    kernel = src.first_int(("short_conv_kernel_size", "linear_conv_kernel_dim"))
    state = RecurrentState("kda", num_heads=heads, head_dim=head_dim, conv_kernel=kernel, ssm_dtype="float32",
                           conv_dtype=_dtype(cfg))
    out = dict(variant="mla_linear", num_layers=n, kv_lora_rank=cfg.int("kv_lora_rank"),
               qk_rope_head_dim=cfg.int("qk_rope_head_dim"), dtype=_dtype(cfg), num_draft_layers=_draft_layers(cfg))
    out["full_attention_layer_ids"] = [i for i, t in enumerate(kinds) if t == "full_attention"]
    out["linear_layer_ids"] = [i for i, t in enumerate(kinds) if t == "linear_attention"]
    out["linear_state"] = state if out["linear_layer_ids"] else None
    return out


def _falcon_h1(cfg: _Config) -> dict[str, Any]:
    # Falcon-H1: a parallel hybrid, every layer has attention and a Mamba2 mixer side by side.
    n = cfg.int("num_hidden_layers")
    state = _mamba2(cfg, "mamba_n_heads", "mamba_d_head", ("mamba_n_groups",), "mamba_d_state", ("mamba_d_conv",),
                    intermediate="mamba_d_ssm")
    return _hybrid(cfg, ["both"] * n, state, both="both")


def _jamba(cfg: _Config) -> dict[str, Any]:
    # Jamba: attention on layer i when i % attn_layer_period == attn_layer_offset, Mamba (v1) elsewhere.
    n, period = cfg.int("num_hidden_layers"), cfg.int("attn_layer_period", 8)
    offset = cfg.int("attn_layer_offset", 4, minimum=0)
    if offset >= period:
        raise cfg.fail(f"attn_layer_offset={offset} must be < attn_layer_period={period}")
    d_inner = cfg.int("mamba_expand", 2) * cfg.int("hidden_size")
    state = RecurrentState("mamba1", num_heads=d_inner, state_size=cfg.int("mamba_d_state", 16),
                           conv_kernel=cfg.int("mamba_d_conv", 4), ssm_dtype=_ssm_dtype(cfg), conv_dtype=_dtype(cfg))
    kinds = ["full_attention" if i % period == offset else "linear_attention" for i in range(n)]
    return _hybrid(cfg, kinds, state)


def _minimax(cfg: _Config) -> dict[str, Any]:
    # MiniMax-Text-01 / M1 (transformers "minimax"): lightning (linear) attention, a softmax
    # attention layer after every 7; the linear state is [heads, head_dim, head_dim] in the model
    # dtype (vLLM: fp32 state is not supported for MiniMax).
    n = cfg.int("num_hidden_layers")
    types = cfg.list("attn_type_list", int, n)
    default = ((lambda i: "full_attention" if types[i] == 1 else "linear_attention") if types else
               (lambda i: "full_attention" if (i + 1) % 8 == 0 else "linear_attention"))
    kinds = _kinds(cfg, n, default, ("full_attention", "linear_attention"))
    heads, _, head_dim = _heads(cfg)
    state = RecurrentState("lightning", num_heads=heads, head_dim=head_dim, ssm_dtype=_dtype(cfg),
                           conv_dtype=_dtype(cfg))
    return _hybrid(cfg, kinds, state)


# model_type -> (architecture class names, parser)
ARCHITECTURES: dict[str, tuple[tuple[str, ...], Callable[[_Config], dict[str, Any]]]] = {
    "llama": (("LlamaForCausalLM",), _dense),
    "mistral": (("MistralForCausalLM",), _dense),
    "mixtral": (("MixtralForCausalLM",), _dense),
    "qwen2": (("Qwen2ForCausalLM",), _dense),
    "qwen2_moe": (("Qwen2MoeForCausalLM",), _dense),
    "qwen3": (("Qwen3ForCausalLM",), _dense),
    "qwen3_moe": (("Qwen3MoeForCausalLM",), _dense),
    "phi3": (("Phi3ForCausalLM",), _dense),
    "glm4_moe": (("Glm4MoeForCausalLM",), _dense),
    "deepseek_v2": (("DeepseekV2ForCausalLM",), _mla),
    "deepseek_v3": (("DeepseekV3ForCausalLM",), _mla),
    "kimi_k2": ((), _mla),   # Kimi K2 ships architectures ["DeepseekV3ForCausalLM"]
    "deepseek_v32": (("DeepseekV32ForCausalLM",), lambda c: _mla(c, "dsa")),
    "gpt_oss": (("GptOssForCausalLM",), _alternating),
    "gemma2": (("Gemma2ForCausalLM",), _alternating),
    "gemma3": (("Gemma3ForConditionalGeneration", "Gemma3ForCausalLM"), _gemma3),
    "gemma3_text": (("Gemma3ForCausalLM",), _gemma3),
    "gemma3n": (("Gemma3nForConditionalGeneration", "Gemma3nForCausalLM"), _gemma3n),
    "gemma3n_text": (("Gemma3nForCausalLM",), _gemma3n),
    "gemma4": (("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM"), _gemma4),
    "gemma4_text": (("Gemma4ForCausalLM",), _gemma4),
    "llama4": (("Llama4ForConditionalGeneration", "Llama4ForCausalLM"), _llama4),
    "llama4_text": (("Llama4ForCausalLM",), _llama4),
    "qwen3_next": (("Qwen3NextForCausalLM",), _qwen3_next),
    "deepseek_v4": (("DeepseekV4ForCausalLM",), _deepseek_v4),
    "nemotron_h": (("NemotronHForCausalLM",), _nemotron_h),
    "falcon_h1": (("FalconH1ForCausalLM",), _falcon_h1),
    "jamba": (("JambaForCausalLM",), _jamba),
    "minimax": (("MiniMaxForCausalLM", "MiniMaxText01ForCausalLM", "MiniMaxM1ForCausalLM"), _minimax),
    # dense / GQA, possibly with sliding layers
    "minimax_m2": (("MiniMaxM2ForCausalLM",), _dense),
    "glm4": (("Glm4ForCausalLM",), _dense),
    "hunyuan_v1_dense": (("HunYuanDenseV1ForCausalLM",), _dense),
    "hunyuan_v1_moe": (("HunYuanMoEV1ForCausalLM",), _dense),
    "ernie4_5": (("Ernie4_5ForCausalLM",), _dense),
    "ernie4_5_moe": (("Ernie4_5_MoeForCausalLM",), _dense),
    "seed_oss": (("SeedOssForCausalLM",), _dense),
    "exaone4": (("Exaone4ForCausalLM",), _dense),
    "cohere2": (("Cohere2ForCausalLM",), _dense),
    "mimo": (("MiMoForCausalLM",), _dense),
    "olmo2": (("Olmo2ForCausalLM",), _dense),
    "olmo3": (("Olmo3ForCausalLM",), _dense),
    "gemma": (("GemmaForCausalLM",), _dense),
    "starcoder2": (("Starcoder2ForCausalLM",), _dense),
    "granite": (("GraniteForCausalLM",), _dense),
    "olmoe": (("OlmoeForCausalLM",), _dense),
    # multimodal wrappers of a dense language model
    "mistral3": (("Mistral3ForConditionalGeneration",), _text_dense),
    "qwen2_vl": (("Qwen2VLForConditionalGeneration",), _text_dense),
    "qwen2_5_vl": (("Qwen2_5_VLForConditionalGeneration",), _text_dense),
    "qwen3_vl": (("Qwen3VLForConditionalGeneration",), _text_dense),
    "qwen3_vl_moe": (("Qwen3VLMoeForConditionalGeneration",), _text_dense),
    "glm4v": (("Glm4vForConditionalGeneration",), _text_dense),
    "glm4v_moe": (("Glm4vMoeForConditionalGeneration",), _text_dense),
    # MLA / DSA
    "kimi_k25": (("KimiK25ForConditionalGeneration",), _mla),
    "glm4_moe_lite": (("Glm4MoeLiteForCausalLM",), _mla),
    "glm_moe_dsa": (("GlmMoeDsaForCausalLM",), lambda c: _mla(c, "dsa")),
    # linear-attention hybrids
    "qwen3_5": (("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM"), _qwen3_next),
    "qwen3_5_moe": (("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM"), _qwen3_next),
    "granitemoehybrid": (("GraniteMoeHybridForCausalLM",), _granite_hybrid),
    "lfm2": (("Lfm2ForCausalLM",), _lfm2),
    "kimi_linear": (("KimiLinearForCausalLM",), _kimi_linear),
}


def supported() -> list[str]:
    return sorted({a for archs, _ in ARCHITECTURES.values() for a in archs})


READERS = ("auto", "transformers", "own")


def _through_transformers(cfg: _Config, required: bool) -> _Config:
    """The config as transformers' config class for its model_type holds it (its defaults filled
    in, nested configs as dicts, transformers-5 field names), or cfg itself when transformers is
    not installed or does not know the model type (unless `required`)."""
    try:
        from transformers import AutoConfig
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING
    except Exception:   # not installed, or an import-time failure of an optional extra
        if required:
            raise MalformedConfig("reader='transformers' needs transformers (pip install kvwrite[hf])") from None
        return cfg
    mt = cfg.raw("model_type")
    if not isinstance(mt, str) or mt not in CONFIG_MAPPING:
        if required:
            raise UnknownArchitecture(f"transformers has no config class for model_type={_show(mt)}")
        return cfg
    try:
        conf = AutoConfig.for_model(mt, **{k: v for k, v in cfg.data.items() if k != "model_type"})
        data = conf.to_dict()
    except Exception as err:   # transformers refused the config: the own reader names the field
        if required:
            raise MalformedConfig(f"{cfg.where}: transformers could not read it: {err}") from None
        return cfg
    return _Config(data, cfg.where)


def spec_from_hf_config(path_or_dict: Any, *, name: str = "", reader: str = "auto") -> ModelSpec:
    """`reader="auto"`: through transformers' config class when transformers is installed and
    knows the model type (its defaults, e.g. gemma-3's head_dim 256), else the own reader;
    "transformers" / "own" force one (the presets use the own reader)."""
    if reader not in READERS:
        raise ValueError(f"reader must be one of {READERS}, got {reader!r}")
    cfg = _load(path_or_dict)
    if reader != "own":
        cfg = _through_transformers(cfg, reader == "transformers")
    model_type = cfg.raw("model_type")
    archs = cfg.raw("architectures")
    archs = [a for a in archs if isinstance(a, str)] if isinstance(archs, list) else []
    if not isinstance(model_type, str) or model_type not in ARCHITECTURES:
        by_arch = [t for t, (names, _) in ARCHITECTURES.items() if any(a in names for a in archs)]
        if not by_arch:
            raise UnknownArchitecture(
                f"config.json has model_type={_show(model_type)}, architectures={archs[:4]}; supported: "
                f"{', '.join(supported())} (model_type {', '.join(sorted(ARCHITECTURES))})")
        model_type = by_arch[0]
        cfg.model_type = model_type
    fields = ARCHITECTURES[model_type][1](cfg)
    text = _text(cfg)
    for c in (text, cfg):
        if "context_len" not in fields and c.has("max_position_embeddings"):
            fields["context_len"] = c.int("max_position_embeddings")
    label = cfg.raw("_name_or_path")
    arch = archs[0] if archs else (ARCHITECTURES[model_type][0] or ("",))[0]
    return ModelSpec(name=name or (label if isinstance(label, str) and label else model_type), architecture=arch,
                     **fields)


register_reader("from_hf_config", spec_from_hf_config)
