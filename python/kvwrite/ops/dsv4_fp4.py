"""`store_dsv4_kv_fp4`: DeepSeek V4's FP4 KV records (the FP4 twins of `store_dsv4_kv`'s 584-byte
fp8 record; `fmt` "nvfp4", "nvfp4_v41", "mxfp4"). Layouts and encodings: `kvwrite.reference.dsv4_fp4`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import FP4_FMTS, FP4_RECORDS, KV_DIM, NOPE, ROPE, FP4Record, fp4_pool_page_size
from kvwrite.ops import spec
from kvwrite.ops._common import Check, Fused, Locs, impls
from kvwrite.ops.dsv4 import StoreDSV4KV

IMPLS = impls("dsv4_fp4:store_dsv4_kv_fp4", "store_dsv4_fp4:launch", "store_dsv4_kv_fp4")
RAW_ARGS = {"pool_page_size": "e:S", "fmt_code": "e:fmt"}   # the C++ rule's page size and record code


@dataclass(frozen=True)
class StoreDSV4KVFP4(StoreDSV4KV):
    """A validated store_dsv4_kv_fp4 call: `cache` uint8 `[pages, pps * record.token_bytes]`."""

    record: FP4Record

    @property
    def fmt_code(self) -> int:
        return self.record.code


@spec.rule(expr=f"fmt = {spec.switch('fmt', {f: r.code for f, r in FP4_RECORDS.items()})}; fmt >= 0; "
                + spec.records_per_page(spec.switch("fmt", {f: r.token_bytes for f, r in FP4_RECORDS.items()})))
def _pages(env: dict, v: dict) -> None:
    fmt = env["fmt"] = validate.choice("fmt", v["fmt"], FP4_FMTS)
    env["S"] = fp4_pool_page_size("cache", env["B"], fmt, v["page_size"])


def _build(v: dict, env: dict, locs: Locs, chk: Check) -> StoreDSV4KVFP4:
    return StoreDSV4KVFP4(v["kv"], v["cache"], env["geometry"], locs, chk, FP4_RECORDS[env["fmt"]])


SPEC = spec.Op(
    "store_dsv4_kv_fp4",
    args=(spec.T("kv", f"N {KV_DIM}", validate.FLOAT_INPUTS, binds="N",
                 what=f"tokens, {NOPE} NoPE + {ROPE} RoPE values"),
          spec.cache("cache", "P B", (torch.uint8,)), spec.LOC, spec.option("page_size", "int?"),
          spec.option("fmt"), spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND),
    checks=("kv", "cache", _pages, spec.geometry("cache")),
    build=_build, impls=IMPLS, dcp_page=True, page_table=False, raw_args=RAW_ARGS)


def store_dsv4_kv_fp4(kv: torch.Tensor, cache: torch.Tensor, loc: torch.Tensor, *, fmt: str = "nvfp4",
                      page_size: int | None = None, check: str | None = None,
                      errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                      dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """Quantise token i's `kv[i]` `[512]` (448 NoPE then 64 RoPE; bf16/fp16/fp32, may be strided
    along tokens) into the FP4 record `fmt` ("nvfp4" 384 bytes, "nvfp4_v41" 288, "mxfp4" 368;
    `kvwrite.reference.dsv4_fp4`) at `loc[i]` (-1 = padding). `page_size`: tokens per page (checked against the page
    bytes; None derives it). `loc_map`, DCP and `check` as `store_dsv4_kv`. Read back with
    `kvwrite.dequant_dsv4_kv_fp4`."""
    return SPEC.entry(kv, cache, loc, page_size, fmt, check, errors, loc_map, dcp_rank, dcp_size, backend)


# --- rope_store_dsv4_kv_fp4 ------------------------------------------------------------------------

ROPE_IMPLS = impls("dsv4_fp4:rope_store_dsv4_kv_fp4", "store_dsv4_fp4:launch_rope", "rope_store_dsv4_kv_fp4")
ROPE_FMTS = tuple(f for f, r in FP4_RECORDS.items() if r.rope)   # records with a bf16 RoPE part


@dataclass(frozen=True)
class RopeStoreDSV4KVFP4(Fused):
    """A validated rope_store_dsv4_kv_fp4 call: the GPT-J rotation, then the store."""

    store: StoreDSV4KVFP4


@spec.rule(expr=" && ".join(f"$fmt != '{f}'" for f in FP4_FMTS if f not in ROPE_FMTS))
def _rope_fmt(env: dict, v: dict) -> None:
    if v["fmt"] in FP4_FMTS and v["fmt"] not in ROPE_FMTS:
        raise ValueError(f"fmt={v['fmt']!r} quantises the RoPE values with the rest: the fused RoPE store takes "
                         f"fmt in {ROPE_FMTS}")


def _build_rope(v: dict, env: dict, locs: Locs, chk: Check) -> RopeStoreDSV4KVFP4:
    return RopeStoreDSV4KVFP4(v["q"], v["positions"], v["cos_sin"], ROPE, False, _build(v, env, locs, chk))


ROPE_SPEC = spec.Op(
    "rope_store_dsv4_kv_fp4",
    args=(spec.T("positions", "N", validate.LOC_DTYPES, binds="N", what="one position per token"),
          spec.T("kv", f"N {KV_DIM}", validate.FLOAT_INPUTS, what=f"tokens, {NOPE} NoPE + {ROPE} RoPE values"),
          spec.T("cos_sin", f"M {ROPE}", (torch.float32, "=kv"), what=f"max_position, {ROPE // 2} cos then "
                 f"{ROPE // 2} sin"),
          spec.opt("q", f"N Hq {ROPE}", ("=kv",), mutable=True, what=f"tokens, heads, {ROPE} RoPE values"),
          *SPEC.args[1:]),   # the store's, from its cache on
    checks=("positions", "kv", "cos_sin", "q", _rope_fmt, "cache", _pages, spec.geometry("cache")),
    build=_build_rope, impls=ROPE_IMPLS, dcp_page=True, page_table=False, raw_args=RAW_ARGS)


def rope_store_dsv4_kv_fp4(positions: torch.Tensor, kv: torch.Tensor, cos_sin: torch.Tensor,
                           cache: torch.Tensor, loc: torch.Tensor, *, q: torch.Tensor | None = None,
                           fmt: str = "nvfp4", page_size: int | None = None, check: str | None = None,
                           errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                           dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """GPT-J RoPE + FP4 record store in one launch (FlashInfer's
    `cake_dsv4_nvfp4_kv_rope_quantize_insert`; with `q`, `cake_dsv4_nvfp4_rope_quantize_insert`):
    token i's 64 RoPE values `kv[i, 448:]` are rotated by `cos_sin[positions[i]]` (`[max_position,
    64]`: 32 cos then 32 sin, fp32 or kv's dtype; pairs (2j, 2j+1)), rounded to kv's dtype, and
    the row is stored exactly as `store_dsv4_kv_fp4` stores it (bytes equal to rotating in torch,
    then storing). `q` `[N, Hq, 64]` (kv's dtype, optional): the queries' RoPE part, rotated in
    place for every token with a valid position. `fmt` "nvfp4" or "mxfp4" (the records that keep
    the RoPE part in bf16). A position outside [0, max_position) is a bad token (never written)
    in every check mode, recorded like a bad loc. Other arguments as `store_dsv4_kv_fp4`."""
    return ROPE_SPEC.entry(positions, kv, cos_sin, q, cache, loc, page_size, fmt, check, errors, loc_map,
                           dcp_rank, dcp_size, backend)
