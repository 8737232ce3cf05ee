"""The op spec (kvwrite.ops.spec): what is derived from each op's declaration.

- `torch.library.opcheck` (schema, fake kernel, mutation, dispatch) on every declared op.
- Bad-argument cases generated from each op's argument list (not a tensor, wrong rank, dtype,
  device, a strided last dim, a size that disagrees with a shape letter bound earlier): a named
  error on the cpu (C++ fast path) and torch (Python) backends alike, before any write.
- torch.compile(fullgraph=True) on the FIRST call of every op and adapter in a fresh process,
  default check and KVWRITE_CHECK=guard: no graph break, bytes equal to eager; page tables too.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import kvwrite
from kvwrite.ops import spec

E4M3, U8 = torch.float8_e4m3fn, torch.uint8
ROOT = Path(__file__).resolve().parents[1]


def good(op: str) -> dict:
    """A valid call of `op`: schema argument name -> value (3 tokens, small pools)."""
    g = torch.Generator().manual_seed(0)
    loc = torch.tensor([0, 5, 9])
    tail = dict(check="off", errors=None, loc_map=None, dcp_rank=0, dcp_size=1, backend="cpu")
    if op == "store_kv":
        return dict(k=torch.randn(3, 2, 16, generator=g), v=torch.randn(3, 2, 8, generator=g),
                    k_cache=torch.zeros(4, 4, 2, 16), v_cache=torch.zeros(4, 4, 2, 8), loc=loc,
                    layout="NHD", k_scale=None, v_scale=None, **tail, k_scale_cache=None, v_scale_cache=None,
                    quant_rule=None)
    if op == "store_kv_head_major":   # float32: x = 4
        return dict(key=torch.randn(3, 2, 16, generator=g), value=torch.randn(3, 2, 16, generator=g),
                    key_cache=torch.zeros(4, 2, 4, 4, 4), value_cache=torch.zeros(4, 2, 16, 4), loc=loc,
                    k_scale=None, v_scale=None, **tail)
    if op == "store_mla":
        return dict(kv_c=torch.randn(3, 128, generator=g), k_pe=torch.randn(3, 16, generator=g),
                    kv_cache=torch.zeros(4, 4, 144), loc=loc, kv_cache_dtype="auto", scale=None,
                    **tail, scale_cache=None, global_scale=None)
    if op == "store_indexer_k":
        return dict(k=torch.randn(3, 128, generator=g), cache=torch.zeros(4, 4 * 132, dtype=U8), loc=loc,
                    quant_block_size=128, scale_fmt=None, **tail)
    if op == "store_kv_nvfp4":
        return dict(k=torch.randn(3, 2, 32, generator=g), v=torch.randn(3, 2, 16, generator=g),
                    k_cache=torch.zeros(4, 4, 2, 16, dtype=U8), v_cache=torch.zeros(4, 4, 2, 8, dtype=U8),
                    k_scale_cache=torch.zeros(4, 4, 2, 2, dtype=E4M3),
                    v_scale_cache=torch.zeros(4, 4, 2, 1, dtype=E4M3), loc=loc, k_global_scale=None,
                    v_global_scale=None, layout="NHD", **tail)
    if op == "store_dsv4_kv":
        from kvwrite.ops.dsv4 import kv_page_bytes

        return dict(kv=torch.randn(3, 512, generator=g), cache=torch.zeros(4, kv_page_bytes(4), dtype=U8),
                    loc=loc, page_size=None, **tail)
    if op == "store_dsv4_indexer_k":
        return dict(k=torch.randn(3, 128, generator=g), cache=torch.zeros(4, 4 * 132, dtype=U8), loc=loc,
                    page_size=None, fmt="fp8", scale_fmt=None, **tail)
    if op == "store_rows":
        return dict(src=torch.randn(3, 8, generator=g), pool=torch.zeros(16, 8), loc=loc, **tail)
    if op == "store_dsv4_kv_fp4":
        return dict(kv=torch.randn(3, 512, generator=g), cache=torch.zeros(4, 4 * 384, dtype=U8), loc=loc,
                    page_size=None, fmt="nvfp4", **tail)
    if op == "rope_store_dsv4_kv_fp4":
        return dict(positions=torch.tensor([0, 1, 2]), kv=torch.randn(3, 512, generator=g),
                    cos_sin=torch.randn(4, 64, generator=g), q=torch.randn(3, 2, 64, generator=g),
                    cache=torch.zeros(4, 4 * 384, dtype=U8), loc=loc, page_size=None, fmt="nvfp4", **tail)
    if op == "rope_store_kv":
        return dict(positions=torch.tensor([0, 3, 7]), q=torch.randn(3, 4, 16, generator=g),
                    k=torch.randn(3, 2, 16, generator=g), v=torch.randn(3, 2, 8, generator=g),
                    cos_sin_cache=torch.randn(8, 16, generator=g), k_cache=torch.zeros(4, 4, 2, 16),
                    v_cache=torch.zeros(4, 4, 2, 8), loc=loc, is_neox=True, rotary_dim=None,
                    q_norm_weight=torch.rand(16, generator=g) + 0.5, k_norm_weight=None, norm_eps=1e-6,
                    layout="NHD", k_scale=None, v_scale=None, k_scale_cache=None, v_scale_cache=None, **tail,
                    quant_rule=None)
    if op == "rope_store_mla":
        return dict(positions=torch.tensor([0, 3, 7]), q_pe=torch.randn(3, 2, 16, generator=g),
                    kv_c=torch.randn(3, 128, generator=g), k_pe=torch.randn(3, 16, generator=g),
                    cos_sin_cache=torch.randn(8, 16, generator=g), kv_cache=torch.zeros(4, 4, 144), loc=loc,
                    is_neox=False, kv_cache_dtype="auto", scale=None, **tail, scale_cache=None, global_scale=None)
    pages = dict(check="off", errors=None, backend="cpu")
    if op == "copy_pages":
        return dict(src=torch.randn(6, 4, 2, 8, generator=g), dst=torch.zeros(10, 2, 2, 8),
                    src_pages=torch.tensor([1, 5, 0]), dst_pages=loc, **pages)
    if op == "gather":
        return dict(cache=torch.randn(4, 4, 2, 8, generator=g), loc=loc, out=torch.zeros(3, 2, 8), check="off",
                    errors=None, backend="cpu")
    if op == "move_rows":
        return dict(cache=torch.randn(4, 4, 2, 8, generator=g), src_loc=torch.tensor([1, 15, 2]), dst_loc=loc,
                    **pages)
    if op == "slot_mapping":
        return dict(block_table=torch.tensor([[0, 3], [2, 1]]), batch_indices=torch.tensor([0, 1, 1]),
                    positions=torch.tensor([1, 2, 5]), out=torch.zeros(3, dtype=torch.int64), page_size=4,
                    num_pages=4, **pages)
    raise KeyError(op)


OPS = sorted(spec.OPS)


def test_every_declared_op_has_a_valid_call_here():
    assert set(OPS) >= {"store_kv", "store_mla", "store_indexer_k", "store_kv_nvfp4", "store_dsv4_kv",
                        "store_dsv4_indexer_k", "store_rows"}
    for op in OPS:
        assert list(good(op)) == [a.name for a in spec.OPS[op].args]


@pytest.mark.parametrize("op", OPS)
def test_opcheck(op):
    """Schema (aliases of every written tensor), fake kernel, and the dispatcher paths agree."""
    args = good(op)
    fp8 = any(isinstance(t, torch.Tensor) and t.dtype == E4M3 for t in args.values())
    # test_schema compares tensors with float math torch lacks for e4m3 (nvfp4's scale caches):
    # there the mutation aliases are checked by test_faketensor / aot dispatch alone
    utils = ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic") if fp8 else None
    kw = {} if utils is None else {"test_utils": utils}
    torch.library.opcheck(spec.OPS[op].overload, tuple(args.values()), **kw)
    args["check"] = "guard"
    args["errors"] = kvwrite.ErrorBuffer().tensor
    torch.library.opcheck(spec.OPS[op].overload, tuple(args.values()), **kw)


def quant_call(fmt: str) -> dict:
    """store_kv into an int8 / fp8 cache: static scales, or dynamic per token / per token-head."""
    args = good("store_kv")
    dtype = torch.int8 if fmt.startswith("int8") else E4M3
    args.update(k_cache=torch.zeros(4, 4, 2, 16, dtype=dtype), v_cache=torch.zeros(4, 4, 2, 8, dtype=dtype))
    if "static" in fmt:
        args.update(k_scale=torch.tensor(0.05), v_scale=torch.tensor([0.03, 0.04]))
    else:
        shape = (4, 4, 2) if "head" in fmt else (4, 4)
        args.update(k_scale_cache=torch.zeros(shape), v_scale_cache=torch.zeros(shape))
        args["quant_rule"] = "vllm" if "vllm" in fmt else None
    return args


QUANT_FORMATS = ("int8 static", "int8 token", "int8 head vllm", "e4m3 token", "e4m3 head")


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_store_kv_quant_formats_are_the_op(fmt):
    """int8 and dynamic scales are formats of kvwrite::store_kv: opcheck passes, and the public op
    runs them in C++ (nothing handed to the Python twin) with the reference's bytes."""
    from kvwrite import _ext
    from kvwrite.ops import _library

    args = quant_call(fmt)
    fp8 = args["k_cache"].dtype == E4M3
    kw = {"test_utils": ("test_faketensor", "test_aot_dispatch_static", "test_aot_dispatch_dynamic")} if fp8 else {}
    torch.library.opcheck(spec.OPS["store_kv"].overload, tuple(quant_call(fmt).values()), **kw)
    ref = quant_call(fmt)
    ref["backend"] = "torch"
    spec.OPS["store_kv"].entry(*ref.values())
    before = _library.FORWARDED.get("store_kv", 0)
    torch.ops.kvwrite.store_kv(*args.values())
    if _ext.LOADED:
        assert _library.FORWARDED.get("store_kv", 0) == before
    for n in ("k_cache", "v_cache", "k_scale_cache", "v_scale_cache"):
        if args[n] is not None:
            assert torch.equal(args[n].view(U8), ref[n].view(U8)), n
            assert args[n].view(U8).any(), n


