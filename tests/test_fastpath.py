"""The host fast path: torch.ops.kvwrite.* with the extension's C++ validation + dispatch.

- Every bad-argument case of the op test files raises, through the C++ op (kvwrite.store_* with
  backend "cpu"/"auto", and torch.ops.kvwrite.* called directly), exactly the exception type and
  text of the Python validation, before any write: the C++ matcher (fed by the op's spec) refuses
  the call and hands it to the Python implementation, which names the error.
- The calls the C++ kernels hand to Python (other backends, guard without a buffer, CPU assert).
- The Python validation memo (torch / triton backends) and the C++ path after a tensor is
  resized, re-strided, re-typed or put on another device between calls.
- torch.compile(fullgraph=True) traces the op; the fake kernel validates.
"""
from __future__ import annotations

import inspect

import pytest
import torch

import kvwrite
import test_api
import test_dsv4
import test_dsv4_fp4
import test_indexer_k
import test_mla
import test_nvfp4
from kvwrite import _ext
from kvwrite.ops import _library

pytestmark = pytest.mark.skipif(_ext.unavailable_reason("cpu") is not None,
                                reason=f"extension unavailable: {_ext.unavailable_reason('cpu')}")



def _store_kv_case(over):
    over = dict(over)
    a = test_api.args(**{k: v for k, v in over.items() if k in ("k", "v", "k_cache", "v_cache", "loc")})
    kw = {k: v for k, v in over.items() if k not in a}
    return kvwrite.store_kv, [a["k"], a["v"], a["k_cache"], a["v_cache"], a["loc"]], kw, [a["k_cache"], a["v_cache"]]


def _store_mla_case(over):
    a = test_mla.args(**over)
    kw = {k: v for k, v in a.items() if k not in ("kv_c", "k_pe", "kv_cache", "loc")}
    return kvwrite.store_mla, [a["kv_c"], a["k_pe"], a["kv_cache"], a["loc"]], kw, [a["kv_cache"]]


def _indexer_case(over):
    a = test_indexer_k.args(**over)
    kw = {k: v for k, v in a.items() if k not in ("k", "cache", "loc")}
    return kvwrite.store_indexer_k, [a["k"], a["cache"], a["loc"]], kw, [a["cache"]]


def _nvfp4_case(over):
    names = ("k", "v", "k_cache", "v_cache", "k_scale_cache", "v_scale_cache", "loc")
    a = test_nvfp4.api_args(**{k: v for k, v in over.items() if k in names})
    kw = {k: v for k, v in over.items() if k not in a}
    return kvwrite.store_kv_nvfp4, [a[n] for n in names], kw, [a[n] for n in names[2:6]]


def _mla_nvfp4_case(over):
    a = test_nvfp4.mla_args(**over)
    kw = dict(kv_cache_dtype="nvfp4", scale_cache=a["scale_cache"], global_scale=a.get("global_scale"))
    caches = [a["kv_cache"]] + ([a["scale_cache"]] if a["scale_cache"] is not None else [])
    return kvwrite.store_mla, [a["kv_c"], a["k_pe"], a["kv_cache"], torch.tensor([0, 1])], kw, caches


def _dsv4_case(fn, page_bytes):
    def case(over):
        a = dict(kv=torch.randn(2, 512), cache=torch.zeros(3, page_bytes, dtype=torch.uint8), loc=torch.tensor([0, 5]))
        a.update(over)
        return fn, [a["kv"], a["cache"], a["loc"]], {k: v for k, v in a.items() if k not in ("kv", "cache", "loc")}, \
            [a["cache"]]
    return case


CASES = ([("store_kv", _store_kv_case, c) for c in test_api.BAD]
         + [("store_dsv4_kv", _dsv4_case(kvwrite.store_dsv4_kv, 2880), c) for c in test_dsv4.BAD]
         + [("store_dsv4_kv_fp4", _dsv4_case(kvwrite.store_dsv4_kv_fp4, 1536), c) for c in test_dsv4_fp4.BAD]
         + [("store_mla", _store_mla_case, c) for c in test_mla.BAD]
         + [("store_indexer_k", _indexer_case, c) for c in test_indexer_k.BAD]
         + [("store_kv_nvfp4", _nvfp4_case, c) for c in test_nvfp4.BAD]
         + [("store_mla", _mla_nvfp4_case, c) for c in test_nvfp4.MLA_BAD])


def _outcome(fn, *args, **kw):
    try:
        fn(*args, **kw)
    except Exception as exc:  # noqa: BLE001 - the exception is the result
        return type(exc), str(exc)
    return None


