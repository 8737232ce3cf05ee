"""The sweep: every available case x N x backend x check mode, the baselines and the same-run
copy bandwidth, plus the wrapper's host overhead; returns one JSON-able result dict."""
from __future__ import annotations

import contextlib
import functools
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass

import torch

import kvwrite
from kvwrite import _ext, backend as kvwrite_backend, validate
from kvwrite.bench import cases as case_registry, host as host_costs, timing
from kvwrite.errors import ErrorBuffer

QUICK_SIZES = (1, 16, 256, 1024, 4096)
FULL_SIZES = tuple(2 ** i for i in range(16))  # 1 .. 32768
CHECKS = tuple(validate.CHECK_MODES)            # off, assert, guard
GRAPH_MAX_N = 64                                # decode sizes get a CUDA-graph replay row


@dataclass
class Config:
    device: str = "cpu"
    sizes: tuple[int, ...] = QUICK_SIZES
    cases: list[str] | None = None       # case or op names; None = every available
    backends: list[str] | None = None    # None = every backend that runs on the device
    checks: tuple[str, ...] = CHECKS
    min_time: float = 0.05               # seconds per measurement (CPU); rep ms / 1000 on CUDA
    graph: bool = True                   # CUDA-graph replay rows for N <= GRAPH_MAX_N (CUDA)
    interpreter: bool = False            # time triton under TRITON_INTERPRET on CPU anyway
    quick: bool = False
    seed: int = 0
    values: str = "normal"              # the input rows (kvwrite.bench.cases.VALUES)
    command: str = ""


def _noop(args) -> None:
    """Stands in for every backend while the wrapper's own host time is measured."""


@functools.lru_cache(maxsize=None)
def _noop_implementation(table, backend):
    """Stands in for `kvwrite.backend.implementation` (cached like it): every backend is `_noop`."""
    return _noop


@contextlib.contextmanager
def noop_backends():
    """Every op's dispatch runs `_noop` instead of a backend: a call then costs the Python
    validation + backend resolution only (the C++ fast path is switched off meanwhile; its host
    cost, kernel included, is `kvwrite.bench.host`)."""
    saved, loaded = kvwrite_backend.implementation, _ext.LOADED
    kvwrite_backend.implementation = _noop_implementation
    _ext.LOADED = False  # the Python path (the C++ ops would run their kernels)
    try:
        yield
    finally:
        kvwrite_backend.implementation = saved
        _ext.LOADED = loaded


def select_backends(device: torch.device, wanted: list[str] | None, interpreter: bool
                    ) -> tuple[list[str], dict[str, str]]:
    """Backends to time on `device` and {backend: why not}."""
    chosen, notes = [], {}
    for name, why in kvwrite.backends(device).items():
        if wanted is not None and name not in wanted:
            continue
        if name == "triton" and device.type == "cpu" and (why is not None or not interpreter):
            notes[name] = ("not timed on CPU: Triton runs CPU tensors only under its interpreter "
                           "(TRITON_INTERPRET=1, ~0.45 ms a program), a correctness tool, not a "
                           "performance backend (--interpreter under TRITON_INTERPRET=1 times it anyway)"
                           + (f"; here: {why}" if why else ""))
        elif why is not None:
            notes[name] = why
        else:
            chosen.append(name)
    return chosen, notes


