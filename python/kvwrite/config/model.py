"""`ModelSpec`: the attention facts of a model that decide its KV-cache pools.

Plain data: the readers (`kvwrite.config.hf`, `kvwrite.config.presets`) and the planners
(`kvwrite.config.variants`) import this module, never the other way round. A spec validates its
fields through the planner registered for its variant (`kvwrite.config.registry`, which imports
nothing of the configurator), and `ModelSpec.from_hf_config` / `from_preset` call the reader
registered under that name (`register_reader`, done by the reader modules when `kvwrite.config`
is imported, which importing any `kvwrite.config.*` module does first).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import torch

from kvwrite.config.errors import ConfigError, SpecError
from kvwrite.config.registry import planner_for

MODEL_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
_DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32",
                  "float": "float32"}

# Fields that a variant may or may not use; a variant's planner lists the ones it reads and
# a spec that sets any other is inconsistent (SpecError).
OPTIONAL_FIELDS = ("num_kv_heads", "head_dim", "v_head_dim", "kv_lora_rank", "qk_rope_head_dim",
                   "index_head_dim", "sliding_window", "swa_layer_ids", "full_attention_layer_ids",
                   "compress_ratios", "linear_layer_ids", "linear_state", "global_head_dim",
                   "num_global_kv_heads", "kv_sharing")


_READERS: dict[str, Callable[..., "ModelSpec"]] = {}


def register_reader(name: str, reader: Callable[..., "ModelSpec"]) -> None:
    """Back `ModelSpec.<name>` (`from_hf_config`, `from_preset`) with `reader`."""
    _READERS[name] = reader


def _reader(name: str) -> Callable[..., "ModelSpec"]:
    try:
        return _READERS[name]
    except KeyError:
        raise ConfigError(f"ModelSpec.{name} has no reader registered (import kvwrite.config)") from None


def _dtype_name(value: object) -> str:
    if isinstance(value, torch.dtype):
        name = str(value).replace("torch.", "")
    elif isinstance(value, str):
        name = _DTYPE_ALIASES.get(value, value)
    else:
        raise SpecError(f"dtype must be a torch.dtype or one of {tuple(MODEL_DTYPES)}, got {value!r}")
    if name not in MODEL_DTYPES:
        raise SpecError(f"dtype must be one of {tuple(MODEL_DTYPES)}, got {value!r}")
    return name


def _ids(name: str, value: object) -> tuple[int, ...]:
    try:
        ids = tuple(int(i) for i in value)  # type: ignore[union-attr]
    except TypeError:
        raise SpecError(f"{name} must be a sequence of layer ids, got {value!r}") from None
    if len(set(ids)) != len(ids):
        raise SpecError(f"{name} has duplicate layer ids: {list(ids)}")
    return tuple(sorted(ids))


def _sharing(value: object, n: int) -> tuple[tuple[int, int], ...]:
    """(consumer, source) layer pairs: each consumer reuses an earlier layer's KV, which is no consumer."""
    try:
        pairs = tuple(sorted((int(a), int(b)) for a, b in value))  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise SpecError(f"kv_sharing must be (layer, source layer) pairs, got {value!r}") from None
    consumers = {a for a, _ in pairs}
    bad = [(a, b) for a, b in pairs if not 0 <= b < a < n or b in consumers]
    if bad or len(consumers) != len(pairs):
        raise SpecError(f"kv_sharing pairs must name a later layer reusing an earlier, non-sharing one in "
                        f"[0, {n}), once each; got {bad or list(pairs)}")
    return pairs


STATE_KINDS = ("mamba2", "gdn", "mamba1", "lightning", "shortconv", "kda")


def _split(name: str, n: int, tp: int, what: str) -> int:
    if n % tp:
        raise SpecError(f"{what}: {name}={n} is not divisible by tp_size={tp}")
    return n // tp