def _schema_call(op: str, fn, args, kw):
    """`fn`'s call as keyword arguments of torch.ops.kvwrite.<op> (same names), or None if some
    argument does not fit the schema (the parser refuses it before any kvwrite code runs)."""
    bound = inspect.signature(fn).bind(*args, **kw)
    bound.apply_defaults()
    call = dict(bound.arguments)
    if isinstance(call.get("errors"), kvwrite.ErrorBuffer):
        call["errors"] = call["errors"].tensor
    schema = getattr(torch.ops.kvwrite, op).default._schema
    names = [a.name for a in schema.arguments if a.name in call]   # the page-table tail: defaults
    for arg in schema.arguments:
        if arg.name not in call:
            continue
        value, t = call[arg.name], str(arg.type)
        ok = {"Tensor": isinstance(value, torch.Tensor), "Optional[Tensor]": value is None or isinstance(value, torch.Tensor),
              "int": type(value) is int, "str": type(value) is str,
              "Optional[str]": value is None or type(value) is str,
              "Optional[int]": value is None or type(value) is int}[t]
        if not ok:
            return None
    # Only the schema's arguments: the Python function may take more (e.g. store_kv's per-token
    # scale caches, which the C++ op does not take; they are None here).
    extra = {n: v for n, v in call.items() if n not in {a.name for a in schema.arguments}}
    if any(v is not None for v in extra.values()):
        return None
    return {n: call[n] for n in names}


@pytest.mark.parametrize("op, case, bad", CASES, ids=[f"{o}-{c[2][:40]}" for o, _, c in CASES])
@pytest.mark.parametrize("backend", ["cpu", "auto"])
def test_cpp_validation_raises_the_python_error_before_any_write(op, case, bad, backend):
    over, exc, msg = bad
    fn, args, kw, caches = case(over)
    before = [c.clone() for c in caches]
    python = _outcome(fn, *args, **dict(kw, backend=kw.get("backend", "torch")))
    assert python is not None and python[0] is exc, python
    run_kw = dict(kw, backend=kw.get("backend", backend))
    forwarded = dict(_library.FORWARDED)
    assert _outcome(fn, *args, **run_kw) == python
    call = _schema_call(op, fn, args, run_kw)
    if call is not None:
        assert _outcome(getattr(torch.ops.kvwrite, op), **call) == python
        # the C++ matcher refuses, the Python implementation explains: one message producer
        assert _library.FORWARDED != forwarded, f"C++ raised {python[1]!r}"
    assert all(torch.equal(b.view(torch.uint8), c.view(torch.uint8)) for b, c in zip(before, caches))


# --- what the C++ kernels run themselves, and what they hand to Python --------------------------

def _kv(n=3, pages=4, pps=4, h=2, d=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k, v = torch.randn(n, h, d, generator=gen), torch.randn(n, h, d, generator=gen)
    return k, v, torch.zeros(pages, pps, h, d), torch.zeros(pages, pps, h, d)


def _op_args(k, v, kc, vc, loc, check="off", errors=None, backend="cpu"):
    return (k, v, kc, vc, loc, "NHD", None, None, check, errors, None, 0, 1, backend)


def test_good_calls_run_in_cpp_and_match_the_reference():
    k, v, kc, vc = _kv()
    ref_k, ref_v = kc.clone(), vc.clone()
    loc = torch.tensor([3, -1, 14])
    errs, ref_errs = kvwrite.ErrorBuffer(), kvwrite.ErrorBuffer()
    forwarded = dict(_library.FORWARDED)
    kvwrite.store_kv(k, v, kc, vc, loc, check="guard", errors=errs)
    torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, loc, "guard", errs.tensor))
    torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([1, 2, 99]), "guard", errs.tensor, "auto"))
    assert _library.FORWARDED == forwarded
    for _ in range(2):  # as many calls as above: the record counts calls (its epoch)
        kvwrite.store_kv(k, v, ref_k, ref_v, loc, check="guard", errors=ref_errs, backend="torch")
    kvwrite.store_kv(k, v, ref_k, ref_v, torch.tensor([1, 2, 99]), check="guard", errors=ref_errs, backend="torch")
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    # the record's fields and count agree; OWNER/EPOCH count calls (three here, two for the reference)
    owner = kvwrite.errors.OWNER
    assert torch.equal(errs.tensor[:owner], ref_errs.tensor[:owner]) and errs.error().loc == 99


def test_every_op_with_a_cpp_kernel_runs_its_good_calls_there():
    """The host-cost table's good call of every op (hand-written launchers and the generic one,
    `run_raw`, which reads the raw kernel's arguments by name) runs in C++: nothing is handed to
    the Python twin; the ops without a C++ launcher are the ones spec.Op says have none."""
    from kvwrite.bench import spec_host
    from kvwrite.ops import spec

    forwarded = dict(_library.FORWARDED)
    for _, fn, _, base, _ in spec_host.cases():
        fn()
        base()
    assert _library.FORWARDED == forwarded
    no_kernel = {n for n, op in spec.OPS.items() if not op.native()}
    assert no_kernel == {n for n, op in spec.OPS.items() if op.program() is None}