def _bad_cases(op: str):
    """(argument, bad value, exception, message regex) generated from the op's declaration."""
    o = spec.OPS[op]
    base = good(op)
    by_name = {a.name: a for a in o.args}
    order = [c for c in o.checks if isinstance(c, str) and base.get(c) is not None]
    bound_before: set = set()
    for i, name in enumerate(order):
        a, t = by_name[name], base[name]
        shown = re.escape(o.aliases.get(name, name))
        if a.dims and a.dims.startswith("scale"):
            yield name, t.to(torch.float16), TypeError, f"{shown} must have dtype in \\(float32\\)"
            continue
        if not a.type.endswith("?"):
            yield name, t.tolist(), TypeError, f"{shown} must be a torch.Tensor, got list"
        if a.dims is not None:
            yield name, t[None], ValueError, f"{shown} must be {t.dim()}-D, got shape"
        if a.dtypes:
            yield name, t.to(torch.int16), TypeError, f"{shown} must have dtype in \\("
        if i > 0:
            yield name, t.to("meta"), ValueError, f"{shown} is on meta but the inputs are on cpu"
        if a.last_contiguous and t.dim() and t.shape[-1] > 1:
            wide = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)[..., ::2]
            yield name, wide, ValueError, f"{shown} must be contiguous in its last dim"
        toks = a.tokens
        for j in reversed(range(len(toks))):
            letter, _, lit = toks[j]
            if lit is not None or (letter in bound_before and letter not in a.binds.split()):
                shape = list(t.shape)
                shape[j] += 1
                yield name, torch.zeros(shape, dtype=t.dtype), ValueError, f"{shown} must have shape \\["
                break
        bound_before |= {tk[0] for tk in toks if tk[0]} | set(a.binds.split())


