"""Building the C++/CUDA extension: CUDA kernels for sm_80 and sm_90 compile and the module
imports and registers its ops without a GPU; the CPU build; the fallback without it."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvwrite import _ext

CSRC = _ext.csrc_dir()
needs_build = pytest.mark.skipif(_ext.unavailable_reason("cpu") is not None,
                                 reason=f"extension unavailable: {_ext.unavailable_reason('cpu')}")


@needs_build
def test_ops_registered_for_cpu_and_cuda_keys():
    assert _ext.unavailable_reason("cpu") is None
    for op in ("store_kv",):
        name = f"kvwrite_ext::{op}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
        if _ext.build_config()["with_cuda"]:
            assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA")


@needs_build
@pytest.mark.skipif(not _ext.build_config()["with_cuda"],
                    reason="CUDA kernels not built here (no GPU; KVWRITE_EXT_CUDA=1 builds them)")
def test_cuda_kernels_built_for_sm80_and_sm90_and_import_without_gpu():
    cfg = _ext.build_config()
    out = _ext.build_dir(CSRC, cfg)
    ninja = (out / "build.ninja").read_text()
    if not torch.cuda.is_available() and not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        for arch in ("80", "90"):
            assert f"arch=compute_{arch},code=sm_{arch}" in ninja
    assert list(out.glob("*.so")), "no shared object built"
    assert _ext.has_cuda_kernels()
    if not torch.cuda.is_available():
        assert _ext.unavailable_reason("cuda") == "no CUDA device is available"


@needs_build
def test_warm_build_is_a_cache_hit():
    """A second process finds the build in the per-user cache (keyed by torch version and the
    hash of the sources) and only loads it."""
    code = "import time; from kvwrite import _ext; d, s = _ext.build(); print(d.name, s)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    name, seconds = out.stdout.split()[-2:]
    assert name.startswith(f"ext-{torch.__version__.replace('+', '_')}-")
    assert float(seconds) < 20, f"warm build took {seconds} s"


def test_disabled_extension_falls_back_with_one_warning():
    code = """
import warnings, torch, kvwrite
assert kvwrite.backends("cpu")["cpu"] == "disabled by KVWRITE_EXT=0", kvwrite.backends("cpu")
kc = torch.zeros(1, 4, 1, 8)
k = torch.ones(2, 1, 8)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for _ in range(3):
        kvwrite.store_kv(k, k, kc, kc.clone(), torch.tensor([0, 1]))
