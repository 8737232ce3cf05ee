"""kvwrite: fast, bounds-checked stores of K/V into paged KV-cache pools."""
from kvwrite.backend import BackendUnavailable, backends
from kvwrite.errors import ErrorBuffer, OutOfBoundsWrite, default_errors
from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.ops.kv import store_kv
from kvwrite.allocator import AllocatorExhausted, PagedAllocator
from kvwrite.config import (KVCacheConfigurator, KVPool, ModelSpec, ParallelSpec, PoolPlan, VariantPlanner,
                            presets, register_variant)

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "ErrorBuffer", "GeometryError", "OutOfBoundsWrite", "PageGeometry",
    "backends", "default_errors", "store_kv",
    "AllocatorExhausted", "KVCacheConfigurator", "KVPool", "ModelSpec", "PagedAllocator", "ParallelSpec",
    "PoolPlan", "VariantPlanner", "presets", "register_variant",
]
