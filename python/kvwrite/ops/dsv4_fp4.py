"""`store_dsv4_kv_fp4`: DeepSeek V4's FP4 KV records (the FP4 twins of `store_dsv4_kv`'s 584-byte
fp8 record), uint8 `[num_pages, pool_page_size * token_bytes]`, no page padding. `fmt`:

  - "nvfp4", 384 bytes a token (FlashInfer `nvfp4_quantize_append_sparse_mla_cache`, SGLang's
    NVFP4 V4 pool, vLLM `nvfp4_fi_ds_mla`): page p holds its pool_page_size data rows of 352
    bytes (row o at o*352: 224 bytes of packed e2m1 for the 448 NoPE values, then the 64 RoPE
    values as bf16), then its scale rows of 32 bytes (row o at pool_page_size*352 + o*32: 28
    e4m3 block scales, one per 16 NoPE values, then 4 pad bytes, never written).
  - "nvfp4_v41", 288 bytes (DeepSeek-V4.1, vLLM PR #57344): data rows of 256 bytes (all 512
    values packed e2m1), then scale rows of 32 e4m3 bytes (one per 16 values, scale floored at
    2**-9).
  - "mxfp4", 368 bytes (SGLang `--kv-cache-dtype fp4_e2m1`): one row per token at o*368: 224
    bytes of packed e2m1 NoPE, 14 ue8m0 scales (one per 32 values) + 2 pad bytes, 128 bytes of
    bf16 RoPE.

Packed e2m1: element 2j in the low nibble of byte j. Rounding and special values:
`kvwrite.reference.dsv4_fp4`. DCP shards whole pages, as the other V4 stores.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import FP4_FMTS, FP4_RECORDS, KV_DIM, NOPE, ROPE, FP4Record, fp4_pool_page_size
from kvwrite.geometry import PageGeometry
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Locs, impls

OP = "store_dsv4_kv_fp4"
IMPLS = impls("dsv4_fp4:store_dsv4_kv_fp4", "store_dsv4_fp4:launch", "store_dsv4_kv_fp4")


@dataclass(frozen=True)
class StoreDSV4KVFP4:
    """A validated store_dsv4_kv_fp4 call; `cache` uint8 `[pages, pps * record.token_bytes]`."""

    kv: torch.Tensor
    cache: torch.Tensor
    record: FP4Record
    geometry: PageGeometry
    locs: Locs
    check: Check


def _pages(env: dict, v: dict) -> None:
    fmt = env["fmt"] = validate.choice("fmt", v["fmt"], FP4_FMTS)
    env["S"] = fp4_pool_page_size("cache", env["B"], fmt, v["page_size"])


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> StoreDSV4KVFP4:
    return StoreDSV4KVFP4(v["kv"], v["cache"], FP4_RECORDS[env["fmt"]], env["geometry"], locs, chk)


SPEC = spec.Op(
    OP,
    args=(spec.T("kv", f"N {KV_DIM}", validate.FLOAT_INPUTS, binds="N",
                 what=f"tokens, {NOPE} NoPE + {ROPE} RoPE values"),
          spec.cache("cache", "P B", (torch.uint8,)), spec.LOC, spec.option("page_size", "int?"),
          spec.option("fmt"), spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND),
    checks=("kv", "cache", _pages, spec.geometry("cache")),
    build=_build, impls=IMPLS, dcp_page=True, page_table=False)


def store_dsv4_kv_fp4(kv: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *, fmt: str = "nvfp4",
                      page_size: int | None = None, check: str | None = None,
                      errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                      dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """Quantise token i's `kv[i]` `[512]` (448 NoPE then 64 RoPE; bf16/fp16/fp32, may be strided
    along tokens) into the FP4 record `fmt` ("nvfp4" 384 bytes, "nvfp4_v41" 288, "mxfp4" 368;
    module doc) at `loc[i]` (-1 = padding). `page_size`: tokens per page (checked against the page
    bytes; None derives it). `loc_map`, DCP and `check` as `store_dsv4_kv`. Read back with
    `kvwrite.dequant_dsv4_kv_fp4`."""
    return SPEC.entry(kv, cache, loc, page_size, fmt, check, errors, loc_map, dcp_rank, dcp_size, backend)