def machine_info(device: torch.device) -> dict:
    info = {"hostname": platform.node(), "platform": platform.platform(),
            "python": sys.version.split()[0], "cpu": platform.processor() or platform.machine(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}
    with contextlib.suppress(OSError, AttributeError):
        info["cpus_usable"] = len(os.sched_getaffinity(0))
    with contextlib.suppress(Exception):  # the cpu backend's streaming threshold (csrc/kvwrite/stream.h)
        from kvwrite import _ext

        if _ext.LOADED:  # (the sweep loaded it where a cpu backend ran; never built here)
            info["cpu_stream_bytes"] = int(torch.ops.kvwrite_ext.cpu_stream_bytes())
    with contextlib.suppress(OSError):
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in open("/proc/meminfo"):
            if line.startswith("MemTotal"):
                info["memory_gib"] = round(int(line.split()[1]) / 2 ** 20, 1)
                break
    if device.type == "cuda":
        p = torch.cuda.get_device_properties(device)
        info.update(gpu=p.name, gpu_capability=f"{p.major}.{p.minor}",
                    gpu_memory_gib=round(p.total_memory / 2 ** 30, 1), gpu_sms=p.multi_processor_count)
    info["kind"] = machine_kind(device)
    return info


def machine_kind(device: torch.device) -> str:
    """Results folder name: "cpu", or the GPU's name as a slug (e.g. "nvidia-h200")."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    slug = "".join(c if c.isalnum() else "-" for c in name)
    return "-".join(p for p in slug.split("-") if p)


def versions() -> dict:
    out = {"kvwrite": kvwrite.__version__, "torch": torch.__version__, "cuda": torch.version.cuda,
           "triton_interpret": os.environ.get("TRITON_INTERPRET", "")}
    for module in ("triton", "numpy", "vllm", "sgl_kernel", "flashinfer"):
        mod = sys.modules.get(module)
        if mod is None:
            with contextlib.suppress(Exception):
                mod = __import__(module)
        out[module] = getattr(mod, "__version__", None) if mod is not None else None
    return out


class _Bytes:
    """The bytes of a store's output tensors; `==` compares them all exactly."""

    def __init__(self, tensors):
        self.tensors = tensors

    def __eq__(self, other) -> bool:
        return all(torch.equal(a, b) for a, b in zip(self.tensors, other.tensors))


def _outputs_after(setup, store) -> _Bytes:
    """Zero the case's outputs, run `store` once, snapshot the bytes it wrote."""
    for t in setup.outputs:
        t.view(torch.uint8).zero_()
    store()
    return _Bytes([t.view(torch.uint8).clone() for t in setup.outputs])


def _row(case, n, impl, kind, check, mode, us, nbytes, copy_us, exact=None) -> dict:
    return {"case": case.name, "op": case.op, "n": n, "impl": impl, "kind": kind, "check": check,
            "mode": mode, "us": round(us, 3), "bytes": nbytes, "exact": exact,
            "gbps": round(nbytes / (us * 1e-6) / 1e9, 3) if us > 0 else None,
            "pct_copy": round(100.0 * copy_us / us, 1) if us > 0 and copy_us else None}


def host_overhead(case, setup, backends: list[str], device: torch.device, min_time: float
                  ) -> list[dict]:
    """The wrapper's host time per call (every check, the backend a no-op) vs a raw torch op."""
    rows = []
    for check in ("off", "guard"):
        errors = ErrorBuffer(device) if check == "guard" else None
        for backend in backends[:1] + (["auto"] if backends else []):
            with noop_backends():
                us = timing.cpu_median_us(lambda: setup.call(backend, check, errors), min_time)
            rows.append({"case": case.name, "what": "wrapper", "backend": backend, "check": check,
                         "us": round(us, 3)})
    for name, fn in setup.raw.items():
        rows.append({"case": case.name, "what": f"raw {name}", "backend": None, "check": None,
                     "us": round(timing.cpu_median_us(fn, min_time), 3)})
    return rows


def _measure(cfg: Config, case, n: int, setup, backends: list[str], device: torch.device,
             graph: bool, broken: set, rows: list, notes: dict) -> None:
    """Every row of one case at one N: copy, each backend x check (+ graph replay), baselines.
    Each backend and baseline is first checked against the torch reference's bytes."""
    reference = _outputs_after(setup, lambda: setup.call("torch", "off", None))
    copy = timing.copy_fn(setup.bytes_moved, device)
    copy_us = timing.median_us(copy, device, cfg.min_time)
    rows.append(_row(case, n, "copy", "copy", None, "eager", copy_us, setup.bytes_moved, copy_us))
    for backend in backends:
        if (case.name, backend) in broken:
            continue
        try:
            exact = _outputs_after(setup, lambda: setup.call(backend, "off", None)) == reference
        except Exception as exc:
            notes[f"{case.name} {backend}"] = (f"failed at N={n} (not retried): "
                                               f"{exc.__class__.__name__}: {exc}")
            broken.add((case.name, backend))
            continue
        if not exact:
            notes[f"{case.name} N={n} {backend}"] = "output bytes differ from the torch reference"
        for check in cfg.checks:
            errors = ErrorBuffer(device) if check == "guard" else None
            fn = (lambda b=backend, c=check, e=errors: setup.call(b, c, e))
            try:
                us = timing.median_us(fn, device, cfg.min_time)
            except Exception as exc:
                notes[f"{case.name} {backend}"] = (f"failed at N={n}, check={check} (not "
                                                   f"retried): {exc.__class__.__name__}: {exc}")
                broken.add((case.name, backend))
                break
            if errors is not None and errors.error() is not None:
                notes[f"{case.name} N={n} {backend}/guard"] = f"guard recorded an error: {errors.error()}"
            rows.append(_row(case, n, backend, "kvwrite", check, "eager", us, setup.bytes_moved, copy_us,
                             exact))
            if graph and n <= GRAPH_MAX_N and backend != "torch":
                try:
                    g_us = timing.graph_median_us(fn)
                    rows.append(_row(case, n, backend, "kvwrite", check, "graph", g_us,
                                     setup.bytes_moved, copy_us, exact))
                except Exception as exc:
                    notes[f"{case.name} N={n} {backend}/{check} graph"] = f"failed: {exc.__class__.__name__}: {exc}"
    for name, fn in setup.baselines.items():
        exact = _outputs_after(setup, fn) == reference
        rows.append(_row(case, n, name, "baseline", None, "eager",
                         timing.median_us(fn, device, cfg.min_time), setup.bytes_moved, copy_us, exact))
        if graph and n <= GRAPH_MAX_N:
            with contextlib.suppress(Exception):
                rows.append(_row(case, n, name, "baseline", None, "graph",
                                 timing.graph_median_us(fn), setup.bytes_moved, copy_us, exact))


def sweep(cfg: Config, progress=None) -> dict:
    device = torch.device(cfg.device)
    start = time.perf_counter()
    chosen, skipped = case_registry.available(cfg.cases)
    backends, backend_notes = select_backends(device, cfg.backends, cfg.interpreter)
    graph = cfg.graph and device.type == "cuda"
    rows, host, notes = [], [], {}
    broken: set[tuple[str, str]] = set()   # (case, backend) pairs that failed once: not retried
    gen = torch.Generator().manual_seed(cfg.seed)
    total = len(chosen) * len(cfg.sizes)
    task = progress.add_task("kvwrite bench", total=total) if progress else None
    empty_us = None
    if graph:
        with contextlib.suppress(Exception):
            empty_us = timing.graph_median_us(timing.empty_kernel())
    interrupted = None
    try:
        with case_registry.values(cfg.values):  # the input rows every build draws
            for case in chosen:
                for n in cfg.sizes:
                    if progress:
                        progress.update(task, description=f"{case.name} N={n}")
                    try:
                        setup = case.build(n, device, gen)
                    except Exception as exc:
                        notes[f"{case.name} N={n}"] = f"setup failed: {exc.__class__.__name__}: {exc}"
                        progress and progress.advance(task)
                        continue
                    for name, why in setup.notes.items():
                        notes.setdefault(f"{case.name}: {name}", why)
                    _measure(cfg, case, n, setup, backends, device, graph, broken, rows, notes)
                    if n == min(cfg.sizes):   # the host overhead is per call at N = 1, whatever the sweep's sizes
                        one = setup if n == 1 else case.build(1, device, torch.Generator().manual_seed(cfg.seed))
                        host += host_overhead(case, one, backends, device, min(cfg.min_time, 0.05))
                    del setup
                    progress and progress.advance(task)
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM from a timeout (see kvwrite/cli/bench.py): keep what was measured
        interrupted = "interrupted: the rows measured so far are reported"
    host_cost = []
    if interrupted is None:
        try:
            host_cost = host_costs.measure(device, 0.2)
        except KeyboardInterrupt:
            interrupted = "interrupted: the rows measured so far are reported"
        except Exception as exc:  # noqa: BLE001 - reported, not fatal
            notes["host cost"] = f"failed: {exc.__class__.__name__}: {exc}"
    return {
        "kvwrite_bench": 1, "quick": cfg.quick, "command": cfg.command,
        "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in asdict(cfg).items()},
        "machine": machine_info(device), "versions": versions(),
        "backends": backends, "backend_notes": backend_notes, "skipped": skipped,
        "notes": notes, "empty_kernel_graph_us": empty_us, "interrupted": interrupted,
        "cases": {c.name: {"op": c.op, "label": c.label} for c in chosen},
        "rows": rows, "host": host, "host_cost": host_cost, "wall_s": round(time.perf_counter() - start, 1),
    }
