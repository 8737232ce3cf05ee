"""kvwrite: fast, bounds-checked stores of K/V into paged KV-cache pools."""
from types import ModuleType as _ModuleType

from kvwrite.backend import BackendUnavailable, backends
from kvwrite.errors import ErrorBuffer, OutOfBoundsWrite, default_errors
from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.pagetable import PageTable
from kvwrite.ops.indexer_k import store_indexer_k
from kvwrite.ops.kv import store_kv
from kvwrite.ops.kv_head_major import store_kv_head_major
from kvwrite.ops.mla import store_mla
from kvwrite.reference.indexer_k import read_indexer_k
from kvwrite.reference.mla import dequant_ds_mla
from kvwrite.ops.nvfp4 import store_kv_nvfp4
from kvwrite.ops.rope import rope_store_kv, rope_store_mla
from kvwrite.reference.kv_quant import dequant_kv
from kvwrite.reference.kv_int4 import dequant_kv_int4
from kvwrite.ops.dsv4 import (compressed_loc, state_loc, store_dsv4_indexer_k, store_dsv4_kv,
                              store_rows)
from kvwrite.reference.dsv4 import dequant_dsv4_kv, read_dsv4_indexer_k
from kvwrite.ops.dsv4_fp4 import rope_store_dsv4_kv_fp4, store_dsv4_kv_fp4
from kvwrite.reference.dsv4_fp4 import dequant_dsv4_kv_fp4
from kvwrite.reference.nvfp4 import dequant_nvfp4
from kvwrite.ops.pages import copy_pages, gather, move_rows, slot_mapping
from kvwrite.allocator import AllocatorExhausted, PagedAllocator
from kvwrite.config import (KVCacheConfigurator, KVPool, ModelSpec, ParallelSpec, PoolPlan, VariantPlanner,
                            presets, register_variant)

__version__ = "0.1.0"

# the public names are what this module imports (no second list to keep in step)
__all__ = sorted(name for name, value in globals().items()
                 if not name.startswith("_") and not isinstance(value, _ModuleType))
