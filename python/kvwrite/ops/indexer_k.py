"""`store_indexer_k`: the DSA (DeepSeek V3.2 sparse attention) indexer key cache store.

Cache: uint8 `[num_pages, pool_page_size * (D + D/qbs * 4)]`, page-major. Page p holds
`pool_page_size * D` e4m3 bytes (token-major: row o at byte o*D), then `pool_page_size * D/qbs`
fp32 scales (row o's block b at byte pool_page_size*D + (o*D/qbs + b)*4). Each block of qbs
values has scale = max(amax, 1e-4) / 448 (`scale_fmt="ue8m0"`: rounded up to a power of two)
and is stored as fp8(x / scale).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import _ext, validate
from kvwrite.errors import ErrorBuffer
from kvwrite.geometry import PageGeometry, require_positive_int
from kvwrite.ops import _library
from kvwrite.ops._common import NATIVE, Check, Locs, cache_geometry, dispatch, prepare, record

OP = "store_indexer_k"
IMPLS = (
    ("torch", "kvwrite.reference.indexer_k:store_indexer_k"),
    ("triton", "kvwrite.kernels.store_indexer_k:launch"),
    ("cpu", "kvwrite._ext:store_indexer_k"),
    ("cuda", "kvwrite._ext:store_indexer_k"),
)
SCALE_FMTS = (None, "ue8m0")
AMAX_FLOOR = 1e-4          # scale = max(amax, AMAX_FLOOR) / 448


def row_bytes(head_dim: int, quant_block_size: int) -> int:
    """Cache bytes one token takes: D e4m3 bytes + D/qbs fp32 scales."""
    return head_dim + (head_dim // quant_block_size) * 4


def pool_page_size(name: str, cache_row: int, head_dim: int, quant_block_size: int) -> int:
    """Tokens per page of an indexer cache whose pages hold `cache_row` bytes (named error if
    the page does not hold a whole number of tokens)."""
    per_token = row_bytes(head_dim, quant_block_size)
    if cache_row % per_token or cache_row == 0:
        raise ValueError(
            f"{name}'s page of {cache_row} bytes is not a whole number of tokens of "
            f"{per_token} bytes (D={head_dim} e4m3 + {head_dim // quant_block_size} fp32 scales): "
            f"expected [num_pages, pool_page_size * {per_token}]")
    return cache_row // per_token


@dataclass(frozen=True)
class StoreIndexerK:
    """A validated store_indexer_k call; `cache` is the uint8 `[pages, page bytes]` tensor."""

    k: torch.Tensor
    cache: torch.Tensor
    quant_block_size: int
    ue8m0: bool
    geometry: PageGeometry
    locs: Locs
    check: Check


def prepare_store_indexer_k(k, cache, loc, quant_block_size, scale_fmt, check, errors,
                            loc_map) -> StoreIndexerK:
    k = validate.tensor("k", k, ndim=2, dtypes=validate.FLOAT_INPUTS)
    n, d = k.shape
    qbs = require_positive_int("quant_block_size", quant_block_size)
    if d % qbs:
        raise ValueError(f"k's head dim ({d}) must be a multiple of quant_block_size ({qbs})")
    if scale_fmt not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {scale_fmt!r}")
    cache = validate.tensor("cache", cache, ndim=2, dtypes=(torch.uint8,), device=k.device)
    pps = pool_page_size("cache", cache.shape[1], d, qbs)
    geometry = cache_geometry("cache", cache.shape[0], pps)
    # the indexer cache is replicated: addressed by the virtual loc, never DCP-sharded
    locs, chk = prepare(OP, k.device, n, loc, loc_map, 0, 1, check, errors)
    return StoreIndexerK(k, cache, qbs, scale_fmt == "ue8m0", geometry, locs, chk)


def _store_indexer_k_py(k, cache, loc, quant_block_size, scale_fmt, check, errors, loc_map,
                        backend) -> None:
    """The Python implementation of torch.ops.kvwrite.store_indexer_k (see ops._library)."""
    a = prepare_store_indexer_k(k, cache, loc, quant_block_size, scale_fmt, check, errors, loc_map)
    if a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)


def _fake(k, cache, loc, quant_block_size, scale_fmt, check, errors, loc_map, backend) -> None:
    """Validation only: the same errors while tracing and for meta tensors."""
    prepare_store_indexer_k(k, cache, loc, quant_block_size, scale_fmt, _library.fake_check(check, errors),
                            errors, loc_map)


_OP = _library.define(
    OP, "(Tensor k, Tensor(a!) cache, Tensor loc, int quant_block_size, str? scale_fmt, "
        "str check, Tensor(b!)? errors, Tensor? loc_map, str backend) -> ()",
    _store_indexer_k_py, _fake)
_CALL = _OP._op


def store_indexer_k(k: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *,
                    quant_block_size: int = 128, scale_fmt: str | None = None,
                    check: str | None = None, errors: ErrorBuffer | None = None,
                    loc_map: torch.Tensor | None = None, backend: str = "auto") -> None:
    """Quantise token i's indexer key `k[i]` `[D]` per `quant_block_size` block to e4m3 and
    store it with its fp32 scales at `loc[i]` (-1 = padding, skipped); see the module doc for
    the page layout. `scale_fmt="ue8m0"` rounds each scale up to a power of two.
    The pool page size is `cache.shape[1] // (D + D/qbs*4)`. `loc_map` translates as in
    `store_kv`; there is no DCP sharding (the indexer cache is addressed by the virtual loc).
    """
    if (_ext.LOADED and backend in NATIVE and type(quant_block_size) is int
            and isinstance(loc, torch.Tensor) and not torch.compiler.is_compiling()):
        mode = validate.DEFAULT_CHECK if check is None else check
        try:  # the C++ op: validation (same errors) + kernel
            return _CALL(k, cache, loc, quant_block_size, scale_fmt, mode,
                         record(errors, mode, k), loc_map, backend)
        except Exception:  # arguments the schema refused: Python's error names them
            prepare_store_indexer_k(k, cache, loc, quant_block_size, scale_fmt, check, errors,
                                    loc_map)
            raise
    a = prepare_store_indexer_k(k, cache, loc, quant_block_size, scale_fmt, check, errors, loc_map)
    if torch.compiler.is_compiling():
        torch.ops.kvwrite.store_indexer_k(k, cache, loc, a.quant_block_size, scale_fmt, a.check.mode,
                                          a.check.errors, loc_map, backend)
    elif a.locs.n:
        dispatch(OP, IMPLS, backend, k.device, a)
