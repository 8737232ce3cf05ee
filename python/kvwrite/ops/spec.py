"""One definition per op (`Op`: arguments, addressing, checks, implementations), from which the
schema, validation (`Op.prepare`), fake kernel, dispatch and public call (`Op.entry`) are derived
(docs/architecture.md, layer 3).

Shape letters (`Arg.dims`): "N H D" binds N, H, D from the first tensor that names them; a later
tensor must match. A letter not bound yet shows as `*` in the message and is bound from the
tensor after its check, unless listed in `Arg.binds` (bound from the tensor first: a cache's
pages and rows). "*" is any size, "D/2" a bound letter divided by 2, "512" a size; "scale" /
"scale H" is a dequant scale `[]`, `[1]` (or `[H]`). `Arg.layout`: the dims are the canonical
`[pages, rows, H, ...]`; a call with layout "HND" checks (and names) dims 1 and 2 swapped.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from kvwrite import _ext, validate
from kvwrite.addressing import TABLE_ARGS, prepare as prepare_addressing
from kvwrite.errors import ErrorBuffer
from kvwrite import facts
from kvwrite.geometry import PageGeometry
from kvwrite.ops import _library
from kvwrite.ops._common import NATIVE, canonical_pool, default_record, dispatch
from kvwrite.pagetable import PageTable

NO_DEFAULT = object()
FP8 = tuple(validate.FP8_MAX)
_MEMO: dict = {}
_MEMO_MAX = 1024
OPS: dict[str, "Op"] = {}   # every declared op, by name (tests, docs)


@dataclass(frozen=True)
class Arg:
    """One schema argument. Tensors carry their checks: `dims`, `dtypes` (torch dtypes, or "=x": the
    dtype of x in the env), `what` (names the dims in the shape message, `{letter}` filled in)."""

    name: str
    type: str = "Tensor"      # schema type: Tensor, str, int, bool, float; "?" = optional
    dims: str | None = None
    dtypes: tuple = ()
    mutable: bool = False
    role: str = "input"       # input | cache | scale | option | addressing | check
    what: str = ""
    binds: str = ""
    layout: bool = False
    last_contiguous: bool = True
    default: object = NO_DEFAULT   # the schema's default (trailing arguments)

    @property
    def tokens(self) -> tuple:
        """`dims` parsed: (letter or None, divisor, literal size or None) per dim."""
        out = []
        for tok in (self.dims or "").split():
            if tok == "*":
                out.append((None, 1, None))
            elif tok.isdigit():
                out.append((None, 1, int(tok)))
            else:
                letter, _, div = tok.partition("/")
                out.append((letter, int(div or 1), None))
        return tuple(out)


def T(name: str, dims: str | None = None, dtypes: tuple = (), **kw) -> Arg:
    """A tensor argument."""
    return Arg(name, "Tensor", dims, tuple(dtypes), **kw)


def opt(name: str, dims: str | None = None, dtypes: tuple = (), **kw) -> Arg:
    """An optional tensor argument (None = absent)."""
    return Arg(name, "Tensor?", dims, tuple(dtypes), **kw)


def cache(name: str, dims: str, dtypes: tuple, **kw) -> Arg:
    """A pool tensor the op writes."""
    return Arg(name, "Tensor", dims, tuple(dtypes), mutable=True, role="cache", **kw)


def option(name: str, type_: str = "str", **kw) -> Arg:
    return Arg(name, type_, role="option", **kw)


LOC = Arg("loc", role="addressing")
CHECK = Arg("check", "str", role="check")
ERRORS = Arg("errors", "Tensor?", mutable=True, role="check")
LOC_MAP = Arg("loc_map", "Tensor?", role="addressing")
DCP = (Arg("dcp_rank", "int", role="addressing"), Arg("dcp_size", "int", role="addressing"))
BACKEND = Arg("backend", "str", role="option")
# What every op's schema ends with: the page-table tensors (loc then holds the positions).
TABLE = tuple(Arg(n, "Tensor?", role="addressing", default=None) for n in TABLE_ARGS)


def rule(expr: str) -> Callable:
    """Give an op's check its C++ twin: an expression (csrc/expr.h) the matcher evaluates; a call it
    refuses goes to Python, whose check names the error (without one the op stays on the Python path).
    As `when`: a format's condition, picking the backend table in Python and the raw kernel in C++."""
    def wrap(fn: Callable) -> Callable:
        fn.expr = expr
        return fn
    return wrap


