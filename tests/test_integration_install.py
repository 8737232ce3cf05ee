"""How kvwrite gets into an engine's environment: a wheel (`pip install .`, not editable) carries
csrc/ so the extension builds from the installed copy (kvwrite/csrc), and a store that falls back
to a slower backend than the device allows says so once (log line + warning)."""
from __future__ import annotations

import logging
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import kvwrite
from kvwrite import backend

ROOT = Path(__file__).resolve().parents[1]


def test_the_wheel_carries_every_csrc_source(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(ROOT)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("kvwrite-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = [p.relative_to(ROOT / "csrc").as_posix() for p in (ROOT / "csrc").rglob("*")
               if p.suffix in (".h", ".cuh", ".cpp", ".cu")]
    assert sources and all(f"kvwrite/csrc/{s}" in names for s in sources), \
        sorted(s for s in sources if f"kvwrite/csrc/{s}" not in names)
    assert "kvwrite/_ext.py" in names and "kvwrite/kernels/__init__.py" in names


def test_a_fallback_past_a_missing_extension_is_said_once(monkeypatch, caplog):
    monkeypatch.setattr(backend, "_extension_reason", lambda dev: "the extension is missing (test)")
    monkeypatch.setattr(backend, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="kvwrite"), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        picks = [backend.resolve("auto", torch.device("cpu"), "store_kv") for _ in range(3)]
    assert picks == ["torch"] * 3
    lines = [r.getMessage() for r in caplog.records if r.name == "kvwrite"]
    assert len(lines) == 1 and len(seen) == 1
    assert "'cpu' unavailable on cpu (the extension is missing (test))" in lines[0] and "'torch' instead" in lines[0]
    assert kvwrite.backends("cpu")["cpu"] == "the extension is missing (test)"
