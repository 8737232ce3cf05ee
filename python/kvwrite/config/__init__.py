"""The configurator: model + parallel setup + budget -> pool plan -> built pools."""
from kvwrite.config.configurator import KVCacheConfigurator
from kvwrite.config.errors import (BudgetTooSmall, ConfigError, KernelUnavailable, LayerHasNoKV, SpecError,
                                   UnknownArchitecture, UnknownPreset, UnknownVariant,
                                   UnsupportedCombination, WindowDoesNotFit)
from kvwrite.config.hf import spec_from_hf_config  # noqa: F401  (registers ModelSpec.from_hf_config)
from kvwrite.config.model import ModelSpec
from kvwrite.config.parallel import ParallelSpec
from kvwrite.config.plan import BufferSpec, LocSpace, PoolPlan, PoolSpec, SubPoolPlan
from kvwrite.config.pool import KVPool
from kvwrite.config.presets import presets
from kvwrite.config.registry import (PlanContext, VariantPlanner, register_variant, unregister_variant,
                                     variants)
from kvwrite.config.variants import KV_CACHE_DTYPES

__all__ = [
    "BudgetTooSmall", "BufferSpec", "ConfigError", "KVCacheConfigurator", "KVPool", "KV_CACHE_DTYPES",
    "KernelUnavailable", "LayerHasNoKV", "LocSpace", "ModelSpec", "ParallelSpec", "PlanContext", "PoolPlan",
    "PoolSpec", "SpecError", "SubPoolPlan", "UnknownArchitecture", "UnknownPreset", "UnknownVariant",
    "UnsupportedCombination", "VariantPlanner", "WindowDoesNotFit", "presets", "register_variant",
    "unregister_variant", "variants",
]