def _variants(dev: str = "cpu"):
    """Good calls of the formats and layouts the expression rules (spec.rule(expr=...)) decide:
    (name, fn(backend), the tensors it writes)."""
    from kvwrite.ops.dsv4 import kv_page_bytes

    g = torch.Generator().manual_seed(1)
    T = lambda x: torch.tensor(x, device=dev)  # noqa: E731
    bf, u8, e4 = torch.bfloat16, torch.uint8, torch.float8_e4m3fn
    rnd = lambda *s: torch.randn(*s, generator=g).to(dev, bf)  # noqa: E731
    loc = T([5, -1, 17])
    k, v, one = rnd(3, 2, 32), rnd(3, 2, 32), T(0.05)
    z = lambda *s, dt=bf: torch.zeros(*s, dtype=dt, device=dev)  # noqa: E731
    out = []
    for layout, shape in (("NHD", (4, 8, 2, 32)), ("HND", (4, 2, 8, 32)), ("cpu_attn", (4, 2, 8, 32))):
        kc, vc = z(*shape), z(*shape)
        out.append((f"store_kv {layout}", lambda b, kc=kc, vc=vc, layout=layout:
                    kvwrite.store_kv(k, v, kc, vc, loc, layout=layout, backend=b), [kc, vc]))
    f32 = torch.float32
    kc, vc, ks, vs = z(4, 8, 2, 16, dt=u8), z(4, 8, 2, 16, dt=u8), z(4, 8, 2, dt=f32), z(4, 8, 2, dt=f32)
    out.append(("store_kv int4", lambda b: kvwrite.store_kv(k, v, kc, vc, loc, k_scale_cache=ks, v_scale_cache=vs,
                                                            quant_rule="vllm", backend=b), [kc, vc, ks, vs]))
    hk, hv = z(4, 2, 4, 8, 8), z(4, 2, 32, 8)
    out.append(("store_kv_head_major bf16", lambda b: kvwrite.store_kv_head_major(k, v, hk, hv, loc, backend=b),
                [hk, hv]))
    fk, fv = z(4, 2, 2, 8, 16, dt=e4), z(4, 2, 32, 8, dt=e4)
    out.append(("store_kv_head_major fp8", lambda b: kvwrite.store_kv_head_major(
        k, v, fk, fv, loc, k_scale=one, v_scale=one, backend=b), [fk, fv]))
    for layout in ("NHD", "HND"):
        nv = [z(4, 8, 2, 16, dt=u8), z(4, 8, 2, 16, dt=u8), z(4, 8, 2, 2, dt=e4), z(4, 8, 2, 2, dt=e4)]
        if layout == "HND":
            nv = [t.transpose(1, 2).contiguous() for t in nv]
        out.append((f"store_kv_nvfp4 {layout}", lambda b, nv=nv, layout=layout:
                    kvwrite.store_kv_nvfp4(k, v, *nv, loc, layout=layout, backend=b), nv))
    ik = rnd(3, 128)
    for qbs, fmt in ((128, None), (64, "ue8m0")):
        ic = z(4, 8 * (128 + 128 // qbs * 4), dt=u8)
        out.append((f"store_indexer_k qbs={qbs} {fmt}", lambda b, ic=ic, qbs=qbs, fmt=fmt: kvwrite.store_indexer_k(
            ik, ic, loc, quant_block_size=qbs, scale_fmt=fmt, backend=b), [ic]))
    for fmt, sf, page_size, row in (("fp8", "ue8m0", None, 132), ("mxfp4", None, 8, 68)):
        dc = z(4, 8 * row, dt=u8)
        out.append((f"store_dsv4_indexer_k {fmt}", lambda b, dc=dc, fmt=fmt, sf=sf, ps=page_size:
                    kvwrite.store_dsv4_indexer_k(ik, dc, loc, fmt=fmt, scale_fmt=sf, page_size=ps, backend=b), [dc]))
    dkv, dcache = rnd(3, 512), z(4, kv_page_bytes(8), dt=u8)
    out.append(("store_dsv4_kv", lambda b: kvwrite.store_dsv4_kv(dkv, dcache, loc, backend=b), [dcache]))
    from kvwrite.facts import FP4_RECORDS, MLA_FORMATS
    kv_c, k_pe = rnd(3, 128), rnd(3, 64)
    for name, f in MLA_FORMATS.items():
        mc = z(4, 8, f.row_width(128, 64), dt=f.cache_dtype(bf))
        kw = {"scale": one} if f.takes_scale else {}
        written = [mc]
        if f.takes_scale_cache:
            kw["scale_cache"] = z(4, 8, (128 + 64) // 16, dt=e4)
            written.append(kw["scale_cache"])
        out.append((f"store_mla {name}", lambda b, mc=mc, name=name, kw=kw: kvwrite.store_mla(
            kv_c, k_pe, mc, loc, kv_cache_dtype=name, backend=b, **kw), written))
    for fmt, rec in FP4_RECORDS.items():
        fc = z(4, 8 * rec.token_bytes, dt=u8)
        out.append((f"store_dsv4_kv_fp4 {fmt}", lambda b, fc=fc, fmt=fmt: kvwrite.store_dsv4_kv_fp4(
            dkv, fc, loc, fmt=fmt, page_size=8 if fmt == "mxfp4" else None, backend=b), [fc]))
    rc, rq, rcs = z(4, 8 * FP4_RECORDS["nvfp4"].token_bytes, dt=u8), rnd(3, 2, 64), rnd(8, 64).float()
    out.append(("rope_store_dsv4_kv_fp4 nvfp4", lambda b: kvwrite.rope_store_dsv4_kv_fp4(
        T([1, 2, 3]), dkv, rcs, rc, loc, q=rq.clone(), backend=b), [rc]))
    src, pool = rnd(3, 64), z(32, 64)
    out.append(("store_rows", lambda b: kvwrite.store_rows(src, pool, loc, backend=b), [pool]))
    pos, q, cs = T([1, 2, 3]), rnd(3, 4, 32), rnd(8, 32)
    for what, caches, kw in (("copy", (z(4, 8, 2, 32), z(4, 8, 2, 32)), {}),
                             ("int8 per token", (z(4, 8, 2, 32, dt=torch.int8), z(4, 8, 2, 32, dt=torch.int8)),
                              {"k_scale_cache": z(4, 8, dt=f32), "v_scale_cache": z(4, 8, dt=f32)})):
        out.append((f"rope_store_kv {what}", lambda b, c=caches, kw=kw: kvwrite.rope_store_kv(
            pos, q.clone(), k, v, cs, *c, loc, backend=b, **kw), [*caches, *kw.values()]))
    i8 = torch.int8
    for what, dt, kw in (("fp8 static", e4, {"k_scale": one, "v_scale": one}),
                         ("int8 static", i8, {"k_scale": one, "v_scale": one}),
                         ("int8 per token", i8, {"k_scale_cache": z(4, 8, dt=f32), "v_scale_cache": z(4, 8, dt=f32)}),
                         ("int8 per token-head vllm", i8, {"k_scale_cache": z(4, 8, 2, dt=f32),
                                                           "v_scale_cache": z(4, 8, 2, dt=f32), "quant_rule": "vllm"})):
        caches = (z(4, 8, 2, 32, dt=dt), z(4, 8, 2, 32, dt=dt))
        scales = [t for n, t in kw.items() if n.endswith("cache")]
        out.append((f"store_kv {what}", lambda b, c=caches, kw=kw: kvwrite.store_kv(k, v, *c, loc, backend=b, **kw),
                    [*caches, *scales]))
    nw = torch.rand(32, generator=g).to(dev)
    rk = (z(4, 8, 2, 32), z(4, 8, 2, 32))
    out.append(("rope_store_kv norm", lambda b: kvwrite.rope_store_kv(
        pos, q.clone(), k, v, cs, *rk, loc, q_norm_weight=nw, k_norm_weight=nw, norm_eps=1e-5, backend=b), list(rk)))
    mc, qpe = z(4, 8, 192), rnd(3, 4, 64)
    out.append(("rope_store_mla", lambda b: kvwrite.rope_store_mla(pos, qpe.clone(), kv_c, k_pe, rcs[:, :64].to(bf), mc,
                                                                  loc, is_neox=True, backend=b), [mc]))
    src4, dst8 = rnd(4, 8, 2, 32), z(8, 4, 2, 32)
    out.append(("copy_pages 8 -> 4 rows a page", lambda b: kvwrite.copy_pages(src4, dst8, T([0, 3]), T([5, 1]),
                                                                             backend=b), [dst8]))
    out.append(("gather", lambda b: [kvwrite.gather(src4, loc, backend=b)], []))
    moved = z(4, 8, 2, 32)
    out.append(("move_rows", lambda b: kvwrite.move_rows(moved.copy_(src4), T([1, 30, 7]), T([9, 1, 31]), backend=b),
                [moved]))
    table, batch = T([[3, 1], [0, 2]]), T([0, 1, 1])
    out.append(("slot_mapping", lambda b: [kvwrite.slot_mapping(table, batch, T([1, 9, 2]),
                                                                 kvwrite.PageGeometry(8, 4), backend=b)], []))
    return out


DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() and _ext.unavailable_reason("cuda") is None else [])


@pytest.mark.parametrize("dev", DEVICES)
@pytest.mark.parametrize("i", range(len(_variants())), ids=[c[0] for c in _variants()])
def test_every_format_the_expression_rules_decide_runs_in_cpp(i, dev):
    """Each format / layout of the ops whose checks are expressions runs in C++ (no call handed
    to Python; on a GPU the kernels registered when the specs arrived) and writes the torch
    reference's bytes."""
    _, fn, written = _variants(dev)[i]
    forwarded = dict(_library.FORWARDED)
    got = fn(dev)
    assert _library.FORWARDED == forwarded
    want_written = [t.clone() for t in written]
    for t in written:
        t.zero_()
    want = fn("torch")
    for t, w in zip(written, want_written):
        assert torch.equal(t.view(torch.uint8), w.view(torch.uint8))
    if got is not None:
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_an_expression_rule_naming_nothing_known_is_refused_when_the_spec_arrives():
    """csrc/expr.h compiles a rule, and a raw line's condition, when the program is sent: an
    unknown name, argument or a syntax error is an error there (naming the text), never a
    per-call surprise."""
    from kvwrite.ops import spec

    text = spec.OPS["store_rows"].program()
    raw = next(line for line in text.splitlines() if line.startswith("raw "))
    for bad, why in (("X S + nonsense > 0", "nonsense, not an env slot or local"),
                     ("X $nothing == 1", r"\$nothing, not an argument"), ("X (S > 0", r"expected '\)'"),
                     (raw + " if nonsense > 0", "nonsense, not an env slot or local"),
                     (raw.replace("raw store_rows", "raw store_nothing"), "raw kernel store_nothing is not"),
                     (raw + f" t{len(spec.TAIL_FIELDS)}", "names no field of the addressing tail")):
        with pytest.raises(RuntimeError, match=why):
            torch.ops.kvwrite_ext.set_program("store_rows", text + "\n" + bad)
    spec.send_programs()


def test_a_format_choice_is_declared_once():
    """store_kv's and rope_store_kv's plain-or-quantised choice is one declaration (ops.kv.plain):
    each program has a raw line a format, in the formats' order, with that format's condition;
    csrc/api.h names no op (no launcher of its own)."""
    import re

    from kvwrite.ops import kv, spec

    for name, kernels in (("store_kv", ["store_kv_int4", "store_kv", "store_kv_quant"]),
                          ("rope_store_kv", ["rope_store_kv", "rope_store_kv_quant"])):
        op = spec.OPS[name]
        raws = [line for line in op.program().splitlines() if line.startswith("raw ")]
        assert [line.split()[1] for line in raws] == kernels
        assert [line.partition(" if ")[2] or None for line in raws] == [f.when and f.when.expr for f in op.formats]
    assert spec.OPS["rope_store_kv"].formats[0].when is kv.plain is spec.OPS["store_kv"].formats[1].when
    code = [line for line in (_ext.csrc_dir() / "api.h").read_text().splitlines() if not line.lstrip().startswith("//")]
    assert not [line for line in code if re.search(r'"kvwrite::\w+"', line)]


def test_a_call_no_raw_line_takes_goes_to_python():
    """pick_raw: when no raw line's condition holds the C++ kernel runs nothing and hands the
    call, unchanged, to the Python implementation."""
    from kvwrite.ops import spec

    k, v, kc, vc = _kv()
    text = spec.OPS["store_kv"].program()
    never = "\n".join(line.partition(" if ")[0] + " if 0" if line.startswith("raw ") else line
                      for line in text.splitlines())
    n0 = _library.FORWARDED.get("store_kv", 0)
    try:
        torch.ops.kvwrite_ext.set_program("store_kv", never)
        torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([0, 5, 9])))
    finally:
        spec.send_programs()
    assert _library.FORWARDED["store_kv"] == n0 + 1 and torch.equal(kc.view(-1, 2, 16)[[0, 5, 9]], k)


