"""Static GPU checks of the CUDA kernels (csrc/*.cu and the per-op units the build generates,
kvwrite._ext.launch_units), no GPU needed: every kernel instantiation
compiled for sm_80 and sm_90 has 0 bytes of spill and at most 64 registers per thread (ptxas -v),
and the copy / chunked-quantisation paths use 16-byte (`.v4`) global loads and stores.

The Triton variants get the same checks in test_compile.py (compile_check reports registers,
spill and .v4 counts from the same compile). nvcc runs once per source file (both archs in one
call, two files at a time) and each file's parsed result is cached under build/static_gpu/ keyed
by the hash of the file (a generated unit: its name and text), the csrc/ headers it includes and
the nvcc version, so a rerun costs only the translation units whose sources changed.
"""
from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from kvwrite import _ext

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
ARCHS = (80, 90)
MAX_REGS = 64
NVCC = shutil.which("nvcc")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc is not on PATH")

_ENTRY = re.compile(r"Compiling entry function '(\w+)' for 'sm_(\d+)'")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
_REGS = re.compile(r"Used (\d+) registers")
_V4_LD = re.compile(r"\bld\.global[\w.]*\.v4\b")
_V4_ST = re.compile(r"\bst\.global[\w.]*\.v4\b")


def _parse_ptxas(log: str) -> dict[tuple[str, int], dict]:
    """{(mangled kernel, arch): {regs, spill, stack}} from a `ptxas -v` log."""
    out, key = {}, None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            key = (m.group(1), int(m.group(2)))
            out[key] = {"regs": 0, "spill": 0, "stack": 0}
            continue
        if key is None:
            continue
        m = _SPILL.search(line)
        if m:
            out[key]["stack"] = int(m.group(1))
            out[key]["spill"] = int(m.group(2)) + int(m.group(3))
        m = _REGS.search(line)
        if m:
            out[key]["regs"] = int(m.group(1))
    return out


def _ptx_entries(ptx: str) -> dict[str, str]:
    """{mangled kernel: its PTX body}."""
    parts = re.split(r"\.visible \.entry (\w+)\(", ptx)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def _demangle(names: list[str]) -> dict[str, str]:
    filt = shutil.which("c++filt")
    if filt is None or not names:
        return {n: n for n in names}
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout.splitlines()
    return dict(zip(names, out)) if len(out) == len(names) else {n: n for n in names}


def _compile(cu: Path, gen: Path) -> list[dict]:
    """One nvcc call (device code only) for both archs; one row per (kernel, arch). `gen`: the
    generated kvw_ops.h (`_units`)."""
    with tempfile.TemporaryDirectory() as tmp:
        gencode = []
        for a in ARCHS:
            gencode += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
        cmd = [NVCC, "-fatbin", *gencode, "-O3", "--expt-relaxed-constexpr", "-std=c++17",
               "-Xptxas", "-v", "--keep", "--keep-dir", tmp, "-I", str(CSRC), "-I", str(gen), str(cu),
               "-o", os.path.join(tmp, cu.stem + ".fatbin")]
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert res.returncode == 0, res.stderr[-3000:]
        usage = _parse_ptxas(res.stdout + res.stderr)
        ptx = {}
        for f in Path(tmp).glob("*.ptx"):
            m = re.search(r"\.target sm_(\d+)", f.read_text())
            for name, body in _ptx_entries(f.read_text()).items():
                ptx[(name, int(m.group(1)) if m else 0)] = body
    names = _demangle(sorted({k[0] for k in usage}))
    rows = []
    for (name, arch), u in sorted(usage.items()):
        body = ptx.get((name, arch), "")
        rows.append({"file": cu.name, "kernel": names[name], "arch": arch, **u,
                     "v4_ld": len(_V4_LD.findall(body)), "v4_st": len(_V4_ST.findall(body))})
    return rows


_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def _sources(cu: Path, gen: Path) -> list[Path]:
    """`cu` and every csrc/ (or generated) header it includes, transitively (`#include "..."`)."""
    seen, todo = {cu}, [cu]
    while todo:
        f = todo.pop()
        for name in _INCLUDE.findall(f.read_text()):
            dep = next((d / name for d in (f.parent, CSRC, gen) if (d / name).is_file()), None)
            if dep is not None and dep not in seen:
                seen.add(dep)
                todo.append(dep)
    return sorted(seen)


