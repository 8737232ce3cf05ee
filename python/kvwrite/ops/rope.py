"""`rope_store_kv` / `rope_store_mla`: RoPE (+ q/k RMS norm) fused with the paged K/V store, each
declared with its store's arguments and rules (`store_kv`'s formats, `store_mla`'s) plus the
rotation's (q, positions, the cos/sin cache). Exact arithmetic and rounding: `kvwrite.reference.rope`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import validate
from kvwrite.errors import ErrorBuffer
from kvwrite.facts import (FMT_E4M3, FMT_E5M2, FMT_INT8, KV_LAYOUTS, QUANT_COPY, QUANT_HEAD, QUANT_STATIC,
                           QUANT_TOKEN)
from kvwrite.ops import kv, mla, spec
from kvwrite.ops._common import Check, Fused, Locs, impls
from kvwrite.ops.kv import KVStore
from kvwrite.ops.mla import StoreMLA

OP_KV = "rope_store_kv"
MAX_HEAD_DIM = 1024   # csrc/kvwrite/rope_store.h ROPE_MAX_DIM
KV_IMPLS = impls("rope:rope_store_kv", "rope_store:launch_kv", "rope_store_kv")
KV_QUANT_IMPLS = impls("rope:rope_store_kv", "rope_store:launch_kv", "rope_store_kv_quant")
MLA_IMPLS = impls("rope:rope_store_mla", "rope_store:launch_mla", "rope_store_mla")
# The K/V formats the fused kernels store: copy, static fp8 / int8, dynamic int8 / fp8.
KV_QUANTS = (QUANT_COPY, QUANT_STATIC, QUANT_TOKEN, QUANT_HEAD)
KV_FMTS = (FMT_E4M3, FMT_E5M2, FMT_INT8)


@dataclass(frozen=True)
class RopeStoreKV(Fused):
    q_norm_weight: torch.Tensor | None   # fp32 [D]
    k_norm_weight: torch.Tensor | None
    eps: float
    store: KVStore


@dataclass(frozen=True)
class RopeStoreMLA(Fused):
    store: StoreMLA


# --- the rotation's checks (C++ twins: their expressions) -------------------------------------

def _rotary(env: dict, rotary_dim: int, head_dim: int, head: str) -> None:
    """At least one position; rotary_dim even, in [2, head_dim]; head_dim within the kernels' rows."""
    if env["M"] < 1:
        raise ValueError("cos_sin_cache must have at least one position")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, {head} head_dim={head_dim}], got {rotary_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{head} head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")


def _rotary_expr(head_dim: str) -> str:
    """_rotary's C++ twin: w the rotary width of cos_sin_cache `[M, w]`, `head_dim` a letter."""
    return (f"w = size($cos_sin_cache, 1); size($cos_sin_cache, 0) >= 1 && w >= 2 && w % 2 == 0 && "
            f"w <= {head_dim} && {head_dim} <= {MAX_HEAD_DIM}")


@spec.rule(expr="$rotary_dim == None || (isint($rotary_dim) && $rotary_dim == size($cos_sin_cache, 1)); "
                + _rotary_expr("D"))
def _kv_dims(env: dict, v: dict) -> None:
    """cos_sin_cache `[max_position >= 1, rotary_dim]`; rotary_dim even, <= k's head_dim."""
    width = env["C"]
    rotary_dim = width if v["rotary_dim"] is None else v["rotary_dim"]
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, (int, torch.SymInt)):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim != width:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}] (cos half, "
                         f"then sin half), got {list(v['cos_sin_cache'].shape)}")
    _rotary(env, width, env["D"], "k")


@spec.rule(expr=_rotary_expr("R"))
def _mla_dims(env: dict, v: dict) -> None:
    """cos_sin_cache `[max_position >= 1, R]`: the whole k_pe rotates."""
    _rotary(env, env["R"], env["R"], "k_pe")


@spec.rule(expr="isbool($is_neox)")
def _neox(env: dict, v: dict) -> None:
    """is_neox a bool."""
    if not isinstance(v["is_neox"], bool):
        raise TypeError(f"is_neox must be a bool, got {type(v['is_neox']).__name__}")


@spec.rule(expr="!isbool($norm_eps) && $norm_eps >= 0")
def _norm_eps(env: dict, v: dict) -> None:
    """norm_eps (the K/V op's RMS norm) a float >= 0."""
    eps = v["norm_eps"]
    if isinstance(eps, bool) or not isinstance(eps, (int, float, torch.SymFloat)) or not eps >= 0:
        raise ValueError(f"norm_eps must be a float >= 0, got {eps!r}")