def test_a_raw_argument_without_a_source_is_refused(monkeypatch):
    """The generic launcher's sources are resolved from the declaration: a raw kernel's argument
    that is neither the tail, an argument, an env slot nor in raw_args is an error naming it."""
    from kvwrite.ops import spec

    op = spec.OPS["store_indexer_k"]
    assert "raw store_indexer_k" in op.program()
    monkeypatch.setattr(op, "raw_args", {"quant_block_size": "a:quant_block_size"})
    with pytest.raises(ValueError, match="store_indexer_k: no value for argument 'ue8m0' of its raw kernel"):
        op.program()


def _raw_path_cases():
    """The calls the C++ side once ran through launchers of their own, each on caches carved out of
    one canary buffer: (name, fn(buffer, loc, **call keywords), {cache: (shape, dtype)})."""
    g = torch.Generator().manual_seed(3)
    bf, u8, e4, i8, f32 = torch.bfloat16, torch.uint8, torch.float8_e4m3fn, torch.int8, torch.float32
    rnd = lambda *s: torch.randn(*s, generator=g).to(bf)  # noqa: E731
    one = torch.tensor(0.05)
    k, v, pos, q, cs = rnd(4, 2, 32), rnd(4, 2, 32), torch.tensor([1, 2, 3, 0]), rnd(4, 3, 32), rnd(8, 32)
    nw = torch.rand(32, generator=g).to(bf)
    kv4 = lambda dt, d=32: {"kc": ((4, 8, 2, d), dt), "vc": ((4, 8, 2, d), dt)}  # noqa: E731
    scales = lambda *s: {"k_scale_cache": (s, f32), "v_scale_cache": (s, f32)}  # noqa: E731
    int4, tok, head = {**kv4(u8, 16), **scales(4, 8, 2)}, {**kv4(i8), **scales(4, 8)}, {**kv4(e4), **scales(4, 8, 2)}

    def given(buf, names):   # the scale caches a case's buffer holds
        return {n: buf[n] for n in names if n in buf.specs}

    def store(**kw):
        return lambda buf, loc, **c: kvwrite.store_kv(k, v, buf["kc"], buf["vc"], loc, **given(buf, scales()), **kw,
                                                      **c)

    def rope(**kw):
        return lambda buf, loc, **c: kvwrite.rope_store_kv(pos, q.clone(), k, v, cs, buf["kc"], buf["vc"], loc,
                                                           **given(buf, scales()), **kw, **c)

    return [
        ("store_kv int4", store(quant_rule="vllm"), int4),
        ("store_kv cpu_attn", store(layout="cpu_attn"), {"kc": ((4, 2, 8, 32), bf), "vc": ((4, 2, 8, 32), bf)}),
        ("store_kv int8 per token [P, S] scales", store(), tok),
        ("store_kv_head_major fp8", lambda buf, loc, **c: kvwrite.store_kv_head_major(
            k, v, buf["hk"], buf["hv"], loc, k_scale=one, v_scale=one, **c),
         {"hk": ((4, 2, 2, 8, 16), e4), "hv": ((4, 2, 32, 8), e4)}),
        ("rope_store_kv int8 per token [P, S] scales", rope(), tok),
        ("rope_store_kv e4m3 per token-head vllm", rope(quant_rule="vllm"), head),
        ("rope_store_kv bf16 norm weights", rope(q_norm_weight=nw, k_norm_weight=nw, norm_eps=1e-5), kv4(bf)),
        ("move_rows", lambda buf, loc, **c: kvwrite.move_rows(buf["pool"], torch.tensor([1, 30, 7, 9]), loc, **c),
         {"pool": ((4, 8, 2, 32), bf)}),
    ]


