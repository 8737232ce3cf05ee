"""kvwrite: fast, bounds-checked stores of K/V into paged KV-cache pools."""
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

__all__ = [
    "BackendUnavailable", "ErrorBuffer", "GeometryError", "OutOfBoundsWrite", "PageGeometry",
    "backends", "default_errors", "store_kv", "store_kv_head_major",
    "dequant_ds_mla", "read_indexer_k", "store_indexer_k", "store_mla",
    "AllocatorExhausted", "KVCacheConfigurator", "KVPool", "ModelSpec", "PagedAllocator", "ParallelSpec",
    "PoolPlan", "VariantPlanner", "presets", "register_variant",
    "dequant_nvfp4", "store_kv_nvfp4",
    "compressed_loc", "dequant_dsv4_kv", "read_dsv4_indexer_k", "state_loc", "store_dsv4_indexer_k",
    "store_dsv4_kv", "store_rows",
    "PageTable",
    "dequant_kv", "dequant_kv_int4", "rope_store_kv", "rope_store_mla",
    "copy_pages", "gather", "move_rows", "slot_mapping",
    "dequant_dsv4_kv_fp4", "rope_store_dsv4_kv_fp4", "store_dsv4_kv_fp4",
]