CASES = [(op, *c) for op in OPS for c in _bad_cases(op)]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("op, name, value, exc, msg", CASES,
                         ids=[f"{c[0]}-{c[1]}-{c[4][:30]}" for c in CASES])
def test_generated_bad_arguments(op, name, value, exc, msg, backend):
    args = good(op)
    args.update({name: value, "backend": backend})
    caches = [t for n, t in args.items() if isinstance(t, torch.Tensor) and n != name
              and spec.OPS[op].args[list(args).index(n)].mutable]
    before = [c.clone() for c in caches]
    with pytest.raises(exc, match=msg):
        spec.OPS[op].entry(*args.values())
    assert all(torch.equal(b.view(U8), c.view(U8)) for b, c in zip(before, caches))


def test_good_calls_match_the_reference():
    for op in OPS:
        got, ref = good(op), good(op)
        ref["backend"] = "torch"
        spec.OPS[op].entry(*got.values())
        spec.OPS[op].entry(*ref.values())
        for n, a in zip(got, spec.OPS[op].args):
            if a.mutable and isinstance(got[n], torch.Tensor):
                assert torch.equal(got[n].view(U8), ref[n].view(U8)), (op, n)


COMPILE_SCRIPT = r'''
import sys, torch, kvwrite
sys.path.insert(0, {tests!r})
from test_spec import good
from kvwrite.ops import spec
from kvwrite.compat import vllm, flashinfer, sglang
from torch._dynamo.utils import counters

def run(name, fn, make):
    torch._dynamo.reset()
    counters.clear()
    torch.manual_seed(0)
    eager = make()
    torch.manual_seed(0)
    comp = make()
    fn(*eager)
    torch.compile(fn, fullgraph=True)(*comp)   # the default backend: inductor
    same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(eager, comp)
               if isinstance(a, torch.Tensor) and a.dtype != torch.bool)
    breaks = sum(counters["graph_break"].values())
    print(name, "ok" if same and not breaks else f"FAIL same={{same}} breaks={{breaks}}", flush=True)

for op in sorted(spec.OPS):
    def make(op=op):
        a = good(op); a["check"] = None; a["backend"] = "auto"
        return list(a.values())
    run(op, lambda *a, op=op: spec.OPS[op].entry(*a), make)

def table_args():
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    pt = (torch.tensor([0, 0, 1]), torch.tensor([0, 5, 2]), torch.tensor([1, 3, 0]), torch.tensor([0, 2, 3]))
    return [k, v, torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16), *pt]
run("store_kv PageTable", lambda k, v, kc, vc, b, p, i, ip: kvwrite.store_kv(k, v, kc, vc, kvwrite.PageTable(b, p, i, ip)), table_args)
run("flashinfer.append_paged_kv_cache",
    lambda k, v, kc, vc, b, p, i, ip: flashinfer.append_paged_kv_cache(k, v, b, p, (kc, vc), i, ip, torch.tensor([1, 1])),
    table_args)
def kv_args():
    return [torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16), torch.tensor([0, 5, 9])]
run("vllm.reshape_and_cache_flash", lambda k, v, kc, vc, s: vllm.reshape_and_cache_flash(k, v, kc, vc, s, "auto", None, None), kv_args)
run("sglang.set_kv_buffer", lambda k, v, kc, vc, s: sglang.set_kv_buffer(kc.view(16, 2, 16), vc.view(16, 2, 16), s, k, v, 4), kv_args)
def quant_args():
    k, v = torch.randn(3, 2, 16), torch.randn(3, 2, 16)
    kc, vc = torch.zeros(4, 4, 2, 16, dtype=torch.int8), torch.zeros(4, 4, 2, 16, dtype=torch.int8)
    return [k, v, kc, vc, torch.tensor([0, 5, 9]), torch.zeros(4, 4, 2), torch.zeros(4, 4, 2)]
run("store_kv int8 per token-head", lambda k, v, kc, vc, s, ks, vs: kvwrite.store_kv(
    k, v, kc, vc, s, k_scale_cache=ks, v_scale_cache=vs, quant_rule="vllm"), quant_args)
def rope_kv_args():
    g = torch.Generator().manual_seed(1)
    return [torch.tensor([0, 3, 7]), torch.randn(3, 4, 16, generator=g), torch.randn(3, 2, 16, generator=g),
            torch.randn(3, 2, 16, generator=g), torch.randn(8, 16, generator=g), torch.zeros(4, 4, 2, 16),
            torch.zeros(4, 4, 2, 16), torch.tensor([0, 5, 9])]
run("rope_store_kv", lambda p, q, k, v, cs, kc, vc, s: kvwrite.rope_store_kv(p, q, k, v, cs, kc, vc, s), rope_kv_args)
def rope_mla_args():
    g = torch.Generator().manual_seed(2)
    return [torch.tensor([0, 3, 7]), torch.randn(3, 2, 16, generator=g), torch.randn(3, 128, generator=g),
            torch.randn(3, 16, generator=g), torch.randn(8, 16, generator=g), torch.zeros(4, 4, 144),
            torch.tensor([0, 5, 9])]
run("rope_store_mla", lambda p, q, c, pe, cs, kc, s: kvwrite.rope_store_mla(p, q, c, pe, cs, kc, s), rope_mla_args)
def mla_args():
    return [torch.randn(3, 128), torch.randn(3, 16), torch.zeros(4, 4, 144), torch.tensor([0, 5, 9])]
run("vllm.concat_and_cache_mla", lambda c, p, kc, s: vllm.concat_and_cache_mla(c, p, kc, s, "auto", None), mla_args)
# the page moves (gather and slot_mapping return new tensors: compared through a copy into an input;
# -1 entries are padding)
def pools():
    return [torch.randn(8, 4, 2, 16), torch.zeros(8, 4, 2, 16), torch.tensor([0, 3, 6]), torch.tensor([5, 1, 2])]
run("copy_pages", lambda s, d, sp, dp: kvwrite.copy_pages(s, d, sp, dp), pools)
def gather_args():
    return [torch.randn(8, 4, 2, 16), torch.tensor([0, 5, 9, -1]), torch.zeros(4, 2, 16)]
run("gather", lambda c, l, o: o.copy_(kvwrite.gather(c, l)), gather_args)
geo = kvwrite.PageGeometry.from_pool(8, 4)
def slot_args():
    return [torch.tensor([[0, 3], [5, 1]]), torch.tensor([0, 1, 1, -1]), torch.tensor([1, 2, 5, 0]), torch.zeros(4, dtype=torch.int64)]
run("slot_mapping", lambda bt, b, p, o: o.copy_(kvwrite.slot_mapping(bt, b, p, geo)), slot_args)
def move_args():
    return [torch.randn(8, 4, 2, 16), torch.tensor([0, 5, -1]), torch.tensor([9, 12, 3])]
run("move_rows", lambda c, s, d: kvwrite.move_rows(c, s, d), move_args)
'''