when = rule


@dataclass(frozen=True)
class Format:
    """One format of an op: its backend table, its condition (`when`; None: any; the first that
    holds wins) and the raw kernel of the C++ fast path (default: the table's "cpu" entry)."""

    impls: tuple
    when: Callable | None = None
    raw: str | None = None
    raw_args: dict = field(default_factory=dict)


def switch(name: str, values: dict) -> str:
    """An expression (csrc/expr.h): the int `values` gives the str argument `name`, -1 for any other."""
    return " : ".join([f"${name} == '{k}' ? {v}" for k, v in values.items()] + ["-1"])


def records_per_page(per: str) -> str:
    """An expression: S = the records of `per` bytes in a page of B bytes (facts.records_per_page)."""
    return (f"per = {per}; per > 0; $page_size == None ? B != 0 && B % per == 0 : isint($page_size) && "
            "$page_size >= 1 && $page_size * per == B; S = $page_size == None ? B / per : $page_size")


def choice(name: str, options: tuple) -> Callable:
    """A check: argument `name` is one of `options` (stored in the env under its name)."""
    @rule(f"{name} = {switch(name, dict(zip(options, range(len(options)))))}; {name} >= 0")
    def check(env: dict, v: dict) -> None:
        env[name] = validate.choice(name, v[name], options)
    return check


def geometry(name: str) -> Callable:
    """A check: the pool geometry from the letters P and S the cache `name` bound."""
    @rule("P >= 1 && S >= 1")
    def check(env: dict, v: dict) -> None:
        if env["P"] < 1 or env["S"] < 1:
            raise ValueError(f"{name} must have at least one page of at least one row, got "
                             f"{env['P']} pages of {env['S']}")
        env["geometry"] = PageGeometry.from_pool(env["P"], env["S"])
    return check


def pool(name: str, bind: bool = True) -> Callable:
    """A check: `name` is a pool `[pages, rows, ...]` of any rank >= 2; binds P and S (`bind`)."""
    @rule(f"dim(${name}) >= 2 && size(${name}, 0) >= 1 && size(${name}, 1) >= 1"
          + (f"; P = size(${name}, 0); S = size(${name}, 1)" if bind else ""))
    def check(env: dict, v: dict) -> None:
        c = canonical_pool(name, v[name])
        if bind:
            env["P"], env["S"] = c.shape[0], c.shape[1]
    return check


def pairs(first: str, second: str) -> Callable:
    """A check: 1-D `second` has one entry per entry of `first` (which bound N)."""
    @rule(f"dim(${second}) == 1 && size(${second}, 0) == N")
    def check(env: dict, v: dict) -> None:
        t = v[second]
        if isinstance(t, torch.Tensor) and t.dim() == 1 and t.shape[0] != env["N"]:
            raise ValueError(f"{first} and {second} must pair up one to one, got {env['N']} and "
                             f"{t.shape[0]} entries")
    return check


# The addressing tail of the raw kernels, in order (csrc/api.h `run_raw`, `TAIL_FIELDS`).
TAIL_FIELDS = ("loc", "loc_map", "errors", "dcp_rank", "dcp_size", "check", "op", *TABLE_ARGS)
# Env names the rule expressions read or write beside the letters and the arguments' dtypes.
RULE_SLOTS = ("N", "P", "S", "B", "W", "D", "Dv", "L", "R", "layout", "fmt", "cache_dtype", "quant", "rule")


def _dtype_name(d: object) -> str:
    return d if isinstance(d, str) else str(d).replace("torch.", "")