@pytest.mark.parametrize("check", ["off", "guard"])
@pytest.mark.parametrize("i", range(len(_raw_path_cases())), ids=[c[0] for c in _raw_path_cases()])
def test_raw_paths_write_the_references_bytes_and_no_canary(i, check):
    """Each format that picks another raw kernel or cache view (int4, cpu_attn's key tiles, [P, S]
    scale caches, head-major views, the _quant RoPE store, norm weights in the input dtype, the
    move_rows raw op) runs in C++ and writes the torch reference's bytes and guard record (a loc
    past the pool in guard mode), no byte around the caches touched."""
    from helpers import CanaryBuffer, assert_same_bytes

    name, fn, caches = _raw_path_cases()[i]
    buf = CanaryBuffer(caches, seed=i, device=torch.device("cpu"))
    for n, (_, dt) in caches.items():   # finite values where a store or move reads the pool
        if dt.is_floating_point and dt.itemsize > 1:
            buf[n].copy_(torch.randn(buf[n].shape))
    original, ref = buf.raw.clone(), buf.clone()
    errs, ref_errs = kvwrite.ErrorBuffer(), kvwrite.ErrorBuffer()
    loc = torch.tensor([5, -1, 17, 64 if check == "guard" else 3])
    forwarded = dict(_library.FORWARDED)
    fn(buf, loc, backend="cpu", check=check, errors=errs)
    pairs = name == "move_rows" and check != "off"   # a page move's pairs: the Python pre-pass
    assert (_library.FORWARDED == forwarded) != pairs
    fn(ref, loc, backend="torch", check=check, errors=ref_errs)
    assert_same_bytes(buf, ref, original)
    owner = kvwrite.errors.OWNER
    assert torch.equal(errs.tensor[:owner], ref_errs.tensor[:owner])
    assert (errs.error() is not None) == (check == "guard")


