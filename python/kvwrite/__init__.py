"""kvwrite: fast, bounds-checked stores of K/V into paged KV-cache pools."""
from kvwrite.backend import BackendUnavailable, backends
from kvwrite.errors import ErrorBuffer, OutOfBoundsWrite, default_errors
from kvwrite.geometry import GeometryError, PageGeometry
from kvwrite.ops.kv import store_kv
from kvwrite.ops.nvfp4 import store_kv_nvfp4
from kvwrite.reference.nvfp4 import dequant_nvfp4

__version__ = "0.1.0"

__all__ = [
    "BackendUnavailable", "ErrorBuffer", "GeometryError", "OutOfBoundsWrite", "PageGeometry",
    "backends", "default_errors", "dequant_nvfp4", "store_kv", "store_kv_nvfp4",
]
