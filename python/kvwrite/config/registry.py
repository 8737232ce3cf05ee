"""The variant registry: attention-variant name -> planner, and the planner interface.

This module sits below `ModelSpec`: a spec asks the planner registered for its variant to
validate its fields, and the built-in planners (`kvwrite.config.variants`) register here when
`kvwrite.config` is imported. It imports no other configurator module but `errors`.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from kvwrite.config.errors import SpecError, UnknownVariant, UnsupportedCombination


@dataclass(frozen=True)
class PlanContext:
    """What a planner may read: the model planned (the draft model's on a draft worker), the
    parallel setup, the kv cache dtype, the base page size, the paged-buffer layout ("NHD" or
    "HND") and the target ("gpu", or "npu" for SGLang's Ascend pool layouts)."""

    model: Any
    parallel: Any
    kv_cache_dtype: str
    page_size: int
    layout: str = "NHD"
    target: str = "gpu"
    max_running_requests: int | None = None   # request slots (+ 1 padding slot) of slot pools

    @property
    def heads(self) -> int:
        return self.parallel.kv_heads_per_rank(self.model.num_kv_heads)

    @property
    def dtype(self) -> str:
        return self.model.dtype


class VariantPlanner:
    """Base planner. Subclass and `register_variant(name, planner)` to plug in a variant."""

    name = ""
    fields: frozenset = frozenset()
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    native_kv_cache_dtype = "auto"   # what kv_cache_dtype="auto" means for this variant
    request_slots = False            # has a pool sized per request slot besides state_pools()
    fixed_what = ""                  # what fixed_bytes() holds, for messages

    def check_model(self, spec) -> None:  # raise SpecError
        pass

    def kv_layer_ids(self, spec) -> tuple[int, ...]:
        return tuple(range(spec.num_layers))

    def draft_model(self, spec):
        return spec.replace(num_layers=draft_layers(spec), name=f"{spec.name or spec.variant} draft")

    def check_dtype(self, ctx: PlanContext) -> None:
        if ctx.kv_cache_dtype not in self.kv_cache_dtypes:
            raise UnsupportedCombination(
                f"variant {self.name!r} has no kv_cache_dtype={ctx.kv_cache_dtype!r}; it supports "
                f"{', '.join(self.kv_cache_dtypes)}")

    def pools(self, ctx: PlanContext) -> Sequence:
        """The sub-pools (`kvwrite.config.plan.PoolSpec`) of this variant."""
        raise NotImplementedError

    def state_pools(self, ctx: PlanContext) -> Sequence:
        """Recurrent-state pools (`kvwrite.config.plan.StatePoolSpec`), sized per request slot."""
        return ()

    def inputs(self, plan, layer_id: int) -> list:
        """Per-token (name, shape, dtype) of the tensors `store(layer_id, loc, *tensors)` takes."""
        raise NotImplementedError

    def store(self, pool, layer_id: int, loc, tensors: tuple, scales: dict) -> None:
        raise NotImplementedError

    # Defaults a variant brings (page_size, swa_full_tokens_ratio) over DEFAULTS.
    defaults: dict = {}

    def fixed_bytes(self, ctx: PlanContext) -> int:
        """Bytes of this variant's pools that do not scale with tokens (taken from the budget first)."""
        return 0

    def default_requests(self, ctx: PlanContext, swa_full_tokens_ratio: float, memory_bytes, tokens):
        """None, or the request slots the engine picks when max_running_requests is unset."""
        return None

    def sub_pool(self, spec, ctx: PlanContext, pages: int, scale: int):
        """None (the configurator lays sub-pool `spec` out: `pages` pages of page_size * scale
        rows over its loc space), or a dict with its own `geometry` and optionally `space` (a
        LocSpace) and `addressing`: pools whose rows are not the allocator's pages."""
        return None

    def cell_size(self, ctx: PlanContext, swa_full_tokens_ratio: float):
        """None (the configurator sums buffer rows), or the variant's bytes per full token."""
        return None


# The defaults `KVCacheConfigurator` and `kvwrite plan` share. swa_full_tokens_ratio: SGLang's
# --swa-full-tokens-ratio fallback (arg_groups/fields/schedule.py); page_size: kvwrite's choice
# (SGLang picks it per attention backend); a variant may override both (`VariantPlanner.defaults`).
DEFAULTS = dict(page_size=64, kv_cache_dtype="auto", swa_full_tokens_ratio=0.8)


def plan_defaults(variant: str) -> dict:
    """page_size, kv_cache_dtype and swa_full_tokens_ratio defaults of `variant`."""
    return {**DEFAULTS, **planner_for(variant).defaults}


def draft_layers(spec) -> int:
    if spec.num_draft_layers < 1:
        raise SpecError(f"a draft worker needs num_draft_layers >= 1 (model {spec.name or spec.variant})")
    return spec.num_draft_layers


_REGISTRY: dict[str, VariantPlanner] = {}
_BUILTIN: set[str] = set()


def register_variant(name: str, planner: VariantPlanner, *, replace: bool = False) -> None:
    """Plug in an attention variant: `planner` (a `VariantPlanner`) lays out its sub-pools and
    routes its stores; `ModelSpec(variant=name, ...)` then plans and builds through it."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"variant name must be a non-empty str, got {name!r}")
    if not isinstance(planner, VariantPlanner):
        raise TypeError(f"planner must be a kvwrite.VariantPlanner instance, got {type(planner).__name__}")
    if name in _REGISTRY and not replace:
        raise ValueError(f"variant {name!r} is already registered (pass replace=True to override)")
    if not planner.name:
        planner.name = name
    _REGISTRY[name] = planner


def register_builtin(*planners: VariantPlanner) -> None:
    """The built-in planners (kvwrite.config.variants): registered under their names, never removable."""
    for p in planners:
        _REGISTRY[p.name] = p
        _BUILTIN.add(p.name)


def unregister_variant(name: str) -> None:
    if name in _BUILTIN:
        raise ValueError(f"built-in variant {name!r} cannot be unregistered")
    _REGISTRY.pop(name, None)


def planner_for(variant: str) -> VariantPlanner:
    try:
        return _REGISTRY[variant]
    except (KeyError, TypeError):
        raise UnknownVariant(f"unknown variant {variant!r}; variants: {', '.join(_REGISTRY)}") from None


def variants() -> tuple[str, ...]:
    return tuple(_REGISTRY)