def test_other_backends_go_to_the_python_implementation():
    k, v, kc, vc = _kv()
    ref_k, ref_v = kc.clone(), vc.clone()
    n0 = _library.FORWARDED.get("store_kv", 0)
    torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([0, 5, 9]), backend="torch"))
    assert _library.FORWARDED["store_kv"] == n0 + 1
    kvwrite.store_kv(k, v, ref_k, ref_v, torch.tensor([0, 5, 9]), backend="cpu")
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    with pytest.raises(kvwrite.BackendUnavailable, match="store_kv: backend='cuda' is unavailable on cpu"):
        torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([0, 5, 9]), backend="cuda"))


def test_guard_without_a_buffer_records_into_the_default_buffer():
    k, v, kc, vc = _kv()
    default = kvwrite.default_errors("cpu")
    default.reset()
    torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([0, 77, 1]), "guard"))
    assert default.error().token_index == 1 and default.error().loc == 77
    kvwrite.store_kv(k, v, kc, vc, torch.tensor([0, 1, 88]), check="guard")
    assert default.error().count == 2
    default.reset()


@pytest.mark.parametrize("direct", [False, True])
def test_cpu_assert_raises_out_of_bounds_write_with_the_record(direct):
    k, v, kc, vc = _kv()
    before = kc.clone()
    with pytest.raises(kvwrite.OutOfBoundsWrite) as info:
        if direct:
            torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([0, 16, 40]), "assert"))
        else:
            kvwrite.store_kv(k, v, kc, vc, torch.tensor([0, 16, 40]), check="assert", backend="cpu")
    e = info.value
    assert (e.op, e.token_index, e.loc, e.page, e.num_pages, e.count) == ("store_kv", 1, 16, 4, 4, 2)
    assert torch.equal(kc, before)


# --- memo and changed tensors ------------------------------------------------------------------

# The Python validation memo (torch; triton: its launch memo too, under the interpreter here) and
# the C++ path (cpu).
MEMO_BACKENDS = [b for b in ("torch", "triton", "cpu") if kvwrite.backends("cpu")[b] is None]

