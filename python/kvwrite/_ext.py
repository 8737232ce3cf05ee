"""The C++/CUDA extension (csrc/): the "cpu" and "cuda" backends.

Two op namespaces: `kvwrite_ext::*`, the raw kernels (validated parameter structs, coded check
and op; what the Python backends "cpu"/"cuda" call), and the CPU / CUDA kernels of the public
ops `kvwrite::*` (schemas defined in kvwrite.ops._library; validation + dispatch in csrc/api.h).
They come from an ahead-of-time build (`KVWRITE_BUILD_EXT=1 pip install .` -> `kvwrite._C`) or
are built on first use with `torch.utils.cpp_extension.load` + ninja into
`~/.cache/kvwrite/ext-<torch version>-<hash of the sources and flags>` (`KVWRITE_EXT_CACHE`
overrides the root). `KVWRITE_EXT=0` disables the extension; `KVWRITE_EXT_VERBOSE=1` shows the
build log. A torch without CUDA (or no CUDA toolkit) builds the CPU kernels alone. A build
says so on stderr (one line when it starts, one with its time); a finished build directory is
loaded as it is, without ninja, so unchanged sources are never recompiled (even when their
mtimes changed, e.g. after a git checkout). `kvwrite build` prebuilds with progress.
"""
from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import operator
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import torch

from kvwrite import facts

DEFAULT_ARCHS = "8.0;9.0"
EXT_NAME = "kvwrite_ext"
STAMP = "kvwrite_ext.built"   # written once a build has finished and loaded
_lock = threading.Lock()
_state: dict[str, object] = {}
# True once the extension is loaded and its kernels of the public ops torch.ops.kvwrite.* are
# registered (csrc/api.h): kvwrite.store_* then call those ops directly.
LOADED = False
ON_LOAD: list = []   # callables run once the extension is loaded (kvwrite.ops.spec sends the ops' specs)


def csrc_dir() -> Path | None:
    """csrc/ of a source checkout (an editable install), or None."""
    here = Path(__file__).resolve().parent
    for cand in (here.parents[1] / "csrc", here / "csrc"):
        if (cand / "ops.cpp").is_file():
            return cand
    return None


def sources(root: Path, with_cuda: bool) -> list[Path]:
    """The translation units: ops.cpp (schemas + CPU kernels), and with CUDA cuda_ops.cpp + *.cu."""
    srcs = [root / "ops.cpp"]
    if with_cuda:
        srcs += [root / "cuda_ops.cpp"] + sorted(root.glob("*.cu"))
    return srcs


