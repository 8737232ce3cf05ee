"""Benchmark cases: realistic per-layer shapes, one registry keyed by kvwrite op.

A case's `build(n, device, gen)` allocates one layer's pool, N tokens of input and random
unique locs from a paged allocation, and returns a `Setup`: the kvwrite call, the bytes one
store moves, the baselines that do the same store another way, and one raw torch op on the same
tensors (the yardstick of the wrapper's host overhead). Ops missing from this kvwrite are skipped
with a note (`hasattr(kvwrite, op)`), so the registry can name ops that land later.
"""
from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

import kvwrite
from kvwrite.reference.kv import quantize_fp8

Store = Callable[[], None]


@dataclass
class Setup:
    """One case at one N on one device, inputs allocated."""

    call: Callable[[str, str, object], None]   # call(backend, check, errors): one kvwrite store
    bytes_moved: int                           # bytes read + written by one store
    baselines: dict[str, Store] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)  # baseline -> why it is not measured
    raw: Store | None = None                   # one raw torch op on these tensors


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    label: str
    build: Callable[[int, torch.device, torch.Generator], Setup]


REGISTRY: dict[str, list[Case]] = {}


def case(op: str, name: str, label: str):
    """Register `build` as case `name` of kvwrite op `op`."""
    def register(build):
        REGISTRY.setdefault(op, []).append(Case(name, op, label, build))
        return build
    return register


def available(select: list[str] | None = None) -> tuple[list[Case], dict[str, str]]:
    """(cases whose op this kvwrite has, {op or case: why skipped}); `select` keeps the cases
    whose name or op is listed."""
    cases, skipped = [], {}
    for op, group in REGISTRY.items():
        chosen = [c for c in group if select is None or c.name in select or op in select]
        if not chosen:
            continue
        if not hasattr(kvwrite, op):
            skipped[op] = f"kvwrite.{op} is not in this build ({', '.join(c.name for c in chosen)} skipped)"
            continue
        cases += chosen
    if select:
        known = {c.name for g in REGISTRY.values() for c in g} | set(REGISTRY)
        for s in select:
            if s not in known:
                raise ValueError(f"unknown case {s!r}; cases: {sorted(known)}")
    return cases, skipped