@pytest.mark.parametrize("backend", MEMO_BACKENDS)
def test_resized_cache_is_checked_again(backend):
    k, v, kc, vc = _kv()
    loc = torch.tensor([0, 1, 2])
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    kc.resize_(4, 4, 2, 8)
    with pytest.raises(ValueError, match=r"k_cache must have shape \[4, 4, 2, 16\]"):
        kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    kc.resize_(2, 4, 2, 16)  # fewer pages: the shapes disagree with v_cache
    with pytest.raises(ValueError, match=r"v_cache must have shape \[2, 4, 2, 16\]"):
        kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    vc.resize_(2, 4, 2, 16)
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)  # a valid smaller pool again
    assert torch.equal(kc.view(-1, 2, 16)[:3], k)


@pytest.mark.parametrize("backend", MEMO_BACKENDS)
def test_restrided_input_is_checked_again(backend):
    k, v, kc, vc = _kv()
    loc = torch.tensor([0, 1, 2])
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    k.as_strided_((3, 2, 8), (32, 16, 2))  # same storage, last dim no longer contiguous
    with pytest.raises(ValueError, match=r"k must be contiguous in its last dim, got strides \(32, 16, 2\)"):
        kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    before = kc.clone()
    loc = torch.arange(6)[:3]
    kvwrite.store_kv(v, v, kc, vc, loc, backend=backend)
    loc.as_strided_((3,), (2,))
    with pytest.raises(ValueError, match=r"loc must be contiguous in its last dim, got strides \(2,\)"):
        kvwrite.store_kv(v, v, kc, vc, loc, backend=backend)
    assert torch.equal(kc.view(-1, 2, 16)[3:], before.view(-1, 2, 16)[3:])


@pytest.mark.parametrize("backend", MEMO_BACKENDS)
def test_retyped_tensor_is_checked_again(backend):
    k, v, kc, vc = _kv()
    loc = torch.tensor([0, 1, 2])
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    vc.data = vc.data.to(torch.float16)
    with pytest.raises(TypeError, match=r"v_cache must have dtype in \(float32\), got torch.float16"):
        kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    loc.data = loc.data.to(torch.float32)
    vc.data = vc.data.to(torch.float32)
    with pytest.raises(TypeError, match=r"loc must have dtype in \(int32, int64\), got torch.float32"):
        kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    loc.data = loc.data.to(torch.int32)
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    assert torch.equal(vc.view(-1, 2, 16)[:3], v)


@pytest.mark.parametrize("backend", MEMO_BACKENDS)
def test_tensor_on_another_device_is_checked_again(backend):
    """The memo is keyed by each tensor's facts, device included: a same-shaped tensor on another
    device (meta here; CUDA on a GPU machine) after a passing call is refused, before any write."""
    k, v, kc, vc = _kv()
    loc = torch.tensor([0, 1, 2])
    kvwrite.store_kv(k, v, kc, vc, loc, backend=backend)
    before = kc.clone()
    other = "cuda" if torch.cuda.is_available() else "meta"
    with pytest.raises(ValueError, match=f"v_cache is on {other}.* but the inputs are on cpu"):
        kvwrite.store_kv(k, v, kc, vc.to(other), loc, backend=backend)
    with pytest.raises(ValueError, match=f"loc is on {other}.* but the inputs are on cpu"):
        kvwrite.store_kv(k, v, kc, vc, loc.to(other), backend=backend)
    assert torch.equal(kc, before)


# --- torch.compile -------------------------------------------------------------------------------

def test_torch_compile_fullgraph_runs_the_cpp_op():
    k, v, kc, vc = _kv()
    ref_k, ref_v = kc.clone(), vc.clone()
    errors = kvwrite.ErrorBuffer()

    def layer(k, v, loc):
        k = k * 2
        kvwrite.store_kv(k, v, kc, vc, loc, check="guard", errors=errors, backend="cpu")
        return k.sum()

    forwarded = dict(_library.FORWARDED)
    loc = torch.tensor([1, 20, 70])
    torch.compile(layer, fullgraph=True, backend="eager")(k, v, loc)
    assert _library.FORWARDED == forwarded
    kvwrite.store_kv(k * 2, v, ref_k, ref_v, loc, check="guard", backend="torch", errors=kvwrite.ErrorBuffer())
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert (errors.error().loc, errors.error().count) == (20, 2)


def test_fake_kernel_validates():
    k, v, kc, vc = (t.to("meta") for t in _kv())
    with pytest.raises(ValueError, match=r"k_cache must have shape \[4, 4, 2, 16\]"):
        torch.ops.kvwrite.store_kv(*_op_args(k, v, kc[..., :8], vc, torch.tensor([0, 1, 2], device="meta")))
    torch.ops.kvwrite.store_kv(*_op_args(k, v, kc, vc, torch.tensor([0, 1, 2], device="meta"), "guard"))


# --- pool.store ----------------------------------------------------------------------------------

