"""One DCP rank of test_dcp_distributed (imported by the spawned processes; keep imports light)."""
from __future__ import annotations

import os

import torch
import torch.distributed as dist

from config_models import TINY
from kvwrite.config.scales import FP8
from kvwrite import KVCacheConfigurator, ParallelSpec

PAGE, PER_RANK = 4, 32
CASES = (("mha", "auto"), ("mha", "fp8_e4m3"), ("mla", "auto"), ("mla", "nvfp4"), ("dsa", "fp8_ds_mla"),
         ("minimax_sparse", "nvfp4"))


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).reshape(t.shape[0] * t.shape[1], -1)


def _broadcast(t: torch.Tensor | None, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    t = torch.empty(shape, dtype=dtype) if t is None else t.contiguous()
    dist.broadcast(t, src=0)
    return t


def run(rank: int, world: int, init: str, backend: str) -> None:
    if backend == "triton":
        os.environ["TRITON_INTERPRET"] = "1"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        for variant, kv in CASES:
            spec = TINY[variant]
            conf = lambda draft: KVCacheConfigurator(  # noqa: E731
                spec, ParallelSpec(dcp_size=world, dcp_rank=rank, is_draft_worker=draft), page_size=PAGE,
                kv_cache_dtype=kv, max_total_num_tokens=PER_RANK)
            scales = 1.0 if kv in FP8 else None   # fp8 pools take their scales at build
            target = conf(False).plan().build("cpu", check="guard", backend=backend, scales=scales)
            draft = conf(True).plan().build("cpu", check="guard", backend=backend, scales=scales)
            assert target.plan.spaces["full"] == draft.plan.spaces["full"]
            # one shared allocation (rank 0's DCP allocator), the last page included, no loc twice
            n = 40
            if rank == 0:
                alloc = target.allocator()
                assert alloc.page_size == PAGE * world and alloc.num_locs == (PER_RANK + PAGE) * world
                locs = alloc.alloc(alloc.usable_locs)
                keep = torch.randperm(locs.numel() - 1, generator=torch.Generator().manual_seed(world))[:n - 1]
                locs = torch.cat([locs[keep], locs[-1:]])
                locs[3] = -1                                           # padding
                inputs = target.sample_inputs(0, n, torch.Generator().manual_seed(7))
            else:
                locs, inputs = None, (None,) * len(target.input_names(0))
            locs = _broadcast(locs, (n,), torch.int64)
            shapes = [(n, *s) for _, s, _ in target.planner.inputs(target.plan, 0)]
            dtypes = [d for _, _, d in target.planner.inputs(target.plan, 0)]
            inputs = tuple(_broadcast(x, s, d) for x, s, d in zip(inputs, shapes, dtypes))
            target.store(0, locs, *inputs)                            # this rank's shard
            draft.store(0, locs, *inputs)                             # the replicated draft pool
            assert target.errors.error() is None and draft.errors.error() is None
            for sub in target.plan.pools:
                for name, buf in target.layer(sub.name, 0).items():
                    mine = _bytes(buf)
                    gathered = [torch.empty_like(mine) for _ in range(world)]
                    dist.all_gather(gathered, mine)
                    replica = _bytes(draft.layer(sub.name, 0)[name])
                    if sub.sharded:   # virtual row v lives on rank v % world at row v // world
                        virtual = torch.stack(gathered, dim=1).reshape(-1, mine.shape[1])
                    else:             # the indexer cache is replicated: every rank holds all of it
                        assert all(torch.equal(g, mine) for g in gathered), (variant, kv, sub.name)
                        virtual = mine
                    assert virtual.shape == replica.shape, (variant, sub.name, virtual.shape, replica.shape)
                    assert torch.equal(virtual, replica), (variant, kv, sub.name, name)
                    assert int(replica.count_nonzero()) > 0
    finally:
        dist.destroy_process_group()