def _match(a: Arg, t: object, env: dict, name: str) -> None:
    """Check tensor argument `a` (called `name` in messages) against the env and bind its letters."""
    dtypes = tuple(env[d[1:]] if isinstance(d, str) else d for d in a.dtypes) if a.dtypes else None
    device = env.get("device")
    if a.dims is not None and a.dims.startswith("scale"):
        heads = a.dims[5:].strip()
        validate.scale(name, t, env[heads] if heads else None, device)
        return
    toks = a.tokens
    t = validate.tensor(name, t, ndim=len(toks) if a.dims is not None else None, dtypes=dtypes,
                        device=device, last_contiguous=a.last_contiguous)
    if device is None:
        env["device"] = t.device
    env[a.name] = t.dtype
    if not toks:
        return
    hnd = a.layout and env.get("layout") in ("HND", "cpu_attn")   # cpu_attn: HND-shaped caches
    shape = tuple(t.shape)
    canon = (shape[0], shape[2], shape[1], *shape[3:]) if hnd else shape
    for letter in a.binds.split():
        env[letter] = canon[[tk[0] for tk in toks].index(letter)]
    expect = [lit if letter is None else (env[letter] // div if letter in env else None)
              for letter, div, lit in toks]
    if hnd:
        expect[1], expect[2] = expect[2], expect[1]
    if any(e is not None and e != s for e, s in zip(expect, shape)):
        what = a.what.format_map(env) if "{" in a.what else a.what
        if a.layout:
            parts = what.split(", ")
            if hnd:
                parts[1], parts[2] = parts[2], parts[1]
            what = f"{env.get('layout', 'NHD')}: {', '.join(parts)}"
        validate.shape(name, t, expect, what)
    for (letter, div, _), s in zip(toks, canon):
        if letter is not None and div == 1 and letter not in env:
            env[letter] = s


@dataclass
class Op:
    """One op. `checks`: the validation in order, argument names (matched by `_match`) and
    callables `(env, values)` for the op's own rules. `build(values, env, locs, check)` makes the
    call object the implementations take. `impls`: a (backend, "module:function") table, or `Format`s."""

    name: str
    args: tuple
    build: Callable
    impls: object
    checks: tuple
    dcp_page: bool = False      # DCP shards whole pages (DeepSeek V4 pools)
    page_table: bool = True     # its kernels take page-table addressing
    aliases: dict = field(default_factory=dict)   # schema name -> the name errors use
    loc: str = "loc"            # the addressing argument (its rows / dst pages)
    claims: str = "rows"        # the duplicate pre-pass: "rows", "pairs" (page moves), "read" (none)
    table_tail: bool = True     # the schema ends with the page-table tensors
    # The raw kernel (kvwrite_ext::<raw>) the C++ fast path runs (default: the table's "cpu"
    # entry `kvwrite._ext:<raw>`) and, for a raw argument that is not the op's argument, the env
    # slot or the argument of another name it is read from: {raw name: "e:slot" | "a:arg" |
    # "n:arg" (whether arg is given) | "k:arg" (a key cache's view, cpu_attn's included) |
    # "h:arg" (a head-major cache's view)}. The tail (loc ... page table) needs no entry. An op
    # of several formats declares them in its `Format`s; these are then every format's defaults.
    raw: str | None = None
    raw_args: dict = field(default_factory=dict)
    overload: object = field(default=None, init=False)
    _native: object = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.all_args = tuple(self.args) + (TABLE if self.table_tail else ())
        self.names = tuple(a.name for a in self.all_args)
        self.by_name = {a.name: a for a in self.all_args}
        self.declared = self.impls if type(self.impls[0]) is Format else (Format(self.impls),)
        self.code = facts.declare_op(self.name)
        self.overload = _library.define(self.name, self.schema(), self.impl, self.fake)
        self.entry = self.adapter()
        OPS[self.name] = self
        if _ext.LOADED:
            send_programs()

    # --- derived: the spec for the C++ matcher ------------------------------------------------
    def program(self) -> str | None:
        """This op's checks as the C++ matcher's program (csrc/api.h `parse`); None when one has no twin."""
        slots = list(self.names) + [s for s in RULE_SLOTS if s not in self.names]
        lines = []
        for c in self.checks:
            if callable(c):
                if getattr(c, "expr", None) is None:
                    return None
                lines.append(f"X {c.expr}")
                continue
            a = self.by_name[c]
            dtypes = ",".join(_dtype_name(d) for d in a.dtypes) or "-"
            if a.dims is not None and a.dims.startswith("scale"):
                heads = a.dims[5:].strip() or "-"
                lines.append(f"S {a.name} {int(a.type.endswith('?'))} 0 1 -1 {heads} float32 -")
                continue
            dims = []
            for letter, div, lit in a.tokens:
                if lit is not None:
                    dims.append(f"#{lit}")
                elif letter is None:
                    dims.append("*")
                else:
                    slots += [letter] if letter not in slots else []
                    dims.append(letter if div == 1 else f"{letter}/{div}")
            ndim = len(dims) if a.dims is not None else -1
            lines.append(f"T {a.name} {int(a.type.endswith('?'))} {int(a.layout)} {int(a.last_contiguous)} "
                         f"{ndim} {','.join(dims) or '-'} {dtypes} {','.join(a.binds.split()) or '-'}")
        head = [f"args {' '.join(self.names)}", f"slots {' '.join(slots)}",
                f"op {self.code} {int(self.dcp_page)} {int(self.page_table)}", f"loc {self.loc} {self.claims}"]
        raws = [self.raw_sources(slots, f) for f in self.formats]
        if None in raws:   # a format without a raw kernel: every call goes to Python
            raws = []
        raw = [(r, f.when) for r, f in zip(raws, self.formats)]
        while len(raw) >= 2 and raw[-2][0] == raw[-1][0] and raw[-1][1] is None:
            del raw[-2]    # formats that differ in Python only: one unconditioned C++ line
        return "\n".join(head + lines + [f"raw {' '.join(r)}" + (f" if {w.expr}" if w else "") for r, w in raw])

    @property
    def formats(self) -> tuple:
        """The op's formats with the op's `raw` / `raw_args` as their defaults (the C++ side's)."""
        return tuple(replace(f, raw=f.raw or self.raw, raw_args={**self.raw_args, **f.raw_args})
                     for f in self.declared)

    @staticmethod
    def raw_kernel(f: Format) -> str | None:
        """The kvwrite_ext op the C++ fast path runs for format `f` (csrc/api.h `run_raw`), or None."""
        if f.raw is not None:
            return f.raw
        target = dict(f.impls).get("cpu", "")
        return target.split(":")[1] if target.startswith("kvwrite._ext:") else None

    def raw_sources(self, slots: list, f: Format) -> list[str] | None:
        """Format `f`'s raw kernel and where the C++ fast path finds each of its arguments, by name
        (the codes of csrc/api.h: tail field, argument, its view, env slot, given-ness); None without a
        raw kernel, before the extension is loaded, or when the kernel does not take the op's arguments
        by name. A declared `raw` / `raw_args` that leaves an argument without a value is an error."""
        raw = self.raw_kernel(f)
        kernel = getattr(torch.ops.kvwrite_ext, raw, None) if raw and _ext.LOADED else None
        if kernel is None:
            return None
        by_name, out = self.by_name, [raw]
        for a in kernel.default._schema.arguments:
            name = "loc" if a.name == self.loc else a.name
            if a.name not in f.raw_args and (name in TAIL_FIELDS[:7] or (name in TABLE_ARGS and self.table_tail)):
                out.append(f"t{TAIL_FIELDS.index(name)}")
                continue
            kind, _, what = f.raw_args.get(a.name, f"a:{a.name}").partition(":")
            if kind == "a" and what not in by_name and what in slots:
                kind = "e"
            if kind == "e" and what in slots:
                out.append(f"{'b' if str(a.type) == 'bool' else 'e'}{slots.index(what)}")
            elif kind in ("a", "n", "k", "h") and what in by_name:
                kind = "l" if kind == "a" and by_name[what].layout else kind
                out.append(f"{kind}{self.names.index(what)}")
            elif f.raw is None and not f.raw_args:
                return None
            else:
                raise ValueError(f"{self.name}: no value for argument {a.name!r} of its raw kernel {raw} "
                                 f"(spec.Op.raw_args)")
        return out

    # --- derived: schema --------------------------------------------------------------------
    def schema(self) -> str:
        """The torch.library schema, aliases for every tensor the op writes."""
        parts, alias = [], iter("abcdefghijklmnopqrstuvwxy")
        for a in self.all_args:
            t = a.type
            if a.mutable:
                t = f"{t.rstrip('?')}({next(alias)}!)" + ("?" if t.endswith("?") else "")
            default = "" if a.default is NO_DEFAULT else f"={a.default}"
            parts.append(f"{t} {a.name}{default}")
        return f"({', '.join(parts)}) -> ()"

    # --- derived: validation ----------------------------------------------------------------
    def _check(self, v: dict, aliases: dict) -> dict:
        env: dict = {}
        for c in self.checks:
            if callable(c):
                c(env, v)
            elif v[c] is not None or not self.by_name[c].type.endswith("?"):
                _match(self.by_name[c], v[c], env, aliases.get(c, c))
        return env

    def match(self, v: dict, aliases: dict | None = None) -> dict:
        """The env (letters, device, dtypes, the rules' values) of a call, memoised per argument facts."""
        aliases = self.aliases if aliases is None else aliases
        if torch.compiler.is_compiling():
            return self._check(v, aliases)
        try:
            key = (self.name, id(aliases), *[(type(x), x.shape, x.stride(), x.dtype, x.device)  # each argument's facts
                                              if isinstance(x, torch.Tensor) else (type(x), x) for x in v.values()])
            env = _MEMO.get(key)
        except TypeError:   # an unhashable argument: no memo (the checks name it)
            return self._check(v, aliases)
        if env is None:
            env = self._check(v, aliases)
            if len(_MEMO) >= _MEMO_MAX:
                _MEMO.clear()
            _MEMO[key] = env
        return env

    def prepare(self, args: tuple, check: object = NO_DEFAULT, aliases: dict | None = None,
                call: str | None = None) -> tuple:
        """Validate a call (schema-order arguments): the call object and the env it was built from. An
        adapter's `aliases` (schema name -> the engine's) and `call` (its function) name its errors."""
        op = self.name
        if len(args) < len(self.names):   # the dispatcher leaves trailing defaults out
            args = (*args, *(a.default for a in self.all_args[len(args):]))
        v = dict(zip(self.names, args))
        if check is not NO_DEFAULT:
            v["check"] = check
        try:
            env = self.match(v, aliases)
            loc = v[self.loc]   # with the page-table tensors of the schema's tail: a PageTable's positions
            if self.table_tail and any(v[n] is not None for n in TABLE_ARGS):
                if any(v[n] is None for n in TABLE_ARGS):
                    raise ValueError(f"{op}: page-table addressing needs batch_indices, kv_indices and kv_indptr "
                                     f"together (loc holds the positions)")
                loc = PageTable(v["batch_indices"], loc, v["kv_indices"], v["kv_indptr"])
            locs, chk = prepare_addressing(op, env["device"], env["N"], loc, v.get("loc_map"),
                                           v.get("dcp_rank", 0), v.get("dcp_size", 1), v["check"],
                                           v["errors"], (aliases or self.aliases).get(self.loc, self.loc))
        except (TypeError, ValueError) as exc:
            if call is None:
                raise
            raise type(exc)(f"{call}: {exc}") from None
        if self.dcp_page:
            locs.dcp_page = True
        return self.build(v, env, locs, chk), env

    def table(self, env: dict) -> tuple:
        """The backend table of a call: its format's (the first whose condition holds on `env`)."""
        return next(f.impls for f in self.declared if f.when is None or f.when(env))

    # --- derived: the kernels of torch.ops.kvwrite.<op> ---------------------------------------
    def impl(self, *args, aliases: dict | None = None, call: str | None = None) -> None:
        """The Python implementation: validate, then run the backend's implementation."""
        a, env = self.prepare(args, NO_DEFAULT, aliases, call)
        if a.locs.n:
            dispatch(self.name, self.table(env), args[self.names.index("backend")], a.locs.loc.device, a)

    def fake(self, *args) -> None:
        """Validation only (tracing, meta tensors); guard without an errors tensor validates as "off"."""
        check, errors = args[self.names.index("check")], args[self.names.index("errors")]
        self.prepare(args, "off" if check == "guard" and errors is None else check)

    def native(self) -> bool:
        """Whether the extension's C++ kernel of this op is registered (settled once loaded)."""
        if not _ext.LOADED:   # not loaded yet, or switched off (the bench's Python-path timings)
            return False
        if self._native is None:
            self._native = torch._C._dispatch_has_kernel_for_dispatch_key(self.overload.name(), "CPU")
        return self._native

    # --- derived: the public call -------------------------------------------------------------
    def adapter(self, call_name: str | None = None, aliases: dict | None = None) -> Callable:
        """The call behind the public function: its arguments in schema order without the table tail
        (loc may be a PageTable, errors an ErrorBuffer, check None = the process default); with
        `call_name`, an engine adapter's, its errors naming the engine's function and `aliases`."""
        aliases = None if call_name is None else {**self.aliases, **aliases}
        names = self.names
        i_loc, i_check, i_errors, i_backend = (names.index(n) for n in (self.loc, "check", "errors", "backend"))
        table = self.table_tail
        # scalars the C++ path takes only as their own type (the schema would convert a bool)
        scalars = tuple((i, int if a.type == "int" else float) for i, a in enumerate(self.args)
                        if a.type in ("int", "float"))
        overload, impl, prepare = self.overload, self.impl, self.prepare
        call = overload._op   # the C++ builtin behind the OpOverload (one frame less)
        default_check, compiling, native = validate.default_check, torch.compiler.is_compiling, self.native

        def entry(*args):
            args = list(args)
            check = args[i_check]
            if check is None:
                args[i_check] = check = default_check()
            errors = args[i_errors]
            if type(errors) is ErrorBuffer:
                args[i_errors] = errors = errors.tensor
            loc = args[i_loc]
            if table and type(loc) is PageTable:
                args[i_loc] = loc.positions
                args += (loc.batch_indices, loc.kv_indices, loc.kv_indptr)
            if compiling():
                # the fake kernel validates; guard without a buffer finds its default one at run time
                return overload(*args)
            fast = args[i_backend] in NATIVE and native()
            for i, t in scalars:  # a loop, not all(...): no generator per call
                if type(args[i]) is not t:
                    fast = False
            if fast:
                if errors is None and check == "guard" and isinstance(args[0], torch.Tensor):
                    args[i_errors] = default_record(args[0].device)
                try:
                    return call(*args)
                except Exception:  # arguments the schema refused: Python's error names them
                    prepare(tuple(args) + (None,) * (len(names) - len(args)), NO_DEFAULT, aliases, call_name)
                    raise
            return impl(*args, *(None,) * (len(names) - len(args)), aliases=aliases, call=call_name)

        return entry


def send_programs() -> None:
    """Hand the op names (op codes) and every op's program to the loaded extension."""
    torch.ops.kvwrite_ext.set_op_names(list(facts.OPS))
    for op in OPS.values():
        text = op.program()
        if text is not None:
            torch.ops.kvwrite_ext.set_program(op.name, text)


_ext.ON_LOAD.append(send_programs)


def args_doc(op: Op) -> list[str]:
    """The op's arguments as reference-table rows (name, type, role, dims, dtypes, writes)."""
    return [f"| `{a.name}` | {a.type} | {a.role} | {a.dims or ''} | {', '.join(map(_dtype_name, a.dtypes))} | "
            f"{'yes' if a.mutable else ''} |" for a in op.all_args]