def find_cuda_home() -> str | None:
    """CUDA_HOME / CUDA_PATH, else /usr/local/cuda, else the root of the nvcc on PATH."""
    for env in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(env)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return home
    if os.path.isfile("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    nvcc = shutil.which("nvcc")
    if nvcc:
        return str(Path(os.path.realpath(nvcc)).parent.parent)
    return None


def wants_cuda_kernels() -> bool:
    """Build the CUDA kernels only where they can run (a visible GPU) or when asked for with
    KVWRITE_EXT_CUDA=1 (prebuilding on a GPU-less build machine); KVWRITE_EXT_CUDA=0 never."""
    env = os.environ.get("KVWRITE_EXT_CUDA")
    if env is not None:
        return env == "1"
    return torch.cuda.is_available()


def default_arch_list() -> str:
    """The visible GPUs' compute capabilities, else sm_80 and sm_90."""
    if torch.cuda.is_available():
        caps = sorted({torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})
        return ";".join(f"{a}.{b}" for a, b in caps)
    return DEFAULT_ARCHS


def build_config() -> dict:
    """What a build needs: whether CUDA kernels are built, include dirs, flags, arch list."""
    cuda_home = find_cuda_home() if torch.version.cuda else None
    with_cuda = cuda_home is not None and wants_cuda_kernels()
    includes = []
    if with_cuda:
        for site in {Path(p).parent for p in torch.__path__}:
            inc = site / "nvidia" / "cu13" / "include"
            if inc.is_dir():
                includes.append(str(inc))
    # -ffp-contract=off: no fused multiply-add, the CPU kernels stay bit-identical to torch.
    # -fno-trapping-math: FP ops never trap (nothing here enables FP exceptions), so the compiler
    # may if-convert the fp8 rounding selects: the quantisation loops vectorise (about 3x; the
    # values are unchanged, rounding is still IEEE round-to-nearest-even).
    cflags = ["-O3", "-ffp-contract=off", "-fno-trapping-math"] + (["-DKVWRITE_WITH_CUDA"] if with_cuda else [])
    # The JIT build runs where it is built: -march=native lets the quantisation loops vectorise
    # (AVX2/AVX-512: about 4x on fp8 codes); the ahead-of-time build stays generic.
    jit_cflags = ["-march=native"] if os.environ.get("KVWRITE_EXT_NATIVE", "1") != "0" else []
    nvflags = ["-O3", "--expt-relaxed-constexpr", "-lineinfo"]
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or default_arch_list()
    return dict(with_cuda=with_cuda, cuda_home=cuda_home, includes=includes, cflags=cflags, jit_cflags=jit_cflags,
                nvflags=nvflags, archs=archs)


def build_dir(root: Path, cfg: dict) -> Path:
    h = hashlib.sha256()
    for f in sorted(root.rglob("*")):
        if f.is_file() and f.suffix in (".h", ".cu", ".cpp", ".cuh"):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    h.update(repr(sorted((k, str(v)) for k, v in cfg.items() if k != "cuda_home")).encode())
    base = Path(os.environ.get("KVWRITE_EXT_CACHE") or Path.home() / ".cache" / "kvwrite")
    return base / f"ext-{torch.__version__.replace('+', '_')}-{h.hexdigest()[:16]}"


@contextlib.contextmanager
def _file_lock(path: Path):
    """Serialise builds across processes (pytest-xdist workers)."""
    import fcntl

    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def with_ptx(archs: str) -> str:
    """A TORCH_CUDA_ARCH_LIST with PTX of its newest arch too ("8.0;9.0" -> "8.0;9.0+PTX"): the
    ahead-of-time build then also runs on GPUs newer than its SASS (the driver JIT-compiles
    the PTX) instead of failing with "no kernel image"."""
    items = [a.strip() for a in archs.replace(",", ";").replace(" ", ";").split(";") if a.strip()]
    if not items or any(a.endswith("+PTX") for a in items):
        return ";".join(items)
    newest = max(items, key=lambda a: tuple(int("".join(c for c in x if c.isdigit()) or 0)
                                             for x in a.split(".")))
    return ";".join(a + "+PTX" if a == newest else a for a in items)


def aot_extension(root: Path):
    """setup.py's ahead-of-time build (KVWRITE_BUILD_EXT=1): the module `kvwrite._C` from the same
    sources and flags as the JIT build (SASS of every listed arch plus PTX of the newest:
    `with_ptx`), and the BuildExtension command (ninja)."""
    cpp_extension = _import_cpp_extension()
    root = Path(root)
    cfg = build_config()
    if cfg["with_cuda"]:
        os.environ["CUDA_HOME"] = cfg["cuda_home"]
        cpp_extension.CUDA_HOME = cfg["cuda_home"]
    os.environ["TORCH_CUDA_ARCH_LIST"] = with_ptx(os.environ.get("TORCH_CUDA_ARCH_LIST") or cfg["archs"])
    kind = cpp_extension.CUDAExtension if cfg["with_cuda"] else cpp_extension.CppExtension
    srcs = [str(s.relative_to(root.parent)) for s in sources(root, cfg["with_cuda"])]
    flags = {"cxx": cfg["cflags"] + ["-DKVWRITE_PYTHON_MODULE"], "nvcc": cfg["nvflags"]}
    ext = kind("kvwrite._C", srcs, include_dirs=[str(root)] + cfg["includes"], extra_compile_args=flags)
    return [ext], {"build_ext": cpp_extension.BuildExtension}


def _import_cpp_extension():
    """torch.utils.cpp_extension with our CUDA_HOME (it guesses its own at import time, from the
    nvcc on PATH, and warns when there is no GPU)."""
    import logging

    home = find_cuda_home() if torch.version.cuda else None
    if home:
        os.environ.setdefault("CUDA_HOME", home)
    log = logging.getLogger("torch.utils.cpp_extension")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torch.utils import cpp_extension
    finally:
        log.setLevel(level)
    return cpp_extension


def build(verbose: bool | None = None) -> tuple[Path, float]:
    """JIT-build (or reuse) the extension and load it into torch.ops; returns (dir, seconds)."""
    cpp_extension = _import_cpp_extension()

    root = csrc_dir()
    if root is None:
        raise RuntimeError("csrc/ sources not found (install with KVWRITE_BUILD_EXT=1 for a prebuilt kvwrite._C)")
    cfg = build_config()
    verbose = bool(int(os.environ.get("KVWRITE_EXT_VERBOSE", "0"))) if verbose is None else verbose
    out = build_dir(root, cfg)
    out.mkdir(parents=True, exist_ok=True)
    if cfg["with_cuda"]:
        os.environ["CUDA_HOME"] = cfg["cuda_home"]
        cpp_extension.CUDA_HOME = cfg["cuda_home"]
    os.environ["TORCH_CUDA_ARCH_LIST"] = cfg["archs"]
    t0 = time.perf_counter()
    with _file_lock(out / "kvwrite.lock"):
        lib, stamp = out / f"{EXT_NAME}.so", out / STAMP
        if lib.is_file() and stamp.is_file():
            # The directory is keyed by the sources' content and the flags: a finished build is
            # loaded as it is. (ninja would recompile sources whose mtime changed, and torch's
            # versioner renames a second build of one process, changing every object's flags.)
            torch.ops.load_library(str(lib))
            return out, time.perf_counter() - t0
        what = ("CPU and CUDA kernels for sm_" + ", sm_".join(a.replace(".", "") for a in cfg["archs"].split(";"))
                if cfg["with_cuda"] else "CPU kernels")
        say(f"kvwrite: building the C++ extension ({what}; {'several minutes' if cfg['with_cuda'] else 'about a minute'}, "
            f"once per source change) in {out}")
        stamp.unlink(missing_ok=True)
        cpp_extension.load(
            name=EXT_NAME, sources=[str(s) for s in sources(root, cfg["with_cuda"])],
            extra_cflags=cfg["cflags"] + cfg["jit_cflags"], extra_cuda_cflags=cfg["nvflags"],
            extra_include_paths=[str(root)] + cfg["includes"], build_directory=str(out),
            with_cuda=cfg["with_cuda"], is_python_module=False, verbose=verbose)
        seconds = time.perf_counter() - t0
        stamp.write_text(f"built in {seconds:.1f} s\n")
        say(f"kvwrite: built the C++ extension in {seconds:.1f} s")
    return out, seconds


def say(line: str) -> None:
    """One line of build progress on stderr."""
    print(line, file=sys.stderr, flush=True)


def _import_aot() -> None:
    """Import the ahead-of-time build `kvwrite._C` (ImportError if there is none, or if it is
    older than the csrc/ sources of this checkout: then the JIT build is used instead)."""
    import importlib.util

    spec = importlib.util.find_spec("kvwrite._C")
    if spec is None or spec.origin is None:
        raise ImportError("no kvwrite._C")
    root = csrc_dir()
    if root is not None:
        newest = max(f.stat().st_mtime for f in root.rglob("*") if f.suffix in (".h", ".cu", ".cpp"))
        if newest > os.path.getmtime(spec.origin):
            raise ImportError("kvwrite._C is older than csrc/")
    importlib.import_module("kvwrite._C")


def _load() -> str | None:
    """Load the ops once per process; None on success, else why not."""
    with _lock:
        if "reason" in _state:
            return _state["reason"]  # type: ignore[return-value]
        reason = None
        if os.environ.get("KVWRITE_EXT", "1") == "0":
            reason = "disabled by KVWRITE_EXT=0"
        elif not _has_ops():
            try:
                _import_aot()
            except ImportError:
                try:
                    build()
                except Exception as exc:  # no compiler, a failed build, ...
                    msg = str(exc).strip().splitlines()
                    reason = f"the extension could not be built ({exc.__class__.__name__}: {msg[-1] if msg else ''})"
        if reason is None and not _has_ops():
            reason = "the extension loaded but registered no kvwrite_ext ops"
        _state["reason"] = reason
        if reason is None:
            torch.ops.kvwrite_ext.set_op_names(list(facts.OPS))   # the C++ messages' op names
        global LOADED
        LOADED = reason is None and torch._C._dispatch_has_kernel_for_dispatch_key("kvwrite::store_kv", "CPU")
        if LOADED:
            for hook in ON_LOAD:
                hook()
        return reason


def _has_kernel(key: str) -> bool:
    try:
        return torch._C._dispatch_has_kernel_for_dispatch_key("kvwrite_ext::store_kv", key)
    except RuntimeError:  # the op is not registered (yet)
        return False


def _has_ops() -> bool:
    return _has_kernel("CPU")


def has_cuda_kernels() -> bool:
    return _has_kernel("CUDA")


def unavailable_reason(device_type: str) -> str | None:
    """None if the extension's kernels run on `device_type`, else why not."""
    reason = _load()
    if reason is not None:
        return reason
    if device_type == "cpu":
        return None
    if device_type == "cuda":
        if not has_cuda_kernels():
            return "the extension was built without CUDA kernels (CPU-only torch or no CUDA toolkit)"
        if not torch.cuda.is_available():
            return "no CUDA device is available"
        return None
    return f"device type {device_type} is not supported"


def _run(a, name: str, *args, tail: bool = True) -> None:
    """Call torch.ops.kvwrite_ext.<name>(*args, <the shared loc/check tail>) for a validated call
    `a` (`tail=False`: a page move's kernel, whose tail is errors, check, op). CPU assert mode:
    the kernel throws before any write; we raise OutOfBoundsWrite with the record it filled."""
    from kvwrite.errors import ErrorBuffer, op_code

    chk = a.check
    errors, scratch = chk.errors, None
    if chk.mode == "assert" and args[0].device.type == "cpu":
        scratch = ErrorBuffer("cpu")
        errors = scratch.tensor
    rest = (errors, chk.code, op_code(chk.op))
    if tail:
        locs = a.locs
        t = getattr(locs, "table", None)
        table = () if t is None else (t.batch_indices, t.kv_indices, t.kv_indptr)
        rest = (locs.loc, locs.loc_map, errors, locs.dcp_rank, locs.dcp_size, *rest[1:], *table)
    try:
        getattr(torch.ops.kvwrite_ext, name)(*args, *rest)
    except RuntimeError as exc:
        err = scratch.error() if scratch is not None else None
        if err is None:
            raise
        raise err from exc


# ---- the raw kernels' runners: `kvwrite._ext:<raw op>` in an op's backend table -------------

_RAW: dict[tuple[str, type], tuple[Callable, bool]] = {}
_RUNNERS: dict[str, Callable] = {}


def _getter(cls: type, a, name: str, op: str) -> Callable:
    """How raw argument `name` is read from a `cls` call: its field or property, else that of
    the store a fused call wraps, else its geometry's (pool_page_size, num_pages)."""
    for path in ("", "store.", "geometry.", "store.geometry."):
        obj = a
        for part in path.split(".")[:-1]:
            obj = getattr(obj, part, None)
        if obj is not None and hasattr(obj, name):
            return operator.attrgetter(path + name)
    raise AttributeError(f"{cls.__name__} has no {name!r} for kvwrite_ext::{op}")


def _raw_args(name: str, a) -> tuple[Callable, bool]:
    """Reads kvwrite_ext::<name>'s arguments before its tail (schema names, csrc/registry.h) from a
    call like `a` (resolved once per call type), and whether that tail is a store's (loc, ...,
    check, op[, page table]) rather than a page move's."""
    key = (name, type(a))
    got = _RAW.get(key)
    if got is None:
        names = [x.name for x in getattr(torch.ops.kvwrite_ext, name).default._schema.arguments]
        tail = "loc" in names
        getters = [_getter(type(a), a, n, name) for n in names[:names.index("loc" if tail else "errors")]]
        got = _RAW[key] = (lambda call: [g(call) for g in getters], tail)
    return got


def run(name: str, a) -> None:
    """Run kvwrite_ext::<name> on validated call `a`, each argument read from `a` by its schema
    name (no per-op wrapper: the raw schema is the one list of a kernel's arguments)."""
    args, tail = _raw_args(name, a)
    _run(a, name, *args(a), tail=tail)


def __getattr__(name: str):
    """`_ext.<raw op>`: its runner (the backend tables name `kvwrite._ext:<raw op>`)."""
    if name.startswith("_"):
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    runner = _RUNNERS.get(name)
    if runner is None:
        runner = _RUNNERS[name] = functools.partial(run, name)
    return runner


def claim_rows(locs, geometry, chk):
    """The duplicate-row pre-pass of a store on the cpu / cuda backend (kvwrite.ops.claims):
    the Locs the store runs on. CPU assert mode: a duplicate raises its error (from a scratch
    record, as `_run`)."""
    import dataclasses

    from kvwrite.addressing import Locs
    from kvwrite.errors import ErrorBuffer, op_code

    errors, scratch = chk.errors, None
    if chk.mode == "assert" and locs.loc.device.type == "cpu":
        scratch = ErrorBuffer("cpu")
        errors = scratch.tensor
    t = locs.table
    table = (None, None, None) if t is None else (t.batch_indices, t.kv_indices, t.kv_indptr)
    try:
        out = torch.ops.kvwrite_ext.claim_rows(locs.loc, locs.loc_map, errors, locs.dcp_rank, locs.dcp_size,
                                               chk.code, op_code(chk.op), *table, geometry.capacity,
                                               geometry.pool_page_size, locs.dcp_page)
    except RuntimeError as exc:
        err = scratch.error() if scratch is not None else None
        if err is None:
            raise
        raise err from exc
    if out.numel() == 0:
        return locs
    return Locs(out) if t is not None else dataclasses.replace(locs, loc=out)
