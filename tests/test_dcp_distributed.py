"""DCP on torch.distributed: dcp_size processes (gloo on CPU; NCCL is the same code on GPUs) share
one allocation; each rank stores its shard with the DCP-sharded kernels and the replicated draft
pool; the all-gather of the shards equals the draft pool bit-exactly."""
from __future__ import annotations

import multiprocessing
import time

import pytest
import torch.multiprocessing as mp

from conftest import DEVICE
from helpers import BACKENDS

import dcp_worker


@pytest.mark.skipif(DEVICE.type != "cpu", reason="gloo test of CPU pools")
@pytest.mark.parametrize("world, method", [(2, "spawn"), (4, "forkserver")])
def test_dcp_shards_gather_to_the_draft_pool(tmp_path, world, method):
    backend = "triton" if "triton" in BACKENDS else "torch"
    init = f"file://{tmp_path / 'store'}"
    if method == "forkserver":   # the server imports torch + kvwrite once; ranks fork from it
        multiprocessing.set_forkserver_preload(["dcp_worker"])
    start = time.perf_counter()
    ctx = mp.start_processes(dcp_worker.run, args=(world, init, backend), nprocs=world, join=False, start_method=method)
    while not ctx.join(timeout=60):
        if time.perf_counter() - start > 120:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"dcp_size={world} processes did not finish in 120 s")