msgs = [str(x.message) for x in w if "backend 'cpu' unavailable" in str(x.message)]
assert len(msgs) == 1, msgs
assert bool((kc[0, :2] == 1).all())
print("OK")
"""
    env = dict(os.environ, KVWRITE_EXT="0")
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


def test_kernel_sources_keep_torch_out_of_cu_files_and_headers(tmp_path):
    """The .cu files (hand-written and generated), tokens.cuh and csrc/kvwrite/*.h compile without
    torch (fast nvcc builds): a body header's host code (params maker, op rows) sits in its
    `#ifdef KVW_HOST` section only; every .cu launches through tokens.cuh or defines its own
    kernels."""
    units = _ext.launch_units(CSRC, tmp_path)
    assert units
    files = (list(CSRC.glob("*.cu")) + units + list(CSRC.glob("*.cuh")) + list((CSRC / "kvwrite").glob("*.h"))
             + [tmp_path / _ext.OPS_HEADER])
    assert files
    host = re.compile(r"^#ifdef KVW_HOST\n.*?^#endif  // KVW_HOST\n", re.M | re.S)
    for f in files:
        text = f.read_text()
        assert not re.search(r"#include\s*[<\"](torch|ATen|c10)/", text), f"{f.name} includes torch"
        device = re.sub(r"//.*", "", host.sub("", text))   # code outside the host section
        assert not re.search(r"host\.h|TORCH_CHECK|\bTensor\b|KVW_HOST", device), f"{f.name}: host code outside KVW_HOST"
        if f.suffix == ".cu":
            assert "__global__" in text or '#include "tokens.cuh"' in text, f.name


@pytest.mark.skipif(shutil.which("c++") is None, reason="no C++ compiler")
def test_body_headers_compile_without_torch(tmp_path):
    """Every body header as a CUDA unit sees it (kvw_ops.h via bodies.h, no KVW_HOST): C++ without
    a torch include path (the host compiler's view of a .cu file's host side)."""
    gen = _ext.ops_header(CSRC, tmp_path).parent
    src = tmp_path / "bodies.cpp"
    src.write_text('#include "bodies.h"\n')
    res = subprocess.run(["c++", "-std=c++17", "-fsyntax-only", f"-I{CSRC}", f"-I{gen}", str(src)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]


def test_setup_py_aot_extension_uses_the_jit_sources_and_flags(monkeypatch):
    """`KVWRITE_BUILD_EXT=1 pip install .` builds kvwrite._C from the same sources and flags
    (the build itself is exercised by hand / in CI images: it takes as long as the JIT build)."""
    cfg = _ext.build_config()
    # aot_extension sets TORCH_CUDA_ARCH_LIST / CUDA_HOME for setup.py's build: restore them after
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", os.environ.get("TORCH_CUDA_ARCH_LIST", ""))
    monkeypatch.setenv("CUDA_HOME", os.environ.get("CUDA_HOME", ""))
    if not os.environ["TORCH_CUDA_ARCH_LIST"]:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST")
    if not os.environ["CUDA_HOME"]:
        monkeypatch.delenv("CUDA_HOME")
    exts, cmdclass = _ext.aot_extension(CSRC)
    (ext,) = exts
    assert ext.name == "kvwrite._C" and "build_ext" in cmdclass
    want = {str(p.relative_to(CSRC.parent)) for p in _ext.sources(CSRC, cfg["with_cuda"], _ext.aot_units_dir(CSRC))}
    assert set(ext.sources) == want and "csrc/ops.cpp" in want
    assert any(s.endswith(".cu") for s in want) == cfg["with_cuda"]
    # the generated units go to <repo>/build/kvwrite-units (relative, as setup.py needs them)
    assert all(s.startswith(("csrc/", "build/kvwrite-units/")) for s in want), want
    assert "-DKVWRITE_PYTHON_MODULE" in ext.extra_compile_args["cxx"]
    # the host units see the body headers' host sections, the CUDA units do not; both find kvw_ops.h
    assert "-DKVW_HOST" in ext.extra_compile_args["cxx"] and "-DKVW_HOST" not in ext.extra_compile_args["nvcc"]
    gen = _ext.aot_units_dir(CSRC)
    assert str(gen) in ext.include_dirs and (gen / _ext.OPS_HEADER).is_file()
    # OpenMP in the host units and the link, as the JIT build (at::parallel_for's threads)
    assert "-fopenmp" in ext.extra_compile_args["cxx"] and "-fopenmp" in ext.extra_link_args


def test_the_cpu_kernels_run_on_torchs_intra_op_threads():
    """A CPU kernel's parallel region (at::parallel_for in ops.cpp) uses torch's intra-op threads:
    the extension is built with OpenMP (without it, ATen runs every region on the calling thread)."""
    import torch

    assert _ext.unavailable_reason("cpu") is None
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert torch.ops.kvwrite_ext.cpu_threads(1 << 12) == 2
        torch.set_num_threads(1)
        assert torch.ops.kvwrite_ext.cpu_threads(1 << 12) == 1
    finally:
        torch.set_num_threads(before)


def _body_uses(root: Path) -> dict[str, str]:
    """{params type: header} of the `KVW_BODY(P, fn)` lines of csrc/kvwrite/*.h, read here
    independently of the generator (line starts only: not the #define, not comments)."""
    out = {}
    for h in sorted((root / "kvwrite").glob("*.h")):
        for line in h.read_text().splitlines():
            m = re.match(r"\s*KVW_BODY\((\w+),", line)
            if m:
                out[m.group(1)] = h.name
    return out


def test_every_body_gets_one_generated_launch_unit_per_check_mode_and_generation_is_idempotent(tmp_path):
    """Three CUDA units per params type with a KVW_BODY, one per check mode, `KVW_LAUNCH(P, C)` of
    exactly that type and mode (the launcher's instantiation is derived from the body line, so a
    body without a launch cannot exist), distinct names (the JIT build names objects by file
    name), none from csrc/; a second run rewrites nothing (ninja keeps the objects) and a unit of
    a type gone is removed."""
    uses = _body_uses(CSRC)
    assert {"StoreKVParams", "RopeStoreKVQuantParams", "GatherParams", "RopeStoreDSV4FP4Params"} <= set(uses)
    assert _ext.bodies(CSRC) == uses
    units = _ext.launch_units(CSRC, tmp_path)
    assert [u.parent for u in units] == [tmp_path] * len(units) and len(units) == 3 * len(uses)
    launched = set()
    for u in units:
        text = u.read_text()
        ((p, check),) = re.findall(r"^KVW_LAUNCH\((\w+), (CHECK_\w+)\)$", text, re.M)
        mode = check.removeprefix("CHECK_").lower()
        launched.add((p, mode))
        assert u.name == _ext.unit_name(p, mode) and '#include "tokens.cuh"' in text
        assert text.startswith("// Generated") and f"kvwrite/{uses[p]}" in text.splitlines()[0]
    assert launched == {(p, m) for p in uses for m in ("off", "assert", "guard")}
    assert _ext.unit_name("StoreIndexerKParams", "off") == "store_indexer_k_params_off.cu"
    assert _ext.unit_name("RopeStoreKVQuantParams", "guard") == "rope_store_kv_quant_params_guard.cu"
    assert not {u.name for u in units} & {p.name for p in CSRC.glob("*.cu")}
    readme = (CSRC / "README.md").read_text()   # names every params type's units (file table)
    assert [p for p in uses if f"`{_ext.unit_name(p, 'off').removesuffix('_off.cu')}`" not in readme] == []
    # every source of the CUDA build has a stem of its own (setuptools names objects by stem: a .cu
    # and a .cpp of one stem would overwrite each other's object in the ahead-of-time build)
    stems = [f.stem for f in _ext.sources(CSRC, True, tmp_path)]
    assert len(stems) == len(set(stems)) and len(stems) == 2 + len(list(CSRC.glob("*.cu"))) + 6 * len(uses)
    # no hand-written instantiation is left: csrc/ only defines KVW_LAUNCH (tokens.cuh)
    for f in list(CSRC.glob("*.cu")) + list(CSRC.glob("*.cuh")) + list(CSRC.glob("*.h")):
        assert not re.search(r"^\s*KVW_LAUNCH\(", f.read_text(), re.M), f.name

    stamp = {u: (u.stat().st_mtime_ns, u.read_text()) for u in units}
    os.utime(units[0], ns=(1, 1))   # an old mtime survives a rerun: the file is not rewritten
    stamp[units[0]] = (1, stamp[units[0]][1])
    stale = tmp_path / "store_gone_params.cu"
    stale.write_text("// a unit of a removed type\n")
    assert _ext.launch_units(CSRC, tmp_path) == units
    assert {u: (u.stat().st_mtime_ns, u.read_text()) for u in units} == stamp
    assert not stale.exists()


def test_a_new_body_header_gets_its_unit_and_a_duplicate_body_is_an_error(tmp_path):
    """The derivation itself: a KVW_BODY line in a new header is all a new store adds (the
    #define and comments do not count); the same type twice is refused."""
    root = tmp_path / "csrc"
    (root / "kvwrite").mkdir(parents=True)
    (root / "kvwrite" / "dispatch.h").write_text("#define KVW_BODY(P, fn) \\\n  void dispatch();\n")
    (root / "kvwrite" / "store_new.h").write_text(
        "// KVW_BODY(NotThisParams, x) in a comment\nnamespace kvwrite {\n"
        "KVW_BODY(StoreNewParams, dispatch_store_new)\n  KVW_BODY( StoreNewFP8Params , dispatch_store_new_fp8<true>)\n}\n")
    units = _ext.launch_units(root, tmp_path / "units")
    assert [u.name for u in units] == [f"store_new{t}_params_{m}.cu" for t in ("_fp8", "")
                                       for m in ("assert", "guard", "off")]
    assert "KVW_LAUNCH(StoreNewParams, CHECK_GUARD)" in units[4].read_text()
    assert sorted(p.name for p in root.rglob("*")) == ["dispatch.h", "kvwrite", "store_new.h"]  # csrc/ untouched
    assert (tmp_path / "units" / _ext.OPS_HEADER).read_text().count('#include "kvwrite/store_new.h"') == 1
    cpu = [s.name for s in _ext.sources(root, False, tmp_path / "units")]
    assert cpu == ["ops.cpp"] + [f"store_new{t}_params_{m}_cpu.cpp" for t in ("_fp8", "") for m in ("assert", "guard", "off")]
    assert "KVW_CPU_RUN(StoreNewParams, CHECK_OFF)" in (tmp_path / "units" / cpu[-1]).read_text()
    (root / "kvwrite" / "other.h").write_text("KVW_BODY(StoreNewParams, dispatch_again)\n")
    with pytest.raises(RuntimeError, match="twice"):
        _ext.launch_units(root, tmp_path / "units")


def test_the_op_table_and_the_body_includes_are_generated_from_the_headers(tmp_path):
    """kvw_ops.h: the #include of every header with a body or an op table and KVW_OPS(X), each
    header's `KVW_OPS_<HEADER>` in header-name order (a new op adds its header alone); a table
    named after another header is refused; csrc/ keeps no hand-written list of either."""
    root = tmp_path / "csrc"
    (root / "kvwrite").mkdir(parents=True)
    (root / "kvwrite" / "store_b.h").write_text(
        "KVW_BODY(StoreBParams, dispatch_store_b)\n#ifdef KVW_HOST\n#define KVW_OPS_STORE_B(X) X(store_b, x, \"()\")\n#endif\n")
    (root / "kvwrite" / "moves.h").write_text("#ifdef KVW_HOST\n#define KVW_OPS_MOVES(X) X(move, y, \"()\")\n#endif\n")
    (root / "kvwrite" / "helper.h").write_text("// KVW_OPS_HELPER(X) is not defined here\n")
    text = _ext.ops_header(root, tmp_path / "gen").read_text()
    assert re.findall(r'^#include "(.*)"$', text, re.M) == ["kvwrite/moves.h", "kvwrite/store_b.h"]
    assert re.findall(r"KVW_OPS_\w+", text) == ["KVW_OPS_MOVES", "KVW_OPS_STORE_B"]
    (root / "kvwrite" / "store_c.h").write_text("#define KVW_OPS_STORE_B(X)\n")
    with pytest.raises(RuntimeError, match="KVW_OPS_STORE_C"):
        _ext.ops_header(root, tmp_path / "gen")
    # the real tree: every header with a body has its table; no list of either is left in csrc/
    tables = _ext.op_tables(CSRC)
    assert set(_ext.bodies(CSRC).values()) <= set(tables) and "claims.h" in tables
    for f in list(CSRC.glob("*.h")) + list(CSRC.glob("*.cpp")):
        assert not re.search(r'#include "kvwrite/store_|^#define KVW_OPS\(', f.read_text(), re.M), f.name
    assert not list(CSRC.glob("params*.h"))


@pytest.mark.skipif(_ext.find_cuda_home() is None, reason="no CUDA toolkit")
def test_store_kv_ptx_check_modes_are_template_specialisations(tmp_path):
    """PTX of store_kv's three generated units for sm_90 (≈6 s), each holding its own mode's
    kernels only: `off` kernels carry no check code,
    `assert` kernels a device assert, `guard` kernels the atomics of the record; 16-byte copies
    are v4 accesses."""
    nvcc = os.path.join(_ext.find_cuda_home(), "bin", "nvcc")
    ptx = tmp_path / "store_kv.ptx"
    _ext.launch_units(CSRC, tmp_path / "units")
    seen, entries = set(), 0
    for mode in ("off", "assert", "guard"):
        unit = tmp_path / "units" / _ext.unit_name("StoreKVParams", mode)
        out = subprocess.run([nvcc, "-ptx", "-arch=sm_90", "-std=c++20", "--expt-relaxed-constexpr", "-O3",
                              f"-I{CSRC}", f"-I{unit.parent}", str(unit), "-o", str(ptx)],
                             capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        text = ptx.read_text()
        starts = [m.start() for m in re.finditer(r"\.entry\s", text)]
        entries += len(starts)
        for a, b in zip(starts, starts[1:] + [len(text)]):
            body = text[a:b]
            name = body.split()[1].split("(")[0]
            check = int(re.search(r"TokenILi(\d)E", name).group(1))
            assert check == ("off", "assert", "guard").index(mode), (mode, name)  # the unit's own mode only
            seen.add(check)
            assert ("__assertfail" in body) == (check == 1), name
            assert ("atom.global" in body) == (check == 2), name
            if re.search(r"EvLi16EEEE", name):  # the 16-byte copy variant
                assert ".v4." in body, name
    assert entries >= 30 and seen == {0, 1, 2}


def test_gpu_less_machine_builds_only_the_cpu_kernels(monkeypatch):
    """No visible GPU and no KVWRITE_EXT_CUDA: the JIT build compiles ops.cpp alone (minutes
    saved); KVWRITE_EXT_CUDA=1 asks for the CUDA kernels anyway when a toolkit is there."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("KVWRITE_EXT_CUDA", raising=False)
    assert not _ext.build_config()["with_cuda"]
    monkeypatch.setenv("KVWRITE_EXT_CUDA", "1")
    assert _ext.build_config()["with_cuda"] == bool(torch.version.cuda and _ext.find_cuda_home())


def test_cpu_only_torch_builds_only_the_cpu_kernels(monkeypatch, tmp_path):
    """A torch without CUDA: no toolkit is looked for and only the host units (ops.cpp: schemas +
    CPU policy, and the generated CPU units of tokens_cpu.h) are compiled (checked by hand with a CPU-only build: the CUDA key then has no kernel)."""
    monkeypatch.setattr(torch.version, "cuda", None)
    cfg = _ext.build_config()
    assert not cfg["with_cuda"] and "-DKVWRITE_WITH_CUDA" not in cfg["cflags"]
    srcs = [s.name for s in _ext.sources(CSRC, cfg["with_cuda"], tmp_path)]
    assert srcs[0] == "ops.cpp" and all(s.endswith(".cpp") for s in srcs) and "cuda_ops.cpp" not in srcs


def test_failed_build_is_reported_and_auto_falls_back_once():
    """No compiler (simulated: the build raises like cpp_extension does): the cpu backend says
    why, "auto" warns once and runs the torch reference."""
    code = """
import warnings, torch
from kvwrite import _ext
def no_compiler(*a, **k):
    raise RuntimeError("Error building extension 'kvwrite_ext': c++: command not found")
_ext.build = no_compiler
_ext._import_aot = lambda: (_ for _ in ()).throw(ImportError("no kvwrite._C"))
import kvwrite
why = kvwrite.backends("cpu")["cpu"]
assert why.startswith("the extension could not be built") and "command not found" in why, why
kc = torch.zeros(1, 4, 1, 8)
k = torch.ones(2, 1, 8)
with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    for _ in range(2):
        kvwrite.store_kv(k, k, kc, kc.clone(), torch.tensor([0, 1]))
assert len([x for x in w if "backend 'cpu' unavailable" in str(x.message)]) == 1
with __import__("pytest").raises(kvwrite.BackendUnavailable, match="could not be built"):
    kvwrite.store_kv(k, k, kc, kc.clone(), torch.tensor([0, 1]), backend="cpu")
print("OK")
"""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "OK" in out.stdout, out.stderr[-2000:]


@needs_build
def test_a_finished_build_is_loaded_without_recompiling(tmp_path):
    """A fresh process whose sources have new mtimes and another path (a git checkout, a second
    worktree) but the same content loads the finished build as it is: no build line on stderr,
    no object file or library rewritten."""
    out = _ext.build_dir(CSRC, _ext.build_config())
    built = {p: p.stat().st_mtime_ns for p in out.iterdir() if p.suffix in (".o", ".so")}
    assert built and (out / _ext.STAMP).is_file()
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC, copy)
    code = (f"from pathlib import Path; from kvwrite import _ext; _ext.csrc_dir = lambda: Path({str(copy)!r}); "
            f"d, s = _ext.build(); print(d)")
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split()[-1] == str(out)
    assert "building" not in res.stderr, res.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in built} == built


def test_a_build_says_so_and_its_time_on_stderr(tmp_path, monkeypatch, capsys):
    """One line when a build starts, one with its time; none when the finished build is reused."""
    from torch.utils import cpp_extension

    calls = []

    def fake_load(name, build_directory, **kw):
        calls.append(name)
        (Path(build_directory) / f"{name}.so").write_bytes(b"")

    monkeypatch.setenv("KVWRITE_EXT_CACHE", str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", fake_load)
    monkeypatch.setattr(torch.ops, "load_library", lambda path: calls.append(path))
    out, _ = _ext.build()
    err = capsys.readouterr().err.splitlines()
    assert calls == ["kvwrite_ext"] and out.parent == tmp_path
    assert len(err) == 2 and err[0].startswith("kvwrite: building the C++ extension (")
    assert re.fullmatch(r"kvwrite: built the C\+\+ extension in \d+\.\d s", err[1])
    _ext.build()
    assert capsys.readouterr().err == "" and calls[1] == str(out / "kvwrite_ext.so")


def test_aot_build_embeds_ptx_of_the_newest_arch(monkeypatch):
    assert _ext.with_ptx("8.0;9.0") == "8.0;9.0+PTX"
    assert _ext.with_ptx("9.0 8.0") == "9.0+PTX;8.0"
    assert _ext.with_ptx("8.0;9.0+PTX") == "8.0;9.0+PTX"
    assert _ext.with_ptx("8.6;10.0;9.0a") == "8.6;10.0+PTX;9.0a"
    if _ext.find_cuda_home() is None or not torch.version.cuda:
        pytest.skip("no CUDA toolkit: the AOT build has no CUDA kernels")
    monkeypatch.setenv("KVWRITE_EXT_CUDA", "1")
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setattr(_ext, "default_arch_list", lambda: _ext.DEFAULT_ARCHS)
    _ext.aot_extension(CSRC)
    from torch.utils import cpp_extension

    flags = cpp_extension._get_cuda_arch_flags()
    assert "-gencode=arch=compute_90,code=compute_90" in flags   # PTX, JIT-compiled on newer GPUs
    assert "-gencode=arch=compute_90,code=sm_90" in flags and "-gencode=arch=compute_80,code=sm_80" in flags


@needs_build
def test_kvwrite_build_cli_prebuilds():
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-m", "kvwrite.cli", "build", "--quiet"], capture_output=True,
                         text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "kernels ready in" in res.stdout and str(_ext.build_dir(CSRC, _ext.build_config())) in res.stdout
    assert "intra-op thread(s)" in res.stdout