@dataclass(frozen=True)
class RecurrentState:
    """The per-layer, per-request recurrent state of a hybrid-linear model's linear layers
    (SGLang's / vLLM's Mamba state shapes; `tp` divides the heads / channels):

    - "mamba2" (Nemotron-H, Falcon-H1): `num_heads` H of `head_dim` P, `num_groups` G of
      `state_size` N, kernel K: conv `[(H*P + 2*G'*N) / tp, K-1]`, ssm `[H/tp, P, N]` (G' = G, or
      G replicated up to tp when tp > G).
    - "gdn" (Qwen3-Next gated delta net): H value heads of P (head_v_dim), G key heads of N
      (head_k_dim): conv `[(2*G*N + H*P) / tp, K-1]`, recurrent state `[H/tp, N, P]`.
    - "mamba1" (Jamba): H = the mixer's d_inner channels (P = 1): conv `[H/tp, K-1]`, ssm `[H/tp, N]`.
    - "lightning" (MiniMax linear attention): H heads of P: state `[H/tp, P, P]`, no conv.
    - "shortconv" (LFM2 conv blocks): H = hidden channels, kernel K: conv `[H/tp, K-1]`, no SSM.
    - "kda" (Kimi Delta Attention): H heads of P: q, k, v short convs `[3*H*P/tp, K-1]`, state
      `[H/tp, P, P]`.
    """

    kind: str
    num_heads: int
    head_dim: int = 1
    state_size: int = 0
    num_groups: int = 0
    conv_kernel: int = 0
    ssm_dtype: str = "float32"
    conv_dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        if self.kind not in STATE_KINDS:
            raise SpecError(f"RecurrentState.kind must be one of {STATE_KINDS}, got {self.kind!r}")
        need = {"mamba2": ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel"),
                "gdn": ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel"),
                "mamba1": ("num_heads", "state_size", "conv_kernel"),
                "lightning": ("num_heads", "head_dim"),
                "shortconv": ("num_heads", "conv_kernel"),
                "kda": ("num_heads", "head_dim", "conv_kernel")}[self.kind]
        for k in ("num_heads", "head_dim", "state_size", "num_groups", "conv_kernel"):
            v = getattr(self, k)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0 or (k in need and v < 1):
                raise SpecError(f"RecurrentState({self.kind}).{k} must be an int >= {1 if k in need else 0}, "
                                f"got {v!r}")
        if self.kind == "lightning" and self.conv_kernel:
            raise SpecError("a lightning-attention state has no conv state; leave conv_kernel 0")
        object.__setattr__(self, "ssm_dtype", _dtype_name(self.ssm_dtype))
        object.__setattr__(self, "conv_dtype", _dtype_name(self.conv_dtype))

    def shapes(self, tp: int = 1) -> dict[str, tuple[int, ...]]:
        """Per-layer, per-slot buffer shapes on one of `tp` ranks: {"conv": ..., "ssm": ...}."""
        H, P, N, G, K = self.num_heads, self.head_dim, self.state_size, self.num_groups, self.conv_kernel
        what = f"{self.kind} state"
        if self.kind == "lightning":
            return {"ssm": (_split("num_heads", H, tp, what), P, P)}
        if self.kind == "shortconv":
            return {"conv": (_split("num_heads (hidden channels)", H, tp, what), K - 1)}
        if self.kind == "kda":
            return {"conv": (_split("conv channels", 3 * H * P, tp, what), K - 1),
                    "ssm": (_split("num_heads", H, tp, what), P, P)}
        if self.kind == "mamba1":
            ch = _split("num_heads (d_inner)", H, tp, what)
            return {"conv": (ch, K - 1), "ssm": (ch, N)}
        heads = _split("num_heads", H, tp, what)
        if self.kind == "gdn":
            return {"conv": (_split("conv channels", 2 * G * N + H * P, tp, what), K - 1), "ssm": (heads, N, P)}
        if G % tp and tp % G:
            raise SpecError(f"{what}: num_groups={G} can neither be split over nor replicated to tp_size={tp}")
        groups = G if G % tp == 0 else tp
        return {"conv": (_split("conv channels", H * P + 2 * groups * N, tp, what), K - 1), "ssm": (heads, P, N)}

    def dtypes(self) -> dict[str, str]:
        return {"conv": self.conv_dtype, "ssm": self.ssm_dtype}


