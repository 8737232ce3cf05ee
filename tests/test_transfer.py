"""kvwrite.transfer.send_pages / recv_pages between two processes (gloo for the handshake; the
pages over gloo, or one NIXL write): pages of every buffer arrive bit-exactly; geometry and
page-id refusals are raised on both ranks before any page moves."""
from __future__ import annotations

import time

import pytest
import torch.multiprocessing as mp

from conftest import DEVICE
from kvwrite.transfer import available

import transfer_worker


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo test of CPU pools")
@pytest.mark.parametrize("backend, transport", [
    ("auto", "torch"), ("torch", "torch"),
    pytest.param("auto", "nixl", marks=pytest.mark.skipif(not available(), reason="NIXL is not installed"))])
def test_send_recv_pages_two_processes(tmp_path, backend, transport):
    init, out = f"file://{tmp_path / 'store'}", str(tmp_path / "out")
    ctx = mp.start_processes(transfer_worker.run, args=(init, backend, out, transport), nprocs=2, join=False,
                             start_method="spawn")
    start = time.perf_counter()
    while not ctx.join(timeout=60):
        if time.perf_counter() - start > 180:
            for p in ctx.processes:
                p.kill()
            pytest.fail("the two transfer processes did not finish in 180 s")
    sender = open(f"{out}.0").read().splitlines()
    receiver = open(f"{out}.1").read().splitlines()
    tail = ["moved again", "pool moved"] + (["bridged"] if transport == "nixl" else [])
    assert receiver[0] == "moved" and receiver[-len(tail):] == tail
    # both ranks raised for the geometry and the dtype mismatch, each naming the field
    for lines in (sender, receiver):
        geo = [l for l in lines if "loc_space_scale" in l]
        assert geo and "nothing was moved" in geo[0]
        assert any("dtype" in l for l in lines)
    assert any("refused by rank 1" in l and "dst page 9" in l for l in sender)