@spec.rule(expr=f"quant >= {min(KV_QUANTS)} && quant <= {max(KV_QUANTS)}; quant == {QUANT_COPY} || k_cache == int8 || "
                "k_cache == float8_e4m3fn || k_cache == float8_e5m2")
def _kv_format(env: dict, v: dict) -> None:
    """The K/V formats the fused kernels have (any other is refused)."""
    if env["quant"] not in KV_QUANTS or (env["quant"] != QUANT_COPY and env["fmt"] not in KV_FMTS):
        raise TypeError(f"k_cache: {OP_KV} stores no {env['k_cache']} cache")


def _f32(w: torch.Tensor | None) -> torch.Tensor | None:
    """A norm weight as the kernels read it (fp32; one in the input dtype converted)."""
    return w if w is None or w.dtype == torch.float32 else w.float()


# --- rope_store_kv ------------------------------------------------------------------------------

def _build_kv(v: dict, env: dict, locs: Locs, chk: Check) -> RopeStoreKV:
    return RopeStoreKV(v["q"], v["positions"], v["cos_sin_cache"], env["C"], v["is_neox"],
                       _f32(v["q_norm_weight"]), _f32(v["k_norm_weight"]), float(v["norm_eps"]),
                       kv._build(v, env, locs, chk))


# store_kv's formats (no int4): copy / static fp8 on rope_store_kv's kernels, the rest on
# rope_store_kv_quant's (store_kv_quant's row writers).
KV_FORMATS = (spec.Format(KV_IMPLS, kv.plain), spec.Format(KV_QUANT_IMPLS))


POSITIONS = spec.T("positions", "N", validate.LOC_DTYPES, what="one position per token")
CACHE_DIMS = "num_pages, pool_page_size, H, D"
KV_SPEC = spec.Op(
    OP_KV,
    args=(POSITIONS,
          spec.T("q", "N Hq D", ("=k",), mutable=True, what="tokens as k, q heads, head_dim as k"),
          *kv.SPEC.args[:2],   # store_kv's k and v
          spec.T("cos_sin_cache", "M C", (torch.float32, "=k"), what="max_position, rotary_dim"),
          spec.cache("k_cache", "P S H D", ("=k", *spec.FP8, torch.int8), binds="P S", layout=True,
                     what=CACHE_DIMS),
          spec.cache("v_cache", "P S H Dv", ("=k_cache",), layout=True, what=CACHE_DIMS),
          spec.LOC, spec.option("is_neox", "bool"), spec.option("rotary_dim", "int?"),
          spec.opt("q_norm_weight", "D", (torch.float32, "=k"), what="head_dim"),
          spec.opt("k_norm_weight", "D", (torch.float32, "=k"), what="head_dim"),
          spec.option("norm_eps", "float"), spec.option("layout"),
          spec.opt("k_scale", "scale H", role="scale"), spec.opt("v_scale", "scale H", role="scale"),
          spec.opt("k_scale_cache", mutable=True, role="cache"),
          spec.opt("v_scale_cache", mutable=True, role="cache"),
          spec.CHECK, spec.ERRORS, spec.LOC_MAP, *spec.DCP, spec.BACKEND,
          spec.option("quant_rule", "str?", default=None)),
    checks=("k", "v", spec.choice("layout", KV_LAYOUTS[:2]), "k_cache", "v_cache", spec.geometry("k_cache"),
            kv._quant, _kv_format, "k_scale", "v_scale", "q", "positions", "cos_sin_cache", _kv_dims,
            "q_norm_weight", "k_norm_weight", _neox, _norm_eps),
    build=_build_kv, impls=KV_FORMATS, raw_args={"cos_sin": "a:cos_sin_cache", "eps": "a:norm_eps"})


def rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  loc: torch.Tensor, *, is_neox: bool = True, rotary_dim: int | None = None,
                  q_norm_weight: torch.Tensor | None = None,
                  k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  layout: str = "NHD", k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, k_scale_cache: torch.Tensor | None = None,
                  v_scale_cache: torch.Tensor | None = None, check: str | None = None,
                  errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                  dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto",
                  quant_rule: str = "rne") -> None:
    """Rotate q `[N, Hq, D]` in place and store rotated k `[N, H, D]` with v `[N, H, Dv]` at `loc`.

    `positions` int32/int64 `[N]`; `cos_sin_cache` `[max_position, rotary_dim]` (cos half, then
    sin half; fp32 or the input dtype); `rotary_dim` (default: the cache's width, even, <= D)
    rotates the first rotary_dim elements of each head, neox halves (`is_neox=True`) or GPT-J
    interleaved pairs. `q_norm_weight` / `k_norm_weight` `[D]` (fp32 or the input dtype): RMS-norm
    each head first (`norm_eps`). Rounding: once, to the input dtype, after norm + rotation in fp32
    (exact order in `kvwrite.reference.rope`); the stored k is that rounded k, stored as the K/V
    store stores it. Caches and `layout` ("NHD" | "HND"), `k_scale`/`v_scale` (static fp8/int8),
    `k_scale_cache`/`v_scale_cache` (dynamic int8/fp8, `[pages, pool_page_size]` or
    `[pages, pool_page_size, H]`) and `quant_rule`, `check`, `errors`, `loc` (a PageTable too),
    `loc_map`, `dcp_rank`/`dcp_size`: as in `store_kv`. A position outside [0, max_position) is a
    KIND_POSITION error (assert/guard); that token is never written and its q is left as it was
    (every mode). k and v are not modified.
    """
    return KV_SPEC.entry(positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, is_neox, rotary_dim,
                         q_norm_weight, k_norm_weight, norm_eps, layout, k_scale, v_scale, k_scale_cache,
                         v_scale_cache, check, errors, loc_map, dcp_rank, dcp_size, backend,
                         None if quant_rule == "rne" else quant_rule)


# --- rope_store_mla -----------------------------------------------------------------------------

def _build_mla(v: dict, env: dict, locs: Locs, chk: Check) -> RopeStoreMLA:
    return RopeStoreMLA(v["q_pe"], v["positions"], v["cos_sin_cache"], env["R"], v["is_neox"],
                        mla._build(v, env, locs, chk))


MLA_SPEC = spec.Op(
    "rope_store_mla",
    args=(POSITIONS,
          spec.T("q_pe", "N Hq R", ("=kv_c",), mutable=True, what="tokens as k_pe, q heads, rope_dim as k_pe"),
          *mla.SPEC.args[:2],
          spec.T("cos_sin_cache", "M R", (torch.float32, "=kv_c"), what="max_position, rope_dim of k_pe"),
          *mla.SPEC.args[2:3], spec.LOC, spec.option("is_neox", "bool"), *mla.SPEC.args[4:]),
    checks=(*mla.SPEC.checks, "q_pe", "positions", "cos_sin_cache", _mla_dims, _neox),
    build=_build_mla, impls=MLA_IMPLS, raw_args={"q": "a:q_pe", "cos_sin": "a:cos_sin_cache", "kernel_mode": "e:fmt"})


def rope_store_mla(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                   k_pe: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                   loc: torch.Tensor, *, is_neox: bool = False, kv_cache_dtype: str = "auto",
                   scale: torch.Tensor | None = None, check: str | None = None,
                   errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                   dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto",
                   scale_cache: torch.Tensor | None = None,
                   global_scale: torch.Tensor | None = None) -> None:
    """Rotate q_pe `[N, Hq, R]` in place and store the row of kv_c `[N, L]` and rotated k_pe
    `[N, R]` at `loc`. `cos_sin_cache` `[max_position, R]`; `is_neox` False = GPT-J pairs
    (DeepSeek's default). `kv_cache_dtype`: every MLA store format — "auto", "fp8" (= "fp8_e4m3",
    per-tensor `scale`), "fp8_e5m2", "fp8_ds_mla", "nvfp4" (`scale_cache`, optional
    `global_scale`). The rotated k_pe is rounded once to the input dtype (fp32 rotation, no fma),
    then stored exactly as `store_mla` stores a k_pe. Positions, checks, `loc_map`, DCP: as for
    the K/V op above. kv_c and k_pe are not modified."""
    return MLA_SPEC.entry(positions, q_pe, kv_c, k_pe, cos_sin_cache, kv_cache, loc, is_neox,
                          "fp8_e4m3" if kv_cache_dtype == "fp8" else kv_cache_dtype, scale, check, errors,
                          loc_map, dcp_rank, dcp_size, backend, scale_cache, global_scale)
