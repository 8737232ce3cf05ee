"""Benchmark cases: realistic per-layer shapes, one registry keyed by kvwrite op.

A case's `build(n, device, gen)` allocates one layer's pool, N tokens of input and random
unique locs from a paged allocation, and returns a `Setup`: the kvwrite call, the bytes one
store moves, the baselines that do the same store another way, and single raw torch ops on the same
tensors (the yardsticks of the wrapper's host overhead). Ops missing from this kvwrite are skipped
with a note (`hasattr(kvwrite, op)`), so the registry can name ops that land later. The input
rows are normal values, or under `values("outliers")` rows with one large channel a 64.
"""
from __future__ import annotations

import contextlib
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
    raw: dict[str, Store] = field(default_factory=dict)  # single raw torch ops on these tensors
    outputs: tuple = ()                        # the tensors one store writes


@dataclass(frozen=True)
class Case:
    name: str
    op: str
    label: str
    build: Callable[[int, torch.device, torch.Generator], Setup]
    missing: Callable[[], str | None] = lambda: None   # why this build cannot run it, or None


REGISTRY: dict[str, list[Case]] = {}


def case(op: str, name: str, label: str, missing: Callable[[], str | None] = lambda: None):
    """Register `build` as case `name` of kvwrite op `op` (`missing`: why an option of the op
    the case needs is absent from this build, or None)."""
    def register(build):
        REGISTRY.setdefault(op, []).append(Case(name, op, label, build, missing))
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
        for c in chosen:
            why = c.missing()
            if why:
                skipped[c.name] = why
            else:
                cases.append(c)
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


POOL_SLACK = 4  # the pool holds POOL_SLACK times the tokens stored