@dataclass(frozen=True)
class ModelSpec:
    """What a model's KV cache looks like.

    `variant`: "mha" (MHA/GQA), "mla", "dsa" (MLA + DeepSeek-V3.2 indexer K), "swa_hybrid"
    (sliding-window layers beside full-attention layers), "hybrid_linear" (KV only for the
    full-attention layers of a linear-attention hybrid), "minimax_sparse" (MHA + a 1-head index
    K), or a variant added with `kvwrite.register_variant`. Each variant reads only its fields
    (see `kvwrite.config.variants`); setting a field the variant does not use, or leaving out one
    it needs, raises SpecError. `num_draft_layers`: layers of the draft (MTP/EAGLE) model a draft
    worker holds KV for. `linear_layer_ids` / `linear_state` (hybrid_linear): the layers with a
    recurrent state and its `RecurrentState` (sized per request slot, not per token).
    """

    variant: str
    num_layers: int
    num_kv_heads: int = 0
    head_dim: int = 0
    v_head_dim: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
    sliding_window: int = 0
    swa_layer_ids: tuple[int, ...] = ()
    full_attention_layer_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"
    num_draft_layers: int = 1
    compress_ratios: tuple[int, ...] = ()   # dsv4: per layer 0 (SWA only), 4 or 128
    linear_layer_ids: tuple[int, ...] = ()
    linear_state: RecurrentState | None = None
    global_head_dim: int = 0         # swa_hybrid: the full-attention layers' head dim (Gemma 4), if not head_dim
    num_global_kv_heads: int = 0     # swa_hybrid: the full-attention layers' KV heads (Gemma 4), if not num_kv_heads
    kv_sharing: tuple[tuple[int, int], ...] = ()   # (layer, the layer whose KV it reuses): Gemma 3n / 4
    context_len: int = field(default=0, compare=False)   # max_position_embeddings (0: unknown); V4's request estimate
    name: str = field(default="", compare=False)
    architecture: str = field(default="", compare=False)   # HF architectures[0]: the engines' layout rules key on it

    def __post_init__(self) -> None:
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        for k in ("num_layers", "num_kv_heads", "head_dim", "v_head_dim", "kv_lora_rank",
                  "qk_rope_head_dim", "index_head_dim", "sliding_window", "num_draft_layers", "context_len",
                  "global_head_dim", "num_global_kv_heads"):
            v = getattr(self, k)
            if v is None:
                v = 0
            if isinstance(v, bool) or not hasattr(v, "__index__") or int(v) < 0:
                raise SpecError(f"ModelSpec.{k} must be a non-negative int, got {v!r}")
            set_(k, int(v))
        if self.num_layers < 1:
            raise SpecError(f"ModelSpec.num_layers must be >= 1, got {self.num_layers}")
        set_("dtype", _dtype_name(self.dtype))
        set_("swa_layer_ids", _ids("swa_layer_ids", self.swa_layer_ids))
        set_("full_attention_layer_ids", _ids("full_attention_layer_ids", self.full_attention_layer_ids))
        try:
            set_("compress_ratios", tuple(int(r) for r in self.compress_ratios))
        except (TypeError, ValueError):
            raise SpecError(f"compress_ratios must be a sequence of ints, got {self.compress_ratios!r}") from None
        set_("linear_layer_ids", _ids("linear_layer_ids", self.linear_layer_ids))
        set_("kv_sharing", _sharing(self.kv_sharing, self.num_layers))
        if self.linear_state is not None and not isinstance(self.linear_state, RecurrentState):
            raise SpecError(f"ModelSpec.linear_state must be a kvwrite.config.RecurrentState, got "
                            f"{type(self.linear_state).__name__}")
        for k in ("swa_layer_ids", "full_attention_layer_ids", "linear_layer_ids"):
            bad = [i for i in getattr(self, k) if not 0 <= i < self.num_layers]
            if bad:
                raise SpecError(f"ModelSpec.{k} has ids outside [0, num_layers={self.num_layers}): {bad}")
        planner = planner_for(self.variant)  # the variant validates its own fields
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        unused = [k for k in OPTIONAL_FIELDS if k not in planner.fields and getattr(self, k) != defaults[k]]
        if unused:
            raise SpecError(f"variant {self.variant!r} does not use {', '.join(unused)} (it reads "
                            f"{', '.join(sorted(planner.fields)) or 'no optional field'}); leave them unset")
        planner.check_model(self)

    @property
    def torch_dtype(self) -> torch.dtype:
        return MODEL_DTYPES[self.dtype]

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """Layers that have a KV cache (all but a hybrid-linear model's linear layers)."""
        return planner_for(self.variant).kv_layer_ids(self)

    def draft(self) -> "ModelSpec":
        """The spec of this model's draft (MTP / EAGLE) model, whose pools a draft worker holds."""
        return planner_for(self.variant).draft_model(self)

    def replace(self, **changes: Any) -> "ModelSpec":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k in ("swa_layer_ids", "full_attention_layer_ids", "linear_layer_ids"):
            d[k] = list(getattr(self, k))
        d["compress_ratios"] = list(self.compress_ratios)
        d["kv_sharing"] = [list(p) for p in self.kv_sharing]
        return d

    def kv_source(self, layer_id: int) -> int | None:
        """The layer whose KV `layer_id` reuses (it stores none of its own), or None."""
        return dict(self.kv_sharing).get(layer_id)

    @classmethod
    def from_hf_config(cls, path_or_dict: "str | Mapping[str, Any]", *, name: str = "",
                       reader: str = "auto") -> "ModelSpec":
        """Read a local Hugging Face `config.json` (a path, a model directory, or the parsed dict);
        through transformers' config classes when installed (`reader="auto"`), else the own reader."""
        return _reader("from_hf_config")(path_or_dict, name=name, reader=reader)

    @classmethod
    def from_preset(cls, name: str) -> "ModelSpec":
        """A built-in preset (`kvwrite.presets()` lists them), from the model's public config."""
        return _reader("from_preset")(name)