def _twin_pools(variant, kv="auto", dcp=1, rank=0):
    from config_models import TINY

    conf = kvwrite.KVCacheConfigurator(TINY[variant], kvwrite.ParallelSpec(dcp_size=dcp, dcp_rank=rank),
                                       page_size=4, kv_cache_dtype=kv, max_total_num_tokens=32)
    plan = conf.plan()
    scales = 1.0 if kv.startswith("fp8") else None   # an fp8 pool is built with its scales
    return (plan.build("cpu", check="guard", backend="cpu", scales=scales),
            plan.build("cpu", check="guard", backend="torch", scales=scales))


@pytest.mark.parametrize("variant, kv, dcp", [("mha", "auto", 1), ("mha", "fp8_e4m3", 1), ("mha", "auto", 2),
                                              ("swa_hybrid", "auto", 1), ("hybrid_linear", "auto", 1)])
def test_pool_store_fast_path_matches_the_full_path(variant, kv, dcp):
    """pool.store's bound C++ store (built after the first call) writes the bytes and the record
    the full path writes, SWA loc_map, DCP shard and fp8 unit scales included."""
    fast, ref = _twin_pools(variant, kv, dcp, rank=dcp - 1)
    if variant == "swa_hybrid":
        for p in (fast, ref):
            p.map_swa(torch.arange(8, 24), torch.arange(16))
    gen = torch.Generator().manual_seed(0)
    layers = sorted(fast._layers)
    for step in range(3):
        for lid in layers:
            loc = torch.randperm(100, generator=gen)[:6] - 2  # -2..97: padding and bad locs too
            k, v = fast.sample_inputs(lid, 6, gen)
            forwarded = dict(_library.FORWARDED)
            fast.store(lid, loc, k, v)
            ref.store(lid, loc, k, v)
            if step:
                assert fast._fast.get(lid) is not None and _library.FORWARDED == forwarded
    for name, per_layer in fast.buffers.items():
        for a, b in zip(per_layer, ref.buffers[name]):
            assert all(torch.equal(a[n].view(torch.uint8), b[n].view(torch.uint8)) for n in a)
    assert torch.equal(fast.errors.tensor, ref.errors.tensor) and fast.errors.error() is not None


def test_pool_store_errors_are_the_full_paths():
    fast, ref = _twin_pools("mha")
    k, v = fast.sample_inputs(0, 2)
    fast.store(0, torch.tensor([0, 1]), k, v)
    assert fast._fast
    for args in ((torch.tensor([0, 1]), k), (torch.tensor([0.0, 1.0]), k, v), (torch.tensor([0, 1]), k, v[:, :1])):
        got, want = (_outcome(p.store, 0, *args) for p in (fast, ref))
        assert got is not None and got == want
    assert _outcome(fast.store, 7, torch.tensor([0, 1]), k, v) == _outcome(ref.store, 7, torch.tensor([0, 1]), k, v)


def test_host_cost_table_measures_every_entry_point():
    from kvwrite.bench import host

    rows = host.measure("cpu", min_time=0.002)
    assert [r["what"] for r in rows][:3] == ["kvwrite.store_kv", "kvwrite.store_kv check=guard",
                                            "torch.ops.kvwrite.store_kv"]
    assert {"pool.store (KVPool, mha)", "kvwrite.store_mla", "kvwrite.store_indexer_k",
            "kvwrite.store_kv_nvfp4"} <= {r["what"] for r in rows}
    assert all(r["us"] > 0 and r["vs_us"] > 0 and r["met"] == (r["ratio"] <= r["target"]) for r in rows)
    assert "| call | µs | nearest torch equivalent |" in "\n".join(host.markdown(rows))


@pytest.mark.skipif(not torch.cuda.is_available() or _ext.unavailable_reason("cuda") is not None,
                    reason="needs a CUDA device and the extension's CUDA kernels")
def test_cuda_fast_path_runs_in_cpp_and_is_graph_safe():
    """On CUDA tensors the C++ op validates and launches with no host sync: it captures into a
    CUDA graph, and the replay writes the reference's bytes and guard record."""
    k, v, kc, vc = (t.cuda() for t in _kv())
    ref_k, ref_v = kc.clone(), vc.clone()
    errors, ref_errors = kvwrite.ErrorBuffer("cuda"), kvwrite.ErrorBuffer("cuda")
    loc = torch.tensor([0, 5, 99], device="cuda")
    forwarded = dict(_library.FORWARDED)
    kvwrite.store_kv(k, v, kc, vc, loc, check="guard", errors=errors)  # warm-up, outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvwrite.store_kv(k * 2, v, kc, vc, loc, check="guard", errors=errors)
    graph.replay()
    torch.cuda.synchronize()
    assert _library.FORWARDED == forwarded
    kvwrite.store_kv(k, v, ref_k, ref_v, loc, check="guard", errors=ref_errors, backend="torch")
    kvwrite.store_kv(k * 2, v, ref_k, ref_v, loc, check="guard", errors=ref_errors, backend="torch")
    assert torch.equal(kc, ref_k) and torch.equal(vc, ref_v)
    assert torch.equal(errors.tensor, ref_errors.tensor) and errors.error().count == 2
