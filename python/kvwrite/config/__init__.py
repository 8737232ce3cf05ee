"""The configurator: model + parallel setup + budget -> pool plan -> built pools."""
from kvwrite.config.configurator import KVCacheConfigurator
from kvwrite.config.errors import (BudgetTooSmall, ConfigError, EngineMismatch, KernelUnavailable, LayerHasNoKV, MalformedConfig,
                                   SpecError, UnknownArchitecture, UnknownPreset, UnknownVariant,
                                   UnsupportedCombination, WindowDoesNotFit)
from kvwrite.config.hf import spec_from_hf_config  # noqa: F401  (registers ModelSpec.from_hf_config)
from kvwrite.config.model import ModelSpec, RecurrentState
from kvwrite.config.parallel import ParallelSpec
from kvwrite.config.plan import BufferSpec, LocSpace, PoolPlan, PoolSpec, StatePoolPlan, StatePoolSpec, SubPoolPlan
from kvwrite.config.pool import KVPool
from kvwrite.config.presets import presets
from kvwrite.config.registry import (PlanContext, VariantPlanner, register_variant, unregister_variant,
                                     variants)
from kvwrite.config.variants import KV_CACHE_DTYPES
from kvwrite.config import dsv4 as _dsv4  # noqa: F401,E402  (registers the "dsv4" variant)

__all__ = [
    "BudgetTooSmall", "BufferSpec", "ConfigError", "EngineMismatch", "KVCacheConfigurator", "KVPool", "KV_CACHE_DTYPES",
    "KernelUnavailable", "LayerHasNoKV", "LocSpace", "MalformedConfig", "ModelSpec", "ParallelSpec",
    "PlanContext", "PoolPlan", "PoolSpec", "RecurrentState", "SpecError", "StatePoolPlan", "StatePoolSpec",
    "SubPoolPlan", "UnknownArchitecture", "UnknownPreset", "UnknownVariant", "UnsupportedCombination",
    "VariantPlanner", "WindowDoesNotFit", "presets", "register_variant", "unregister_variant", "variants",
]