def paged_locs(n: int, page_size: int, device: torch.device, gen: torch.Generator,
               slack: int = 2) -> tuple[torch.Tensor, int]:
    """(int64 locs of n tokens, num_pages of the pool): whole pages picked at random from a pool
    `slack` times larger than needed (page 0 reserved for padding, as SGLang does), in shuffled
    order, tokens contiguous within a page like an allocator's pages of one request."""
    used = max(1, -(-n // page_size))
    num_pages = slack * used + 1
    pages = torch.randperm(num_pages - 1, generator=gen)[:used] + 1
    rows = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).flatten()[:n]
    return rows.to(device), num_pages


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def _try(name: str, fn: Store, baselines: dict, notes: dict) -> None:
    """Keep baseline `fn` if one call succeeds, else note why it was skipped."""
    try:
        fn()
    except Exception as exc:  # not supported for this dtype/device, or a foreign API mismatch
        notes[name] = f"skipped: {exc.__class__.__name__}: {str(exc).splitlines()[0][:160]}"
        return
    baselines[name] = fn


def _import(module: str):
    try:
        return importlib.import_module(module), None
    except Exception as exc:
        return None, f"skipped: {module} not importable ({exc.__class__.__name__})"


def _external_mha(k, v, kc, vc, loc, fp8: bool, baselines: dict, notes: dict) -> None:
    """vLLM, sgl-kernel and FlashInfer stores of the same K/V (CUDA only, when importable)."""
    if kc.device.type != "cuda":
        for name in ("vllm.reshape_and_cache_flash", "sgl_kernel.store_kv_cache",
                     "flashinfer.append_paged_kv_cache"):
            notes[name] = "skipped: CUDA only"
        return
    vllm_ops, why = _import("vllm._custom_ops")
    if vllm_ops is None:
        notes["vllm.reshape_and_cache_flash"] = why
    else:
        one = torch.ones((), dtype=torch.float32, device=k.device)
        _try("vllm.reshape_and_cache_flash", lambda: vllm_ops.reshape_and_cache_flash(
            k, v, kc, vc, loc, "fp8" if fp8 else "auto", one, one), baselines, notes)
    sgl, why = _import("sgl_kernel")
    if sgl is None:
        notes["sgl_kernel.store_kv_cache"] = why
    elif fp8:
        notes["sgl_kernel.store_kv_cache"] = "skipped: stores bf16/fp16 only"
    else:
        n = k.shape[0]
        k2, v2 = kc.view(-1, kc.shape[2] * kc.shape[3]), vc.view(-1, vc.shape[2] * vc.shape[3])
        _try("sgl_kernel.store_kv_cache", lambda: torch.ops.sgl_kernel.store_kv_cache(
            k2, v2, loc, k.reshape(n, -1), v.reshape(n, -1)), baselines, notes)
    fi, why = _import("flashinfer")
    if fi is None:
        notes["flashinfer.append_paged_kv_cache"] = why
    elif fp8:
        notes["flashinfer.append_paged_kv_cache"] = "skipped: takes pre-quantised input"
    else:
        # One single-page "request" per token: page = loc // ps, position = loc % ps.
        ps = kc.shape[1]
        n = k.shape[0]
        page, pos = (loc // ps).to(torch.int32), (loc % ps).to(torch.int32)
        indptr = torch.arange(n + 1, dtype=torch.int32, device=k.device)
        batch = torch.arange(n, dtype=torch.int32, device=k.device)
        _try("flashinfer.append_paged_kv_cache", lambda: fi.page.append_paged_kv_cache(
            k, v, batch, pos, (kc, vc), page, indptr, pos + 1, kv_layout="NHD"), baselines, notes)


def _mha(n: int, device: torch.device, gen: torch.Generator, cache_dtype: torch.dtype) -> Setup:
    """Llama-3.1-8B, one layer: 8 KV heads x 128, bf16 input, pages of 16 tokens."""
    heads, dim, page = 8, 128, 16
    loc, num_pages = paged_locs(n, page, device, gen)
    k, v = (_randn((n, heads, dim), torch.bfloat16, device, gen) for _ in range(2))
    kc, vc = (torch.zeros(num_pages, page, heads, dim, dtype=cache_dtype, device=device)
              for _ in range(2))
    fp8 = cache_dtype != k.dtype
    scales = {}
    if fp8:
        scales = dict(k_scale=torch.full((), 0.05, device=device), v_scale=torch.full((), 0.05, device=device))

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_kv(k, v, kc, vc, loc, check=check, errors=errors, backend=backend, **scales)

    moved = _nbytes(k, v, loc) + 2 * n * heads * dim * kc.element_size()
    kf, vf = kc.view(-1, heads, dim), vc.view(-1, heads, dim)
    baselines, notes = {}, {}
    if fp8:
        ks, vs = scales["k_scale"], scales["v_scale"]

        def index_put() -> None:
            kf[loc] = quantize_fp8(k, ks, cache_dtype)
            vf[loc] = quantize_fp8(v, vs, cache_dtype)

        def index_copy() -> None:
            kf.index_copy_(0, loc, quantize_fp8(k, ks, cache_dtype))
            vf.index_copy_(0, loc, quantize_fp8(v, vs, cache_dtype))
    else:
        def index_put() -> None:
            kf[loc] = k
            vf[loc] = v

        def index_copy() -> None:
            kf.index_copy_(0, loc, k)
            vf.index_copy_(0, loc, v)
    _try("torch-index", index_put, baselines, notes)
    _try("index_copy_", index_copy, baselines, notes)
    _external_mha(k, v, kc, vc, loc, fp8, baselines, notes)
    kq = quantize_fp8(k, scales["k_scale"], cache_dtype) if fp8 else k
    raw = lambda: kf.index_put_((loc,), kq)  # noqa: E731
    return Setup(call, moved, baselines, notes, raw)


case("store_kv", "mha-bf16", "MHA Llama-3.1-8B layer: 8 KV heads x 128, bf16")(
    lambda n, device, gen: _mha(n, device, gen, torch.bfloat16))
case("store_kv", "mha-fp8", "MHA Llama-3.1-8B layer: 8 x 128, bf16 -> fp8 e4m3 (per-tensor scale)")(
    lambda n, device, gen: _mha(n, device, gen, torch.float8_e4m3fn))


__all__ = ["Case", "REGISTRY", "Setup", "available", "case", "paged_locs"]
