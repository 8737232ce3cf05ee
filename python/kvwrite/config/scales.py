"""Which scale keywords a pool format uses (no silent ignores): plain data, imported by the
planners (`variants`) and the built pool (`pool`)."""
from __future__ import annotations

from typing import Sequence

# kv_cache_dtype -> torch dtype name of the per-tensor-scaled fp8 formats
FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2", "fp8_e4m3fnuz": "float8_e4m3fnuz"}
# static per-tensor int8 (k_scale/v_scale like fp8), and the dynamic formats: kv_cache_dtype ->
# (cache dtype name, one scale per token-head?) with fp32 scale caches beside the K/V buffers
STATIC_SCALED = {**FP8, "int8": "int8"}
DYNAMIC = {"int8_per_token": ("int8", False), "fp8_per_token": ("float8_e4m3fn", False),
           "int8_per_token_head": ("int8", True), "fp8_per_token_head": ("float8_e4m3fn", True)}


def scale_applies(name: str, kv_cache_dtype: str) -> bool:
    """Whether scale keyword `name` (optionally "index_"-prefixed, for MiniMax's index pool,
    which shares the main pool's format) means anything for a pool in `kv_cache_dtype`: fp8
    dequant scales only for fp8 pools, NVFP4 global scales only for nvfp4 pools."""
    base = name[len("index_"):] if name.startswith("index_") else name
    if base.endswith("global_scale"):
        return kv_cache_dtype == "nvfp4"
    if base in ("scale", "k_scale", "v_scale"):
        return kv_cache_dtype in STATIC_SCALED
    return True


def fp8_scale_names(allowed: Sequence[str], kv_cache_dtype: str) -> tuple[str, ...]:
    """The per-tensor fp8 scales a pool of this format must be given at build."""
    return tuple(n for n in allowed if scale_applies(n, kv_cache_dtype) and kv_cache_dtype in STATIC_SCALED
                 and not n.endswith("global_scale") and not n.endswith("_fmt"))
