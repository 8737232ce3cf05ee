"""Named errors of the configurator: each says what was wrong and what would be accepted."""
from __future__ import annotations


class ConfigError(ValueError):
    """Base class of every configurator error."""


class SpecError(ConfigError):
    """A ModelSpec or ParallelSpec is inconsistent (missing or contradictory fields)."""


class MalformedConfig(SpecError):
    """A Hugging Face config.json that is not a JSON object, lacks a field its model type needs,
    has one of the wrong type, or whose sizes do not divide; the message names the field."""


class UnknownArchitecture(ConfigError):
    """`ModelSpec.from_hf_config` does not know the config's architecture."""


class UnknownPreset(ConfigError):
    """`ModelSpec.from_preset` got a name that is not a built-in preset."""


class UnknownVariant(ConfigError):
    """A ModelSpec names an attention variant that no planner is registered for."""


class UnsupportedCombination(ConfigError):
    """This variant cannot be planned with this kv_cache_dtype / parallel setup."""


class BudgetTooSmall(ConfigError):
    """`memory_bytes` cannot hold even one page per pool; `minimum_bytes` says what would."""

    def __init__(self, message: str, minimum_bytes: int) -> None:
        self.minimum_bytes = minimum_bytes
        super().__init__(message)


class WindowDoesNotFit(ConfigError):
    """A hybrid-SWA plan whose SWA pool could not hold one sliding window."""


class KernelUnavailable(ConfigError):
    """`build()` needs a store op (or an argument of one) this kvwrite does not provide."""


class LayerHasNoKV(ConfigError):
    """`store()` was called for a layer that has no KV cache (a linear-attention layer) or that
    the model does not have."""


class EngineMismatch(ConfigError):
    """A plan laid out for one engine was handed to another engine's adapters."""
