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


def test_agent_refuses_bad_use_before_any_transfer():
    """One process, two agents: misuse is refused with messages naming what is wrong."""
    import torch

    from kvwrite import GeometryError, PageGeometry
    from kvwrite.transfer import KVAgent

    a, b = KVAgent("api-a"), KVAgent("api-b")
    src = [torch.zeros(4, 16, 2, 8, dtype=torch.bfloat16) for _ in range(2)]
    a.register("kv", src, geometry=PageGeometry(16, 4))
    with pytest.raises(ValueError, match="already registered a pool 'kv'"):
        a.register("kv", src)
    with pytest.raises(ValueError, match="not contiguous"):
        b.register("t", [torch.zeros(16, 4, 2, 8).transpose(0, 1)])
    with pytest.raises(GeometryError, match="geometry has 8 pages but the buffers 4"):
        b.register("g", src, geometry=PageGeometry(16, 8))
    with pytest.raises(ValueError, match="must be the bytes of a peer's KVAgent.metadata"):
        a.add_peer(b"not a blob")
    b.register("kv", [torch.zeros(2, 16, 2, 8, dtype=torch.bfloat16) for _ in range(2)])
    with pytest.raises(ValueError, match="unknown peer 'api-b'"):
        a.write_pages("api-b", [0], [0], pool="kv")
    peer = a.add_peer(b.metadata())
    with pytest.raises(ValueError, match="registered no pool 'nope'"):
        a.write_pages(peer, [0], [0], pool="nope")
    with pytest.raises(ValueError, match="peer 'api-b' registered no pool 'v'"):
        a.write_pages(peer, [0], [0], pool="kv", peer_pool="v")
    with pytest.raises(ValueError, match="src_pages must be 1-D integer page ids"):
        a.write_pages(peer, [0.5], [0], pool="kv")
    a.close(), b.close()