def _key(cu: Path, gen: Path, nvcc_version: str) -> str:
    """Hash of what one translation unit compiles from (its includes, nvcc, the flags' version):
    a change elsewhere in csrc/ (the host-only api.h, ops.cpp) recompiles nothing."""
    h = hashlib.sha256()
    for f in _sources(cu, gen):
        h.update((f.relative_to(CSRC).as_posix() if f.is_relative_to(CSRC) else f.name).encode())
        h.update(f.read_bytes())
    h.update(nvcc_version.encode())
    h.update(b"v2")
    return h.hexdigest()[:16]


def _compile_cached(cu: Path, gen: Path, nvcc_version: str) -> list[dict]:
    cache = ROOT / "build" / "static_gpu" / f"{cu.stem}-{_key(cu, gen, nvcc_version)}.json"
    if cache.is_file():
        return json.loads(cache.read_text())
    rows = _compile(cu, gen)
    cache.parent.mkdir(parents=True, exist_ok=True)
    cache.write_text(json.dumps(rows, indent=1))
    return rows


def _units(tmp: Path) -> list[Path]:
    """The CUDA units of the build: the hand-written csrc/*.cu and the generated ones (into `tmp`,
    with the kvw_ops.h they all include: a worker's own directory, the cache is keyed by content)."""
    return sorted(CSRC.glob("*.cu")) + _ext.launch_units(CSRC, tmp)


@pytest.fixture(scope="module")
def units(tmp_path_factory) -> list[Path]:
    return _units(tmp_path_factory.mktemp("units"))


@pytest.fixture(scope="module")
def kernels(units) -> list[dict]:
    version = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        gen = next(u.parent for u in units if u.parent != CSRC)
        return [r for part in pool.map(lambda cu: _compile_cached(cu, gen, version), units) for r in part]


# Kernels known to spill, each named with its bound (to be tuned, not hidden): the fused RoPE +
# per-token-head int8 store (bf16 input) keeps the rotated row, its scale and the int8 rounding
# live at once; sm_90 spills 8 bytes in its assert and guard variants.
KNOWN_SPILL = {(f"rope_store_kv_quant_params_{mode}.cu", "RopeStoreKVQuantToken", "Int8Fmt"): 8
               for mode in ("assert", "guard")}


def _known_spill(r: dict) -> int:
    for (file, *parts), limit in KNOWN_SPILL.items():
        if r["file"] == file and all(p in r["kernel"] for p in parts):
            return limit
    return 0


def test_every_cuda_kernel_has_no_spill_and_at_most_64_registers(kernels, units):
    assert {r["arch"] for r in kernels} == set(ARCHS)
    assert {r["file"] for r in kernels} == {p.name for p in units}
    assert {f for f, *_ in KNOWN_SPILL} <= {p.name for p in units}
    over = [(r["file"], r["arch"], r["regs"], r["spill"], r["kernel"]) for r in kernels
            if r["spill"] > _known_spill(r) or r["regs"] > MAX_REGS]
    assert not over, over


def test_cuda_copy_and_chunked_quant_paths_use_16_byte_global_accesses(kernels):
    # copy paths with 16-byte units (VEC = 16), and the warp-cooperative fp8_ds_mla, indexer and
    # chunked fp8 store_kv kernels (16-byte chunk loads and stores where aligned)
    def pick(pattern: str) -> list[dict]:
        return [r for r in kernels if re.search(pattern, r["kernel"])]

    groups = {
        "store_kv copy VEC=16": pick(r"StoreKVToken<\d, \(kvwrite::DType\)0, void, 16>"),
        "store_mla copy VEC=16": pick(r"StoreMLAToken<\d, 0, \(kvwrite::DType\)0, void, 16>"),
        "store_mla fp8_ds_mla": pick(r"StoreMLAToken<\d, 2, "),
        "store_indexer_k": pick(r"StoreIndexerKToken<"),
        "store_kv fp8": pick(r"StoreKVToken<\d, \(kvwrite::DType\)\d, kvwrite::Fp8Format"),
    }
    for what, rows in groups.items():
        assert rows, f"no kernel matched {what}"
        missing = [(r["arch"], r["kernel"]) for r in rows if not (r["v4_ld"] and r["v4_st"])]
        assert not missing, (what, missing)