@pytest.mark.parametrize("env_check", ["", "guard"])
def test_torch_compile_first_call_of_every_op_and_adapter(env_check):
    env = dict(os.environ, KVWRITE_CHECK=env_check)
    out = subprocess.run([sys.executable, "-c", COMPILE_SCRIPT.format(tests=str(ROOT / "tests"))],
                         env=env, capture_output=True, text=True, timeout=600)
    lines = out.stdout.splitlines()
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    assert all(line.endswith(" ok") for line in lines), (lines, out.stderr[-3000:])
    assert len(lines) == len(OPS) + 12


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_adapter_errors_name_the_engines_arguments_and_call(backend):
    """An adapter runs the op's own entry (same fast path); its errors say the engine's words."""
    from kvwrite.compat import flashinfer, vllm

    k, kc = torch.randn(3, 2, 16), torch.zeros(4, 4, 2, 16)
    with pytest.raises(TypeError, match=r"^reshape_and_cache_flash: slot_mapping must have dtype in \(int32, int64\)"):
        vllm.reshape_and_cache_flash(k, k, kc, kc.clone(), torch.tensor([0.0, 1.0, 2.0]), "auto", None, None,
                                     backend=backend)
    with pytest.raises(ValueError, match=r"^reshape_and_cache_flash: value_cache must have shape \[4, 4, 2, 16\]"):
        vllm.reshape_and_cache_flash(k, k, kc, kc[..., :8], torch.tensor([0, 1, 2]), "auto", None, None,
                                     backend=backend)
    pt = (torch.tensor([0, 0, 1]), torch.tensor([0, 5, 2]), torch.tensor([1, 3, 0]), torch.tensor([0, 2, 3]))
    with pytest.raises(ValueError, match=r"^append_paged_kv_cache: paged_kv_cache\[1\] must have shape"):
        flashinfer.append_paged_kv_cache(k, k, pt[0], pt[1], (kc, kc[..., :8]), pt[2], pt[3], torch.tensor([1, 1]),
                                         backend=backend)
    with pytest.raises(ValueError, match=r"^append_paged_kv_cache: kv_indices must be 1-D"):
        flashinfer.append_paged_kv_cache(k, k, pt[0], pt[1], (kc, kc.clone()), pt[2][None], pt[3],
                                         torch.tensor([1, 1]), backend=backend)