def random_locs(n: int, page_size: int, device: torch.device, gen: torch.Generator,
                slack: int = POOL_SLACK) -> tuple[torch.Tensor, int]:
    """(int64 locs of n tokens, num_pages of the pool): n random unique rows of a pool `slack`
    times larger than n (whole pages; page 0 reserved for padding), in random order: every
    row write lands somewhere unrelated to the previous one."""
    used = max(1, -(-slack * n // page_size))
    num_pages = used + 1
    rows = torch.randperm(used * page_size, generator=gen)[:n] + page_size
    return rows.to(device), num_pages


def _scatter_baseline(srcs, dsts, loc, baselines: dict, notes: dict) -> None:
    """`memcpy-scatter`: the extension's plain per-row memcpy loop, dst_j[loc[i]] = src_j[i]
    (bench_memcpy_scatter, compiled with the CPU kernels, same threading policy): the floor of a
    row scatter on this machine. For quantising formats the rows are the reference's output
    rows (quantised beforehand), so it is the scatter of the bytes the store writes. `loc` a
    list: one loc tensor per (src, dst) pair, one call each. `stream-scatter`: the same loop
    writing every whole line by streaming stores, as a call larger than the cache writes its rows
    (csrc/kvwrite/stream.h): the floor of such a call, beside the targets' memcpy one."""
    if (loc[0] if isinstance(loc, list) else loc).device.type != "cpu":
        notes["memcpy-scatter"] = "skipped: CPU only (the extension's CPU baseline)"
        return
    from kvwrite import _ext

    why = _ext.unavailable_reason("cpu")
    if why is not None:
        notes["memcpy-scatter"] = f"skipped: {why}"
        return
    op = torch.ops.kvwrite_ext.bench_memcpy_scatter
    srcs = [s.contiguous() for s in srcs]
    for name, stream in (("memcpy-scatter", False), ("stream-scatter", True)):
        if isinstance(loc, list):
            pairs = list(zip(srcs, dsts, loc))
            _try(name, lambda st=stream: [op([s], [d], l, st) for s, d, l in pairs], baselines, notes)
        else:
            _try(name, lambda st=stream: op(srcs, dsts, loc, st), baselines, notes)


def _page_runs_baseline(call, cache: torch.Tensor, loc: torch.Tensor, page: int, runs: tuple,
                        baselines: dict, notes: dict) -> None:
    """The memcpy / stream scatter of a page-major layout (a uint8 cache `[pages, page bytes]`) whose
    token at offset o of page p lands in runs: run (base, pitch, width) is `width` bytes at byte
    base + o * pitch of page p. Sources: the reference's bytes at those runs (checked to be every
    byte it wrote), copied to the same places by one scatter a run, each run addressed as a row
    of a view of the cache in `unit`-byte steps."""
    if loc.device.type != "cpu":
        return _scatter_baseline([], [], loc, baselines, notes)
    call("torch", "off", None)
    flat = cache.view(-1)
    unit = math.gcd(cache.shape[1], *(b for b, _, _ in runs), *(q for _, q, _ in runs))
    page_at, off = loc // page * cache.shape[1], loc % page
    srcs, dsts, locs, rest = [], [], [], flat.clone()
    for base, pitch, width in runs:
        at = page_at + base + off * pitch
        idx = at[:, None] + torch.arange(width)[None, :]
        srcs.append(flat[idx])
        rest[idx] = 0
        dsts.append(flat.as_strided(((flat.numel() - width) // unit + 1, width), (unit, 1)))
        locs.append(at // unit)
    cache.zero_()
    if rest.any():  # the runs miss bytes the store writes: no scatter of the same bytes
        notes["memcpy-scatter"] = "skipped: the reference wrote bytes outside the layout's runs"
        return
    _scatter_baseline(srcs, dsts, locs, baselines, notes)


def _reference_rows(call, outputs, loc) -> list[torch.Tensor]:
    """The rows the torch reference writes at `loc` into each row-shaped output
    ([pages, page, ...]): what a scatter of the finished bytes would copy."""
    call("torch", "off", None)
    rows = [t.view(torch.uint8).flatten(0, 1).flatten(1)[loc].clone() for t in outputs]
    for t in outputs:
        t.view(torch.uint8).zero_()
    return rows


def _rows_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8).flatten(0, 1).flatten(1)


VALUES = ("normal", "outliers")   # what the cases' input rows hold (`kvwrite bench --values`)
OUTLIER = 1000.0                  # "outliers": every 64th value of a row times this
_values = "normal"


@contextlib.contextmanager
def values(kind: str):
    """Cases built in the block draw `kind` rows: "normal" (standard normal), or "outliers" (every
    64th value times OUTLIER: a tile's scale follows its one large value, as in real K / V rows with
    outlier channels, so most of its other codes are small, many of them e4m3 subnormals)."""
    global _values
    if kind not in VALUES:
        raise ValueError(f"values: {kind!r} is not one of {', '.join(VALUES)}")
    saved, _values = _values, kind
    try:
        yield
    finally:
        _values = saved


def _randn(shape, dtype, device, gen) -> torch.Tensor:
    x = torch.randn(shape, generator=gen)
    if _values == "outliers":
        x.view(-1)[::64] *= OUTLIER
    return x.to(dtype).to(device)


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
    loc, num_pages = random_locs(n, page, device, gen)
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
    if fp8:
        _scatter_baseline(_reference_rows(call, (kc, vc), loc), [_rows_view(kc), _rows_view(vc)], loc,
                          baselines, notes)
    else:
        _scatter_baseline([k, v], [kf, vf], loc, baselines, notes)
    _external_mha(k, v, kc, vc, loc, fp8, baselines, notes)
    kq = quantize_fp8(k, scales["k_scale"], cache_dtype) if fp8 else k
    raw = {"index_put_": lambda: kf.index_put_((loc,), kq),
           "cache[loc] = k": lambda: kf.__setitem__(loc, kq)}
    return Setup(call, moved, baselines, notes, raw, (kc, vc))


case("store_kv", "mha-bf16", "MHA Llama-3.1-8B layer: 8 KV heads x 128, bf16")(
    lambda n, device, gen: _mha(n, device, gen, torch.bfloat16))
case("store_kv", "mha-fp8", "MHA Llama-3.1-8B layer: 8 x 128, bf16 -> fp8 e4m3 (per-tensor scale)")(
    lambda n, device, gen: _mha(n, device, gen, torch.float8_e4m3fn))


def _mha_dynamic(n: int, device: torch.device, gen: torch.Generator, cache_dtype: torch.dtype,
                 per_head: bool) -> Setup:
    """The mha-bf16 layer into an int8 / fp8 cache with dynamic per-token (or per-token-head)
    fp32 scales (`k_scale_cache`/`v_scale_cache`, store_kv's kv_quant kernels)."""
    heads, dim, page = 8, 128, 16
    loc, num_pages = random_locs(n, page, device, gen)
    k, v = (_randn((n, heads, dim), torch.bfloat16, device, gen) for _ in range(2))
    kc, vc = (torch.zeros(num_pages, page, heads, dim, dtype=cache_dtype, device=device) for _ in range(2))
    sshape = (num_pages, page, heads) if per_head else (num_pages, page)
    ksc, vsc = (torch.zeros(sshape, device=device) for _ in range(2))

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_kv(k, v, kc, vc, loc, check=check, errors=errors, backend=backend,
                         k_scale_cache=ksc, v_scale_cache=vsc)

    moved = _nbytes(k, v, loc) + 2 * n * heads * dim * kc.element_size() + 2 * n * (heads if per_head else 1) * 4
    outs = (kc, vc, ksc if per_head else ksc.unsqueeze(-1), vsc if per_head else vsc.unsqueeze(-1))
    baselines, notes = {}, {}
    from kvwrite.reference.kv_quant import dynamic_scale, quantize

    kf, vf = kc.view(-1, heads, dim), vc.view(-1, heads, dim)
    kscf, vscf = ksc.view(-1, *sshape[2:]), vsc.view(-1, *sshape[2:])

    def index_put() -> None:   # the reference's arithmetic in torch, then index_put_
        for x, cf, sf in ((k, kf, kscf), (v, vf, vscf)):
            sc = dynamic_scale(x, cache_dtype, per_head)
            cf[loc] = quantize(x, sc[..., None], cache_dtype)
            sf[loc] = sc if per_head else sc[:, 0]
    _try("torch-index", index_put, baselines, notes)
    _scatter_baseline(_reference_rows(call, outs, loc), [_rows_view(t) for t in outs], loc, baselines, notes)
    return Setup(call, moved, baselines, notes, {}, outs)


for _dtype, _name, _what in ((torch.int8, "int8", "int8"), (torch.float8_e4m3fn, "fp8", "fp8 e4m3")):
    for _per_head, _kind in ((False, "token"), (True, "head")):
        case("store_kv", f"mha-{_name}-{_kind}",
             f"MHA Llama-3.1-8B layer: 8 x 128, bf16 -> {_what}, dynamic per-token{'-head' if _per_head else ''} fp32 scales")(
            lambda n, device, gen, _dtype=_dtype, _per_head=_per_head: _mha_dynamic(n, device, gen, _dtype, _per_head))


@case("store_kv", "mha-bf16-pagetable",
      "FlashInfer append_paged_kv_cache (page table, requests of 4 pages): the mha-bf16 layer")
def _mha_pagetable(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    """The mha-bf16 store addressed by a page table (kvwrite.compat.flashinfer): the same pages
    and bytes, so the row against mha-bf16 is the cost of resolving the table in the kernel."""
    from kvwrite.compat import flashinfer as fi

    heads, dim, page, per_req = 8, 128, 16, 4
    loc, num_pages = paged_locs(n, page, device, gen)
    k, v = (_randn((n, heads, dim), torch.bfloat16, device, gen) for _ in range(2))
    kv = torch.zeros(num_pages, 2, page, heads, dim, dtype=torch.bfloat16, device=device)
    pages = (loc[::page] // page).to(torch.int32)                   # the pages, in token order
    tok = torch.arange(n, device=device)
    batch = (tok // (per_req * page)).to(torch.int32)
    pos = (tok % (per_req * page)).to(torch.int32)
    n_req = -(-pages.shape[0] // per_req)
    indptr = torch.clamp(torch.arange(n_req + 1, device=device) * per_req, max=pages.shape[0]).to(torch.int32)
    last = torch.full((n_req,), page, dtype=torch.int32, device=device)

    def call(backend: str, check: str, errors) -> None:
        fi.append_paged_kv_cache(k, v, batch, pos, kv, pages, indptr, last, check=check, errors=errors,
                                 backend=backend)

    moved = _nbytes(k, v, batch, pos, pages, indptr) + 2 * n * heads * dim * kv.element_size()
    lp, lo = loc // page, loc % page   # the rows the table resolves to, precomputed
    baselines, notes = {}, {}

    def index_put() -> None:
        kv[lp, 0, lo] = k
        kv[lp, 1, lo] = v

    _try("torch-index", index_put, baselines, notes)
    if device.type == "cuda":
        fl, why = _import("flashinfer")
        if fl is None:
            notes["flashinfer.append_paged_kv_cache"] = why
        else:
            _try("flashinfer.append_paged_kv_cache", lambda: fl.page.append_paged_kv_cache(
                k, v, batch, pos, kv, pages, indptr, last, kv_layout="NHD"), baselines, notes)
    else:
        notes["flashinfer.append_paged_kv_cache"] = "skipped: CUDA only"
    return Setup(call, moved, baselines, notes, {"cache[page, 0, row] = k": lambda: kv.__setitem__((lp, 0, lo), k)}, (kv,))



def _vllm_mla(kv_c, k_pe, cache, loc, dtype_name: str, baselines: dict, notes: dict) -> None:
    """vLLM's concat_and_cache_mla on the same rows (CUDA only, when importable)."""
    name = "vllm.concat_and_cache_mla"
    if cache.device.type != "cuda":
        notes[name] = "skipped: CUDA only"
        return
    ops, why = _import("vllm._custom_ops")
    if ops is None:
        notes[name] = why
        return
    one = torch.ones((), dtype=torch.float32, device=cache.device)
    _try(name, lambda: ops.concat_and_cache_mla(kv_c, k_pe, cache, loc, dtype_name, one), baselines, notes)


def _mla(n: int, device: torch.device, gen: torch.Generator, fmt: str) -> Setup:
    """DeepSeek-V3 MLA, one layer: latent 512 + rope 64 (slices of one projection output, so
    strided along tokens), bf16, pages of 64 tokens."""
    lora, rope, page = 512, 64, 64
    loc, num_pages = random_locs(n, page, device, gen)
    proj = _randn((n, lora + rope + 64), torch.bfloat16, device, gen)  # + q-side columns
    kv_c, k_pe = proj[:, :lora], proj[:, lora:lora + rope]
    from kvwrite.ops.mla import FORMATS
    f = FORMATS[fmt]
    width = f.row_width(lora, rope)
    cache = torch.zeros(num_pages, page, width, dtype=f.cache_dtype(kv_c.dtype), device=device)
    extra = dict(scale=torch.full((), 0.05, device=device)) if f.takes_scale else {}

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_mla(kv_c, k_pe, cache, loc, kv_cache_dtype=fmt, check=check, errors=errors,
                          backend=backend, **extra)

    moved = n * (lora + rope) * kv_c.element_size() + _nbytes(loc) + n * width * cache.element_size()
    baselines, notes = {}, {}
    flat = cache.view(-1, width)
    if fmt == "auto":
        _try("torch-index", lambda: flat.__setitem__(loc, torch.cat([kv_c, k_pe], -1)), baselines, notes)
        _try("index_copy_", lambda: flat.index_copy_(0, loc, torch.cat([kv_c, k_pe], -1)), baselines, notes)
        raw_row = torch.cat([kv_c, k_pe], -1)
    else:
        notes["torch-index"] = f"skipped: no plain torch store of {fmt!r} rows (the torch backend is the reference)"
        raw_row = torch.zeros(n, width, dtype=cache.dtype, device=device)
    raw = {"index_put_": lambda: flat.index_put_((loc,), raw_row),
           "cache[loc] = k": lambda: flat.__setitem__(loc, raw_row)}
    if fmt == "auto":
        _scatter_baseline([torch.cat([kv_c, k_pe], -1)], [flat], loc, baselines, notes)
    else:
        _scatter_baseline(_reference_rows(call, (cache,), loc), [_rows_view(cache)], loc, baselines, notes)
    _vllm_mla(kv_c, k_pe, cache, loc, fmt, baselines, notes)
    return Setup(call, moved, baselines, notes, raw, (cache,))


case("store_mla", "mla-bf16", "MLA DeepSeek layer: latent 512 + rope 64, bf16 row")(
    lambda n, device, gen: _mla(n, device, gen, "auto"))
case("store_mla", "mla-fp8ds", "MLA DeepSeek layer: fp8_ds_mla 656-byte row (512 e4m3, 4 fp32 scales, 64 bf16)")(
    lambda n, device, gen: _mla(n, device, gen, "fp8_ds_mla"))


def _mla_format_missing(fmt: str):
    def missing() -> str | None:
        from kvwrite.ops.mla import FORMATS
        return None if fmt in FORMATS else f"store_mla has no kv_cache_dtype={fmt!r} in this build"
    return missing


case("store_mla", "mla-nvfp4", "MLA DeepSeek layer: NVFP4 row (576 e2m1 + e4m3 scale per 16)",
     missing=_mla_format_missing("nvfp4"))(lambda n, device, gen: _mla_nvfp4(n, device, gen))


def _mla_nvfp4(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    lora, rope, page = 512, 64, 64
    loc, num_pages = random_locs(n, page, device, gen)
    proj = _randn((n, lora + rope + 64), torch.bfloat16, device, gen)
    kv_c, k_pe = proj[:, :lora], proj[:, lora:lora + rope]
    row = lora + rope
    cache = torch.zeros(num_pages, page, row // 2, dtype=torch.uint8, device=device)
    scales = torch.zeros(num_pages, page, row // 16, dtype=torch.float8_e4m3fn, device=device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_mla(kv_c, k_pe, cache, loc, kv_cache_dtype="nvfp4", scale_cache=scales,
                          check=check, errors=errors, backend=backend)

    moved = n * row * 2 + _nbytes(loc) + n * (row // 2 + row // 16)
    baselines, notes = {}, {"torch-index": "skipped: no plain torch NVFP4 store"}
    _scatter_baseline(_reference_rows(call, (cache, scales), loc), [_rows_view(cache), _rows_view(scales)],
                      loc, baselines, notes)
    return Setup(call, moved, baselines, notes, {}, (cache, scales))


@case("store_indexer_k", "indexer-k", "DSA indexer K (DeepSeek V3.2): 128 -> e4m3 + fp32 scale per 128, pages of 64")
def _indexer(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    dim, block, page = 128, 128, 64
    loc, num_pages = random_locs(n, page, device, gen)
    k = _randn((n, dim), torch.bfloat16, device, gen)
    per_token = dim + (dim // block) * 4
    cache = torch.zeros(num_pages, page * per_token, dtype=torch.uint8, device=device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_indexer_k(k, cache, loc, quant_block_size=block, check=check, errors=errors,
                                backend=backend)

    moved = _nbytes(k, loc) + n * per_token
    notes = {"torch-index": "skipped: no plain torch store of the page-major indexer layout "
                            "(the torch backend is the reference)"}
    baselines = {}  # page-major: a page's code rows, then its scale rows
    _page_runs_baseline(call, cache, loc, page, ((0, dim, dim), (page * dim, per_token - dim, per_token - dim)),
                        baselines, notes)
    return Setup(call, moved, baselines, notes, {}, (cache,))


@case("store_kv_nvfp4", "mha-nvfp4", "MHA Llama-3.1-8B layer: 8 x 128 bf16 -> NVFP4 (e2m1 + e4m3 scale per 16)")
def _mha_nvfp4(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    heads, dim, page = 8, 128, 16
    loc, num_pages = random_locs(n, page, device, gen)
    k, v = (_randn((n, heads, dim), torch.bfloat16, device, gen) for _ in range(2))
    kc, vc = (torch.zeros(num_pages, page, heads, dim // 2, dtype=torch.uint8, device=device)
              for _ in range(2))
    ks, vs = (torch.zeros(num_pages, page, heads, dim // 16, dtype=torch.float8_e4m3fn, device=device)
              for _ in range(2))

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_kv_nvfp4(k, v, kc, vc, ks, vs, loc, check=check, errors=errors, backend=backend)

    moved = _nbytes(k, v, loc) + 2 * n * heads * (dim // 2 + dim // 16)
    baselines, notes = {}, {"torch-index": "skipped: no plain torch NVFP4 store"}
    outs = (kc, vc, ks, vs)
    _scatter_baseline(_reference_rows(call, outs, loc), [_rows_view(t) for t in outs], loc, baselines, notes)
    return Setup(call, moved, baselines, notes, {}, outs)


def _dsv4_missing() -> str | None:
    return None if hasattr(kvwrite, "store_dsv4_kv") else "kvwrite has no store_dsv4_kv"


@case("store_dsv4_kv", "dsv4-kv", "DeepSeek V4 SWA layer: 448 NoPE + 64 RoPE bf16 -> FlashMLA MODEL1 page (584 B), pages of 256",
      _dsv4_missing)
def _dsv4_kv(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    from kvwrite.ops.dsv4 import kv_page_bytes

    page = 256
    loc, num_pages = paged_locs(n, page, device, gen)
    kv = _randn((n, 512), torch.bfloat16, device, gen)
    cache = torch.zeros(num_pages, kv_page_bytes(page), dtype=torch.uint8, device=device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_dsv4_kv(kv, cache, loc, page_size=page, check=check, errors=errors, backend=backend)

    from kvwrite.facts import DATA_ROW, SCALE_ROW

    baselines = {}
    notes = {"torch-index": "skipped: no plain torch store of the split data/scale page (the torch backend is the reference)"}
    # a page's data rows, then its scale rows (7 scale bytes written of 8: the pad byte never is)
    _page_runs_baseline(call, cache, loc, page, ((0, DATA_ROW, DATA_ROW), (page * DATA_ROW, SCALE_ROW, SCALE_ROW - 1)),
                        baselines, notes)
    return Setup(call, _nbytes(kv, loc) + n * 583, baselines, notes, {}, (cache,))


@case("store_dsv4_indexer_k", "dsv4-indexer-mxfp4", "DeepSeek V4 c4 indexer K: 128 bf16 -> MXFP4 (e2m1 + ue8m0 per 32), pages of 64",
      _dsv4_missing)
def _dsv4_mxfp4(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    page = 64
    loc, num_pages = paged_locs(n, page, device, gen)
    k = _randn((n, 128), torch.bfloat16, device, gen)
    cache = torch.zeros(num_pages, page * 68, dtype=torch.uint8, device=device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_dsv4_indexer_k(k, cache, loc, fmt="mxfp4", check=check, errors=errors, backend=backend)

    baselines, notes = {}, {"torch-index": "skipped: no plain torch MXFP4 store"}
    _page_runs_baseline(call, cache, loc, page, ((0, 64, 64), (page * 64, 4, 4)), baselines, notes)  # codes, scales
    return Setup(call, _nbytes(k, loc) + n * 68, baselines, notes, {}, (cache,))


def _dsv4_fp4(n: int, device: torch.device, gen: torch.Generator, fmt: str, rope: bool = False) -> Setup:
    """A DeepSeek V4 SWA layer's FP4 record store (pages of 256, locs of whole pages). The
    memcpy-scatter baseline copies the reference's record bytes to the same cache bytes: one run
    a token (inline mxfp4) or two (the split page's data row and scale row)."""
    from kvwrite.facts import FP4_RECORDS

    rec, page = FP4_RECORDS[fmt], 256
    loc, num_pages = paged_locs(n, page, device, gen)
    kv = _randn((n, 512), torch.bfloat16, device, gen)
    cache = torch.zeros(num_pages, page * rec.token_bytes, dtype=torch.uint8, device=device)
    if rope:
        positions = torch.randint(0, 4096, (n,), generator=gen).to(device)
        ang = torch.arange(4096)[:, None] * torch.logspace(0, -4, 32)[None, :]
        cos_sin = torch.cat([ang.cos(), ang.sin()], 1).to(device)

        def call(backend: str, check: str, errors) -> None:
            kvwrite.rope_store_dsv4_kv_fp4(positions, kv, cos_sin, cache, loc, fmt=fmt, page_size=page,
                                           check=check, errors=errors, backend=backend)
    else:
        def call(backend: str, check: str, errors) -> None:
            kvwrite.store_dsv4_kv_fp4(kv, cache, loc, fmt=fmt, page_size=page, check=check, errors=errors,
                                      backend=backend)

    moved = _nbytes(kv, loc) + n * rec.token_bytes + (_nbytes(positions) + n * 64 * 4 if rope else 0)
    baselines = {}
    notes = {"torch-index": f"skipped: no plain torch {fmt} record store (the torch backend is the reference)"}
    runs = ((0, rec.data_row, rec.data_row), (page * rec.data_row, rec.scale_row, rec.scale_row))
    _page_runs_baseline(call, cache, loc, page, runs[:2 - rec.inline], baselines, notes)
    return Setup(call, moved, baselines, notes, {}, (cache,))


def _dsv4_fp4_missing() -> str | None:
    return None if hasattr(kvwrite, "store_dsv4_kv_fp4") else "kvwrite has no store_dsv4_kv_fp4"


for _fmt, _what in (("nvfp4", "NVFP4 record (384 B: 448 e2m1 + e4m3 per 16, 64 bf16 RoPE; split page)"),
                    ("mxfp4", "MXFP4 record (368 B: 448 e2m1 + ue8m0 per 32, 64 bf16 RoPE; inline)"),
                    ("nvfp4_v41", "V4.1 NVFP4 record (288 B: 512 e2m1 + e4m3 per 16; split page)")):
    case("store_dsv4_kv_fp4", f"dsv4-kv-{_fmt.replace('_', '-')}",
         f"DeepSeek V4 SWA layer: 512 bf16 -> {_what}, pages of 256", _dsv4_fp4_missing)(
        lambda n, device, gen, _fmt=_fmt: _dsv4_fp4(n, device, gen, _fmt))
case("rope_store_dsv4_kv_fp4", "dsv4-kv-nvfp4-rope",
     "DeepSeek V4 SWA layer: GPT-J RoPE on the 64 RoPE values fused with the NVFP4 record store, pages of 256",
     _dsv4_fp4_missing)(lambda n, device, gen: _dsv4_fp4(n, device, gen, "nvfp4", rope=True))


@case("store_rows", "dsv4-state-rows", "DeepSeek V4 c4 compress state: rows of 2*2*512 fp32", _dsv4_missing)
def _dsv4_rows(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    width = 2048
    rows = max(2 * n, 16)
    loc = torch.randperm(rows, generator=gen)[:n].to(device)
    src = _randn((n, width), torch.float32, device, gen)
    pool = torch.zeros(rows, width, dtype=torch.float32, device=device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.store_rows(src, pool, loc, check=check, errors=errors, backend=backend)

    def index_copy() -> None:
        pool.index_copy_(0, loc, src)

    return Setup(call, 2 * _nbytes(src) + _nbytes(loc), {"torch-index": index_copy}, {},
                 {"index_copy_": index_copy}, (pool,))


# --- page moves (kvwrite.ops.pages) ----------------------------------------------------------------

@case("copy_pages", "pages-64k", "copy_pages between two host pools: pages of 32 rows x 8 x 128 bf16 "
      "(64 KiB), N // 32 random page pairs (an offload / prefix move)")
def _copy_pages(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    heads, dim, page = 8, 128, 32
    pages = max(1, n // page)
    num = POOL_SLACK * pages + 1
    src = _randn((num, page, heads, dim), torch.bfloat16, device, gen)
    dst = torch.zeros(num, page, heads, dim, dtype=torch.bfloat16, device=device)
    sp = torch.randperm(num, generator=gen)[:pages].to(device)
    dp = torch.randperm(num, generator=gen)[:pages].to(device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.copy_pages(src, dst, sp, dp, check=check, errors=errors, backend=backend)

    def index() -> None:
        dst[dp] = src[sp]

    def index_copy() -> None:
        dst.index_copy_(0, dp, src.index_select(0, sp))

    moved = 2 * pages * page * heads * dim * 2 + _nbytes(sp, dp)
    return Setup(call, moved, {"torch-index": index, "index_copy_": index_copy}, {},
                 {"dst[dp] = src[sp]": index}, (dst,))


@case("gather", "gather-mha-bf16", "gather K and V rows at N random locs (the mha-bf16 layer's caches, "
      "8 KV heads x 128 bf16, pages of 16) into preallocated [N, 8, 128] outputs")
def _gather(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    heads, dim, page = 8, 128, 16
    loc, num_pages = random_locs(n, page, device, gen)
    kc, vc = (_randn((num_pages, page, heads, dim), torch.bfloat16, device, gen) for _ in range(2))
    ko, vo = (torch.zeros(n, heads, dim, dtype=torch.bfloat16, device=device) for _ in range(2))
    kf, vf = kc.view(-1, heads, dim), vc.view(-1, heads, dim)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.gather(kc, loc, check=check, errors=errors, backend=backend, out=ko)
        kvwrite.gather(vc, loc, check=check, errors=errors, backend=backend, out=vo)

    def index_select() -> None:
        torch.index_select(kf, 0, loc, out=ko)
        torch.index_select(vf, 0, loc, out=vo)

    moved = 2 * 2 * n * heads * dim * 2 + _nbytes(loc)
    return Setup(call, moved, {"torch-index": index_select}, {}, {"index_select": index_select}, (ko, vo))


@case("slot_mapping", "slot-mapping", "slot_mapping: N tokens of requests of 512 tokens, block table of "
      "int32 [N / 512 + 1, 64], pages of 16")
def _slot_mapping(n: int, device: torch.device, gen: torch.Generator) -> Setup:
    page, per_req, width = 16, 512, 64
    reqs = n // per_req + 1
    num_pages = reqs * width + 1
    bt = torch.randperm(num_pages, generator=gen)[:reqs * width].view(reqs, width).to(torch.int32).to(device)
    tok = torch.arange(n)
    b = (tok // per_req).to(torch.int32).to(device)
    pos = (tok % per_req).to(torch.int32).to(device)
    geometry = kvwrite.PageGeometry.from_pool(num_pages, page)
    out = torch.zeros(n, dtype=torch.int64, device=device)

    def call(backend: str, check: str, errors) -> None:
        kvwrite.slot_mapping(bt, b, pos, geometry, check=check, errors=errors, backend=backend, out=out)

    bl, pl = b.long(), pos.long()

    def torch_expr() -> None:
        out.copy_(bt[bl, pl // page].long() * page + pl % page)

    moved = _nbytes(b, pos) + n * 4 + n * 8
    return Setup(call, moved, {"torch-index": torch_expr}, {}, {}, (out,))


__all__ = ["Case", "REGISTRY", "Setup", "available", "case", "paged_locs", "random_locs"]
