"""`store_indexer_k`: the DSA (DeepSeek V3.2 sparse attention) indexer key cache store (cache layout:
`kvwrite.reference.indexer_k`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import indexer_k_pool_page_size as pool_page_size
from kvwrite.facts import indexer_k_row_bytes as row_bytes  # noqa: F401  (re-exported)
from kvwrite.geometry import PageGeometry, require_positive_int
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs, impls

IMPLS = impls("indexer_k:store_indexer_k", "store_indexer_k:launch", "store_indexer_k")
SCALE_FMTS = (None, "ue8m0")


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


@spec.rule(expr="isint($quant_block_size) && $quant_block_size > 0; D % $quant_block_size == 0; "
                "$scale_fmt == None || $scale_fmt == 'ue8m0'")
def _block(env: dict, v: dict) -> None:
    """quant_block_size divides D; scale_fmt; the page holds whole tokens (letters P, S)."""
    qbs = require_positive_int("quant_block_size", v["quant_block_size"])
    if env["D"] % qbs:
        raise ValueError(f"k's head dim ({env['D']}) must be a multiple of quant_block_size ({qbs})")
    if v["scale_fmt"] not in SCALE_FMTS:
        raise ValueError(f"scale_fmt must be one of {SCALE_FMTS}, got {v['scale_fmt']!r}")


@spec.rule(expr="per = D + D / $quant_block_size * 4; B > 0 && B % per == 0; S = B / per")
def _pages(env: dict, v: dict) -> None:
    env["S"] = pool_page_size("cache", env["B"], env["D"], v["quant_block_size"])


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> StoreIndexerK:
    return StoreIndexerK(v["k"], v["cache"], v["quant_block_size"], v["scale_fmt"] == "ue8m0",
                         env["geometry"], locs, chk)


# SGLang's indexer cache is replicated (addressed by the virtual loc, dcp_size=1); vLLM shards it
# over the DCP ranks like the MLA cache (dcp_rank / dcp_size: the virtual loc -> this rank's row).
SPEC = spec.Op(
    "store_indexer_k",
    args=(spec.T("k", "N D", validate.FLOAT_INPUTS),
          spec.cache("cache", "P B", (torch.uint8,)),
          spec.LOC, spec.option("quant_block_size", "int"), spec.option("scale_fmt", "str?"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND),
    checks=("k", _block, "cache", _pages, spec.geometry("cache")),
    build=_build, impls=IMPLS, raw_args={"ue8m0": "n:scale_fmt"})


def store_indexer_k(k: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *,
                    quant_block_size: int = 128, scale_fmt: str | None = None,
                    check: str | None = None, errors: ErrorBuffer | None = None,
                    loc_map: torch.Tensor | None = None, dcp_rank: int = 0, dcp_size: int = 1,
                    backend: str = "auto") -> None:
    """Quantise token i's indexer key `k[i]` `[D]` per `quant_block_size` block to e4m3 and
    store it with its fp32 scales at `loc[i]` (-1 = padding, skipped); see `kvwrite.reference.indexer_k`
    for the page layout. `scale_fmt="ue8m0"` rounds each scale up to a power of two.
    The pool page size is `cache.shape[1] // (D + D/qbs*4)`. `loc_map` translates as in
    `store_kv`; `dcp_rank` / `dcp_size` as in `store_kv`: a cache sharded over the DCP ranks
    (vLLM's) keeps virtual loc v at row v // dcp_size on rank v % dcp_size; SGLang's replicated
    cache is addressed by the virtual loc (dcp_size=1).
    """
    return SPEC.entry(k, cache, loc, quant_block_size, scale_fmt, check, errors, loc_map, dcp_rank, dcp_size,
                      backend)
