"""`rope_store_kv` / `rope_store_mla`: RoPE (+ q/k RMS norm) fused with the paged K/V store.

q is rotated in place for every token whose position is valid (whatever its loc: padding, another
DCP rank's, a bad loc); k is normed, rotated and stored with v (`store_kv`'s formats, int8 / fp8
static or dynamic scales); for MLA k_pe is rotated and stored with kv_c (`store_mla`'s formats).
Positions are checked against the cos/sin cache: outside [0, max_position) is a KIND_POSITION
error in assert / guard; in every mode such a token is not written and its q left as it was, and
the cache is never read out of bounds. Exact arithmetic and rounding: `kvwrite.reference.rope`.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kvwrite import _ext, validate
from kvwrite.errors import ErrorBuffer, op_code
from kvwrite.ops import _library
from kvwrite.ops._common import dispatch, impls, record
from kvwrite.facts import FMT_SAME, QUANT_STATIC
from kvwrite.ops.kv import KVStore, prepare_store_kv
from kvwrite.ops.mla import FORMATS, StoreMLA, prepare_store_mla

OP_KV = "rope_store_kv"
OP_MLA = "rope_store_mla"
MAX_HEAD_DIM = 1024
KV_IMPLS = impls("rope:rope_store_kv", "rope_store:launch_kv", "rope_store_kv")
MLA_IMPLS = impls("rope:rope_store_mla", "rope_store:launch_mla", "rope_store_mla")
# every store_mla kv_cache_dtype (fp8_ds_mla options included), and "fp8" for "fp8_e4m3"
MLA_FORMATS = {"fp8": "fp8_e4m3", **{name: name for name in FORMATS}}


class _Fused:
    """A fused call's loc resolution, check and geometry are those of the store it wraps (the
    resolvers and the assert path read them from the call)."""

    @property
    def locs(self):
        return self.store.locs

    @property
    def check(self):
        return self.store.check

    @property
    def geometry(self):
        return self.store.geometry


@dataclass(frozen=True)
class RopeStoreKV(_Fused):
    q: torch.Tensor
    positions: torch.Tensor
    cos_sin: torch.Tensor
    rotary_dim: int
    is_neox: bool
    q_norm_weight: torch.Tensor | None   # fp32 [D]
    k_norm_weight: torch.Tensor | None
    eps: float
    store: KVStore


@dataclass(frozen=True)
class RopeStoreMLA(_Fused):
    q: torch.Tensor          # q_pe [N, Hq, R]
    positions: torch.Tensor
    cos_sin: torch.Tensor
    rotary_dim: int
    is_neox: bool
    store: StoreMLA


# The direct call of the cpu kernel (a call whose tensors the C++ checks accept, CPU tensors,
# backend "auto"/"cpu", check off/guard): no Python validation, the same kernel and bytes as
# the dispatched path. Anything the C++ checks refuse goes the Python way (named errors).
_FAST_BACKENDS = ("auto", "cpu")
_FAST_CHECKS = {"off": 0}   # guard: the Python path, with the duplicate-row pre-pass (ops.claims)
_CANONICAL = {"NHD": lambda c: c, "HND": lambda c: c.transpose(1, 2)}
_OP_KV_CODE = op_code(OP_KV)


def _fast_kv(*args) -> None:
    global _FAST_KV
    _FAST_KV = torch.ops.kvwrite_ext.rope_store_kv.default._op
    _FAST_KV(*args)


_FAST_KV = _fast_kv


def _rope_args(positions, q, head_dim, n, cos_sin_cache, rotary_dim, device, q_name):
    positions = validate.tensor("positions", positions, ndim=1, dtypes=validate.LOC_DTYPES, device=device)
    if positions.shape[0] != n:
        raise ValueError(f"positions must have one entry per token ({n}), got {positions.shape[0]}")
    if n > 1 and positions.stride(0) != 1:
        raise ValueError(f"positions must be contiguous, got stride {positions.stride(0)}")
    cos_sin = validate.tensor("cos_sin_cache", cos_sin_cache, ndim=2,
                              dtypes=tuple({torch.float32, q.dtype}), device=device)
    if cos_sin.shape[0] < 1:
        raise ValueError("cos_sin_cache must have at least one position")
    width = cos_sin.shape[1]
    if rotary_dim is None:
        rotary_dim = width
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise TypeError(f"rotary_dim must be an int, got {type(rotary_dim).__name__}")
    if rotary_dim != width:
        raise ValueError(f"cos_sin_cache must be [max_position, rotary_dim={rotary_dim}] (cos half, "
                         f"then sin half), got {list(cos_sin.shape)}")
    if rotary_dim < 2 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in [2, {q_name} head_dim={head_dim}], got {rotary_dim}")
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"{q_name} head_dim must be at most {MAX_HEAD_DIM}, got {head_dim}")
    return positions, cos_sin, rotary_dim


def _weight(name, w, d, dtype, device):
    if w is None:
        return None
    w = validate.tensor(name, w, ndim=1, dtypes=tuple({torch.float32, dtype}), device=device)
    validate.shape(name, w, (d,), "head_dim")
    return w if w.dtype == torch.float32 and w.stride(0) == 1 else w.float().contiguous()


def prepare_rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, is_neox,
                          rotary_dim, q_norm_weight, k_norm_weight, norm_eps, layout, k_scale,
                          v_scale, k_scale_cache, v_scale_cache, check, errors, loc_map, dcp_rank,
                          dcp_size) -> RopeStoreKV:
    validate.choice("layout", layout, ("NHD", "HND"))
    store = prepare_store_kv(k, v, k_cache, v_cache, loc, layout, k_scale, v_scale, check, errors,
                             loc_map, dcp_rank, dcp_size, k_scale_cache, v_scale_cache, op=OP_KV)
    if store.quant == QUANT_STATIC and store.fmt == FMT_SAME:
        raise TypeError(f"k_cache: rope_store_kv stores no {store.k_cache.dtype} cache")
    n, _, d = store.k.shape
    device = store.k.device
    q = validate.tensor("q", q, ndim=3, dtypes=(store.k.dtype,), device=device)
    validate.shape("q", q, (n, None, d), "tokens as k, q heads, head_dim as k")
    positions, cos_sin, rotary_dim = _rope_args(positions, q, d, n, cos_sin_cache, rotary_dim,
                                                device, "k")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    if isinstance(norm_eps, bool) or not isinstance(norm_eps, (int, float)) or not norm_eps >= 0:
        raise ValueError(f"norm_eps must be a float >= 0, got {norm_eps!r}")
    qw = _weight("q_norm_weight", q_norm_weight, d, q.dtype, device)
    kw = _weight("k_norm_weight", k_norm_weight, d, q.dtype, device)
    return RopeStoreKV(q, positions, cos_sin, rotary_dim, is_neox, qw, kw, float(norm_eps), store)


def prepare_rope_store_mla(positions, q_pe, kv_c, k_pe, cos_sin_cache, kv_cache, loc, is_neox,
                           kv_cache_dtype, scale, check, errors, loc_map, dcp_rank, dcp_size,
                           scale_cache=None, global_scale=None) -> RopeStoreMLA:
    fmt = validate.choice("kv_cache_dtype", kv_cache_dtype, tuple(MLA_FORMATS))
    store = prepare_store_mla(kv_c, k_pe, kv_cache, loc, MLA_FORMATS[fmt], scale, check,
                              errors, loc_map, dcp_rank, dcp_size, scale_cache, global_scale)
    store = StoreMLA(**{**store.__dict__, "check": _op_check(store.check, OP_MLA)})
    n, r = store.k_pe.shape
    device = store.k_pe.device
    q_pe = validate.tensor("q_pe", q_pe, ndim=3, dtypes=(store.k_pe.dtype,), device=device)
    validate.shape("q_pe", q_pe, (n, None, r), "tokens as k_pe, q heads, rope_dim as k_pe")
    positions, cos_sin, rotary_dim = _rope_args(positions, q_pe, r, n, cos_sin_cache, None,
                                                device, "k_pe")
    if not isinstance(is_neox, bool):
        raise TypeError(f"is_neox must be a bool, got {type(is_neox).__name__}")
    return RopeStoreMLA(q_pe, positions, cos_sin, rotary_dim, is_neox, store)


def _traced(check, errors, traced: bool):
    """The check a traced call validates with: as the fake kernels, guard without a buffer as "off"
    (the default buffer is found when the op runs)."""
    return _library.fake_check(validate.check_mode(check), errors) if traced else check


def _tensor(errors):
    return errors.tensor if isinstance(errors, ErrorBuffer) else errors


def _op_check(chk, op):
    from kvwrite.ops._common import Check

    return Check(op, chk.mode, chk.errors)


@torch.library.custom_op("kvwrite::rope_store_kv",
                         mutates_args=("q", "k_cache", "v_cache", "k_scale_cache", "v_scale_cache", "errors"))
def _rope_store_kv_op(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      loc: torch.Tensor, is_neox: bool, rotary_dim: int | None,
                      q_norm_weight: torch.Tensor | None, k_norm_weight: torch.Tensor | None,
                      norm_eps: float, layout: str, k_scale: torch.Tensor | None,
                      v_scale: torch.Tensor | None, k_scale_cache: torch.Tensor | None,
                      v_scale_cache: torch.Tensor | None, check: str | None,
                      errors: torch.Tensor | None, loc_map: torch.Tensor | None, dcp_rank: int,
                      dcp_size: int, backend: str) -> None:
    a = prepare_rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, is_neox,
                              rotary_dim, q_norm_weight, k_norm_weight, norm_eps, layout, k_scale,
                              v_scale, k_scale_cache, v_scale_cache, check, errors, loc_map,
                              dcp_rank, dcp_size)
    if a.locs.n:
        dispatch(OP_KV, KV_IMPLS, backend, k.device, a)


@_rope_store_kv_op.register_fake
def _(*args) -> None:
    return None


def rope_store_kv(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                  cos_sin_cache: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  loc: torch.Tensor, *, is_neox: bool = True, rotary_dim: int | None = None,
                  q_norm_weight: torch.Tensor | None = None,
                  k_norm_weight: torch.Tensor | None = None, norm_eps: float = 1e-6,
                  layout: str = "NHD", k_scale: torch.Tensor | None = None,
                  v_scale: torch.Tensor | None = None, k_scale_cache: torch.Tensor | None = None,
                  v_scale_cache: torch.Tensor | None = None, check: str | None = None,
                  errors: ErrorBuffer | None = None, loc_map: torch.Tensor | None = None,
                  dcp_rank: int = 0, dcp_size: int = 1, backend: str = "auto") -> None:
    """Rotate q `[N, Hq, D]` in place and store rotated k `[N, H, D]` with v `[N, H, Dv]` at `loc`.

    `positions` int32/int64 `[N]`; `cos_sin_cache` `[max_position, rotary_dim]` (cos half, then
    sin half; fp32 or the input dtype); `rotary_dim` (default: the cache's width, even, <= D)
    rotates the first rotary_dim elements of each head, neox halves (`is_neox=True`) or GPT-J
    interleaved pairs. `q_norm_weight` / `k_norm_weight` `[D]`: RMS-norm each head first
    (`norm_eps`). Rounding: once, to the input dtype, after norm + rotation in fp32 (exact order in
    `kvwrite.reference.rope`); the stored k is that rounded k, stored as `store_kv` stores it.
    Caches and `layout`, `k_scale`/`v_scale` (static fp8/int8), `k_scale_cache`/`v_scale_cache`
    (dynamic int8/fp8, `[pages, pool_page_size]` or `[pages, pool_page_size, H]`), `check`,
    `errors`, `loc_map`, `dcp_rank`/`dcp_size`: as in `store_kv`. A position outside
    [0, max_position) is a KIND_POSITION error (assert/guard); that token is never written and
    its q is left as it was (every mode). k and v are not modified.
    """
    if (_ext.LOADED and backend in _FAST_BACKENDS and k_scale_cache is None and v_scale_cache is None
            and type(dcp_rank) is int and type(dcp_size) is int and isinstance(loc, torch.Tensor)
            and isinstance(cos_sin_cache, torch.Tensor) and loc.device.type == "cpu"
            and (rotary_dim is None or rotary_dim == cos_sin_cache.shape[-1])
            and layout in _CANONICAL and not torch.compiler.is_compiling()):
        mode = validate.DEFAULT_CHECK if check is None else check
        code = _FAST_CHECKS.get(mode) if type(mode) is str else None
        if code is not None:
            canon = _CANONICAL[layout]
            try:  # the C++ kernel's own checks run before any write
                return _FAST_KV(positions, q, k, v, cos_sin_cache, canon(k_cache), canon(v_cache),
                                k_scale, v_scale, q_norm_weight, k_norm_weight, norm_eps, is_neox,
                                loc, loc_map, record(errors, mode, k), dcp_rank, dcp_size, code,
                                _OP_KV_CODE)
            except Exception:  # what they refuse, the Python path names (or runs: bf16 weights)
                pass
    traced = torch.compiler.is_compiling()
    a = prepare_rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc, is_neox,
                              rotary_dim, q_norm_weight, k_norm_weight, norm_eps, layout, k_scale,
                              v_scale, k_scale_cache, v_scale_cache, _traced(check, errors, traced),
                              errors, loc_map, dcp_rank, dcp_size)
    if traced:
        torch.ops.kvwrite.rope_store_kv(positions, q, k, v, cos_sin_cache, k_cache, v_cache, loc,
                                        is_neox, rotary_dim, q_norm_weight, k_norm_weight,
                                        float(norm_eps), layout, k_scale, v_scale, k_scale_cache,
                                        v_scale_cache, check, _tensor(errors), loc_map, dcp_rank,
                                        dcp_size, backend)
    elif a.locs.n:
        dispatch(OP_KV, KV_IMPLS, backend, a.q.device, a)


@torch.library.custom_op("kvwrite::rope_store_mla", mutates_args=("q_pe", "kv_cache", "scale_cache", "errors"))
def _rope_store_mla_op(positions: torch.Tensor, q_pe: torch.Tensor, kv_c: torch.Tensor,
                       k_pe: torch.Tensor, cos_sin_cache: torch.Tensor, kv_cache: torch.Tensor,
                       loc: torch.Tensor, is_neox: bool, kv_cache_dtype: str,
                       scale: torch.Tensor | None, check: str | None, errors: torch.Tensor | None,
                       loc_map: torch.Tensor | None, dcp_rank: int, dcp_size: int, backend: str,
                       scale_cache: torch.Tensor | None, global_scale: torch.Tensor | None) -> None:
    a = prepare_rope_store_mla(positions, q_pe, kv_c, k_pe, cos_sin_cache, kv_cache, loc, is_neox,
                               kv_cache_dtype, scale, check, errors, loc_map, dcp_rank, dcp_size,
                               scale_cache, global_scale)
    if a.locs.n:
        dispatch(OP_MLA, MLA_IMPLS, backend, kv_c.device, a)


@_rope_store_mla_op.register_fake
def _(*args) -> None:
    return None


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
    (DeepSeek's default). `kv_cache_dtype`: every `store_mla` format — "auto", "fp8" (= "fp8_e4m3",
    per-tensor `scale`), "fp8_e5m2", "fp8_ds_mla", "nvfp4" (`scale_cache`, optional
    `global_scale`). The rotated k_pe is rounded once to the input dtype (fp32 rotation, no fma),
    then stored exactly as `store_mla` stores a k_pe. Positions, checks, `loc_map`, DCP: as in
    `rope_store_kv`. kv_c and k_pe are not modified."""
    traced = torch.compiler.is_compiling()
    a = prepare_rope_store_mla(positions, q_pe, kv_c, k_pe, cos_sin_cache, kv_cache, loc, is_neox,
                               kv_cache_dtype, scale, _traced(check, errors, traced), errors, loc_map,
                               dcp_rank, dcp_size, scale_cache, global_scale)
    if traced:
        torch.ops.kvwrite.rope_store_mla(positions, q_pe, kv_c, k_pe, cos_sin_cache, kv_cache, loc,
                                         is_neox, kv_cache_dtype, scale, check, _tensor(errors),
                                         loc_map, dcp_rank, dcp_size, backend, scale_cache,
                                         global_scale)
    elif a.locs.n:
        dispatch(OP_MLA, MLA_IMPLS, backend, a.q.device, a)
