"""DeepSeek V4 caches: FlashMLA MODEL1 sparse-fp8 KV pages, the c4 indexer cache (fp8 / MXFP4),
compressed- and state-loc rules, and the compress-state row store.
Formats (KV pages, indexer cache, DCP by page): `kvwrite.reference.dsv4`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import (FP8_BLOCK, INDEXER_FMT_CODE, INDEXER_FMTS, KV_DIM, MXFP4_BLOCK, NOPE, PAGE_ALIGN, RATIOS,
                           ROPE, TOKEN_BYTES, indexer_pool_page_size, kv_pool_page_size)
from kvwrite.facts import indexer_row_bytes, kv_page_bytes  # noqa: F401  (re-exported)
from kvwrite.geometry import PageGeometry, require_positive_int
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs, impls
from kvwrite.ops.indexer_k import StoreIndexerK


KV_IMPLS = impls("dsv4:store_dsv4_kv", "store_dsv4:launch_kv", "store_dsv4_kv")
# fp8 indexer rows are `store_indexer_k`'s format: its reference and Triton kernel, our binding.
INDEXER_FP8_IMPLS = impls("indexer_k:store_indexer_k", "store_indexer_k:launch", "store_dsv4_indexer_k")
INDEXER_MXFP4_IMPLS = impls("dsv4:store_dsv4_indexer_k", "store_dsv4:launch_indexer_mxfp4",
                            "store_dsv4_indexer_k")
ROWS_IMPLS = impls("dsv4:store_rows", "store_dsv4:launch_rows", "store_rows")

# --- store_dsv4_kv -------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreDSV4KV:
    """A validated store_dsv4_kv call; `cache` is uint8 `[pages, kv_page_bytes(pps)]`."""

    kv: torch.Tensor
    cache: torch.Tensor
    geometry: PageGeometry
    locs: Locs
    check: Check


# the smallest page size whose page holds B bytes (kv_page_bytes is increasing), or page_size
@spec.rule(expr=f"$page_size == None || (isint($page_size) && $page_size >= 1); pps = $page_size == None ? "
                f"((B + {PAGE_ALIGN - 1}) / {PAGE_ALIGN} - 1) * {PAGE_ALIGN} / {TOKEN_BYTES} + 1 : $page_size; "
                f"(pps * {TOKEN_BYTES} + {PAGE_ALIGN - 1}) / {PAGE_ALIGN} * {PAGE_ALIGN} == B; S = pps")
def _kv_pages(env: dict, v: dict) -> None:
    env["S"] = kv_pool_page_size("cache", env["B"], v["page_size"])


def _build_kv(v: dict, env: dict, locs: Locs, chk: Check) -> StoreDSV4KV:
    return StoreDSV4KV(v["kv"], v["cache"], env["geometry"], locs, chk)


TAIL = (spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND)
KV_SPEC = spec.Op(
    "store_dsv4_kv",
    args=(spec.T("kv", f"N {KV_DIM}", validate.FLOAT_INPUTS, binds="N",
                 what=f"tokens, {NOPE} NoPE + {ROPE} RoPE values"),
          spec.cache("cache", "P B", (torch.uint8,)), spec.LOC, spec.option("page_size", "int?"), *TAIL),
    checks=("kv", "cache", _kv_pages, spec.geometry("cache")),
    build=_build_kv, impls=KV_IMPLS, dcp_page=True, page_table=False, raw_args={"pool_page_size": "e:S"})


def store_dsv4_kv(kv: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *,
                  page_size: int | None = None, check: str | None = None,
                  errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                  dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """Quantise token i's `kv[i]` `[512]` (448 NoPE then 64 RoPE; bf16/fp16/fp32, may be strided
    along tokens) into the FlashMLA MODEL1 page format (`kvwrite.reference.dsv4`) at `loc[i]` (-1 = padding).
    `page_size`: tokens per page of this cache (checked against its page bytes; None derives it).
    `loc_map` (full -> SWA loc) as in `store_kv`; DCP shards whole pages (also there)."""
    return KV_SPEC.entry(kv, cache, loc, page_size, check, errors, loc_map, dcp_rank, dcp_size, backend)


# --- store_dsv4_indexer_k --------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreDSV4IndexerK(StoreIndexerK):
    """A validated store_dsv4_indexer_k call (a StoreIndexerK: fp8 rows run its reference and kernel)."""

    fmt: str = "fp8"

    @property
    def fmt_code(self) -> int:
        return INDEXER_FMT_CODE[self.fmt]


@spec.rule(expr=f"$fmt == 'fp8' || $fmt == 'mxfp4'; fmt = $fmt == 'fp8' ? {INDEXER_FMT_CODE['fp8']} : "
                f"{INDEXER_FMT_CODE['mxfp4']}; block = $fmt == 'fp8' ? {FP8_BLOCK} : {MXFP4_BLOCK}; "
                "D != 0 && D % block == 0; $scale_fmt == None || ($scale_fmt == 'ue8m0' && $fmt == 'fp8')")
def _indexer_fmt(env: dict, v: dict) -> None:
    fmt = env["fmt"] = validate.choice("fmt", v["fmt"], INDEXER_FMTS)
    block = FP8_BLOCK if fmt == "fp8" else MXFP4_BLOCK
    d = env["D"]
    if d == 0 or d % block:
        raise ValueError(f"index_k's head dim ({d}) must be a positive multiple of {block} for fmt={fmt!r}")
    scale_fmt = v["scale_fmt"]
    if scale_fmt not in (None, "ue8m0"):
        raise ValueError(f"scale_fmt must be None or 'ue8m0', got {scale_fmt!r}")
    if fmt == "mxfp4" and scale_fmt is not None:
        raise ValueError("scale_fmt applies to fmt='fp8' only (mxfp4 scales are always ue8m0)")


@spec.rule(expr=spec.records_per_page(f"$fmt == 'fp8' ? D + D / {FP8_BLOCK} * 4 : D / 2 + D / {MXFP4_BLOCK}"))
def _indexer_pages(env: dict, v: dict) -> None:
    env["S"] = indexer_pool_page_size("cache", env["B"], env["D"], env["fmt"], v["page_size"])


def _build_indexer(v: dict, env: dict, locs: Locs, chk: Check) -> StoreDSV4IndexerK:
    fmt = env["fmt"]
    return StoreDSV4IndexerK(v["k"], v["cache"], FP8_BLOCK if fmt == "fp8" else MXFP4_BLOCK,
                             v["scale_fmt"] == "ue8m0", env["geometry"], locs, chk, fmt)


@spec.when(f"fmt == {INDEXER_FMT_CODE['fp8']}")
def _indexer_fp8(env: dict) -> bool:
    return env["fmt"] == "fp8"


# fp8 and mxfp4 run their own Python-path kernels; the C++ fast path one raw kernel for both.
INDEXER_FORMATS = (spec.Format(INDEXER_FP8_IMPLS, _indexer_fp8), spec.Format(INDEXER_MXFP4_IMPLS))


# The public function names its input `index_k`; the schema's `k` (errors say index_k).
INDEXER_SPEC = spec.Op(
    "store_dsv4_indexer_k",
    args=(spec.T("k", "N D", validate.FLOAT_INPUTS), spec.cache("cache", "P B", (torch.uint8,)), spec.LOC,
          spec.option("page_size", "int?"), spec.option("fmt"), spec.option("scale_fmt", "str?"), *TAIL),
    checks=("k", _indexer_fmt, "cache", _indexer_pages, spec.geometry("cache")), aliases={"k": "index_k"},
    build=_build_indexer, impls=INDEXER_FORMATS, dcp_page=True, page_table=False, raw="store_dsv4_indexer_k",
    raw_args={"pool_page_size": "e:S", "fmt_code": "e:fmt", "ue8m0": "n:scale_fmt"})


def store_dsv4_indexer_k(index_k: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *,
                         page_size: int | None = None, fmt: str = "fp8",
                         scale_fmt: str | None = None, check: str | None = None,
                         errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                         dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """Quantise token i's indexer key `index_k[i]` `[D]` into the c4 indexer cache at `loc[i]`
    (a c4 loc; -1 = padding). `fmt` "fp8" (D % 128 == 0; `scale_fmt="ue8m0"`: vLLM's
    power-of-two scale) or "mxfp4" (D % 32 == 0); page layouts in `kvwrite.reference.dsv4`. `page_size`
    checked against the page bytes (None derives it); DCP shards whole pages."""
    return INDEXER_SPEC.entry(index_k, cache, loc, page_size, fmt, scale_fmt, check, errors, loc_map,
                              dcp_rank, dcp_size, backend)


# --- store_rows -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StoreRows:
    """A validated store_rows call: `pool` `[rows, W]`, `src` `[N, W]` of the same dtype."""

    src: torch.Tensor
    pool: torch.Tensor
    geometry: PageGeometry
    locs: Locs
    check: Check


ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.uint8, torch.int32, torch.int64)


@spec.rule(expr="!(size($pool, 0) > 1 && size($pool, 1) > 0 && stride($pool, 0) < size($pool, 1)); "
                "P = size($pool, 0); S = 1")
def _no_overlap(env: dict, v: dict) -> None:
    pool = v["pool"]
    if pool.shape[0] > 1 and pool.shape[1] > 0 and pool.stride(0) < pool.shape[1]:
        raise ValueError(f"pool rows must not overlap, got strides {pool.stride()}")
    env["P"], env["S"] = pool.shape[0], 1


def _build_rows(v: dict, env: dict, locs: Locs, chk: Check) -> StoreRows:
    return StoreRows(v["src"], v["pool"], env["geometry"], locs, chk)


ROWS_SPEC = spec.Op(
    "store_rows",
    args=(spec.T("src", "N W", ("=pool",), binds="N", what="tokens, the pool's row width"),
          spec.cache("pool", "R W", ROW_DTYPES), spec.LOC, *TAIL),
    checks=("pool", "src", _no_overlap, spec.geometry("pool")),
    build=_build_rows, impls=ROWS_IMPLS, dcp_page=True, page_table=False)


def store_rows(src: torch.Tensor, pool: torch.Tensor, loc: torch.Tensor, *,
               check: str | None = None, errors: ErrorBuffer | None = None,
               loc_map: torch.Tensor | None = None, dcp_rank: int = 0, dcp_size: int = 1,
               backend: str = "auto") -> None:
    """Copy row i of `src` `[N, W]` into row `loc[i]` of `pool` `[rows, W]` (same dtype; a
    compress-state pool, loc from `state_loc`). -1 is padding and is skipped: SGLang writes a -1
    state loc into the pool's last (sentinel) row and clears that row right after, so skipping
    leaves the same pool. Every check mode; under DCP row r lives on rank r % dcp_size (pages of
    one row)."""
    return ROWS_SPEC.entry(src, pool, loc, check, errors, loc_map, dcp_rank, dcp_size, backend)


# --- loc rules --------------------------------------------------------------------------------------

def compressed_loc(loc: torch.Tensor, positions: torch.Tensor, ratio: int) -> torch.Tensor:
    """The c4 / c128 loc of each token (int64): the token at `positions[i]` emits a compressed
    row at `loc[i] // ratio` when `(positions[i] + 1) % ratio == 0`, else -1 (no row). loc -1
    gives -1; any other negative loc is passed through unchanged so the store's check reports it.
    With the c4 / c128 page of page_size // ratio rows, the compressed page equals loc's page.
    Elementwise on the device, no host sync."""
    ratio = require_positive_int("ratio", ratio)
    loc = validate.tensor("loc", loc, ndim=1, dtypes=validate.LOC_DTYPES)
    positions = validate.tensor("positions", positions, ndim=1, dtypes=validate.LOC_DTYPES,
                                device=loc.device)
    validate.shape("positions", positions, (loc.shape[0],), "one position per loc")
    loc = loc.to(torch.int64)
    emit = torch.remainder(positions.to(torch.int64) + 1, ratio) == 0
    out = torch.where(loc >= 0, torch.div(loc, ratio, rounding_mode="floor"), loc)
    return torch.where(emit & (loc != -1), out, torch.full_like(loc, -1))


def state_loc(swa_loc: torch.Tensor, swa_page_size: int, ring: int) -> torch.Tensor:
    """The compress-state row of each SWA loc (int64): `(swa_loc // swa_page_size) * ring +
    swa_loc % ring` (ring 8 for c4 / 128 for c128, 16 / 256 with speculative decoding;
    swa_page_size is SGLang's SWA page, the window of 128). -1 gives -1; any other negative loc
    is passed through unchanged (SGLang maps it to -1) so the store's check reports it."""
    swa_page_size = require_positive_int("swa_page_size", swa_page_size)
    ring = require_positive_int("ring", ring)
    swa_loc = validate.tensor("swa_loc", swa_loc, ndim=1, dtypes=validate.LOC_DTYPES).to(torch.int64)
    rows = (torch.div(swa_loc, swa_page_size, rounding_mode="floor") * ring
            + torch.remainder(swa_loc, ring))
    return torch.where(swa_loc >= 0, rows, swa_loc)


def state_ring(ratio: int, speculative: bool = False) -> int:
    """SGLang's compress-state ring size: c4 8 (16 speculative), c128 128 (256 speculative)."""
    if ratio not in RATIOS:
        raise ValueError(f"ratio must be one of {RATIOS}, got {ratio!r}")
    return (16 if speculative else 8) if ratio == 4 else (256 if speculative else 128)


def state_row_width(ratio: int, head_dim: int) -> int:
    """Elements of one compress-state row: 2 * (1 + overlap) * head_dim, overlap 1 for c4."""
    if ratio not in RATIOS:
        raise ValueError(f"ratio must be one of {RATIOS}, got {ratio!r}")
    return 2 * (2 if ratio == 4 else 1) * head_dim
