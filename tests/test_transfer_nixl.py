"""kvwrite.transfer on NIXL between two processes (host memory, UCX): every case of
transfer_nixl_worker.CASES on both sides (bytes equal the oracle, canaries intact, refusals
raised before anything moves). Skipped where NIXL is not installed."""
from __future__ import annotations

import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvwrite.transfer import available

import transfer_nixl_worker as worker

pytestmark = pytest.mark.skipif(not available(), reason="NIXL is not installed (pip install 'kvwrite[nixl]'; "
                                                        "`make test` installs nixl-cu13)")


def _run_pair(tmp_path, timeout: float = 240.0) -> dict:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    out = str(tmp_path / "out")
    procs = [ctx.Process(target=worker.run, args=(role, conn, out)) for role, conn in (("prefill", a), ("decode", b))]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(1.0, deadline - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    if alive:
        pytest.fail(f"the two NIXL processes did not finish in {timeout} s")
    return {role: json.load(open(f"{out}.{role}")) for role in ("prefill", "decode")}


def test_nixl_two_processes(tmp_path):
    res = _run_pair(tmp_path)
    failed = [f"{r['role']} {r['case']}: {r['why']}" for lines in res.values() for r in lines if not r["ok"]]
    assert not failed, "\n".join(failed)
    for role, lines in res.items():
        assert [r["case"] for r in lines] == ["(setup)"] + [c.name for c in worker.CASES], (role, lines)
    # what the initiator saw: merged descriptors where page runs are contiguous, refusals by name
    seen = {r["case"]: r["why"] for r in res["prefill"]}
    assert seen["mha_same_page"] == "moved 4 skipped 0 descriptors 8"     # 3-page run + 1 page, x 4 buffers
    assert seen["padding_skipped"].startswith("moved 1 skipped 2")
    assert seen["guard_skips_bad"].startswith("moved 2 skipped 1")
    assert "src page 17 of src agent 'prefill'" in seen["bad_src_page"]


def test_pd_handoff_example_runs():
    """examples/pd_handoff.py: prefill (16-token pages) hands a request to decode (64-token pages)."""
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=str(root / "python"))
    out = subprocess.run([sys.executable, str(root / "examples" / "pd_handoff.py")], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "K/V of 2 layers x 40 tokens equal prefill's" in out.stdout
    assert "handed off, freed" in out.stdout
