"""One rank of test_transfer (imported by the spawned processes; keep imports light). Rank 0 is
the prefill side (send_pages), rank 1 the decode side (recv_pages)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kvwrite import GeometryError, OutOfBoundsWrite, PageGeometry
from kvwrite.transfer import recv_pages as _recv
from kvwrite.transfer import send_pages as _send


def _pool(pages: int, rows: int, seed: int, dtype=torch.bfloat16) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(pages, rows, 2, 8, generator=g).to(dtype) for _ in range(3)]   # 3 layers' K/V


def _expect(exc_type, fn, text: str) -> str:
    try:
        fn()
    except exc_type as exc:
        assert text in str(exc), (text, str(exc))
        return str(exc)
    raise AssertionError(f"{exc_type.__name__} not raised ({text})")


def run(rank: int, init: str, backend: str, out: str, transport: str = "torch") -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    lines = []
    from functools import partial

    global send_pages, recv_pages
    send_pages, recv_pages = partial(_send, transport=transport), partial(_recv, transport=transport)
    try:
        src_pages, dst_pages = torch.tensor([5, 1, 7]), torch.tensor([0, 3, 2])
        geo = lambda pages: PageGeometry(page_size=2, num_pages=pages, loc_space_scale=2)  # noqa: E731
        if rank == 0:
            pool = _pool(8, 4, seed=1)
            send_pages(pool, src_pages, 1, geometry=geo(8), backend=backend)
        else:
            pool = _pool(6, 4, seed=2)
            want = [b.clone() for b in pool]
            sent = _pool(8, 4, seed=1)
            for w, s in zip(want, sent):
                w[dst_pages] = s[src_pages]
            recv_pages(pool, dst_pages, 0, geometry=geo(6), backend=backend)
            assert all(torch.equal(p, w) for p, w in zip(pool, want)), "received pages differ"
            lines.append("moved")
        # geometry mismatch (loc_space_scale 2 vs 1, same pool_page_size): GeometryError on both
        # ranks, nothing moved
        pool = _pool(8, 4, seed=3)
        before = [b.clone() for b in pool]
        g = PageGeometry(page_size=2, num_pages=8, loc_space_scale=2) if rank == 0 else PageGeometry.from_pool(8, 4)
        fn = (lambda: send_pages(pool, src_pages, 1, geometry=g)) if rank == 0 else (
            lambda: recv_pages(pool, dst_pages, 0, geometry=g))
        lines.append(_expect(GeometryError, fn, "loc_space_scale"))
        assert all(torch.equal(p, b) for p, b in zip(pool, before))
        # dtype mismatch: GeometryError on both
        pool = _pool(8, 4, seed=3, dtype=torch.bfloat16 if rank == 0 else torch.float16)
        fn = (lambda: send_pages(pool, src_pages, 1)) if rank == 0 else (lambda: recv_pages(pool, dst_pages, 0))
        lines.append(_expect(GeometryError, fn, "dtype"))
        # a bad page id on the receiver: OutOfBoundsWrite there, a refusal naming rank 1 on the sender
        pool = _pool(8, 4, seed=3)
        if rank == 0:
            lines.append(_expect(ValueError, lambda: send_pages(pool, src_pages, 1), "refused by rank 1"))
        else:
            lines.append(_expect(OutOfBoundsWrite, lambda: recv_pages(pool, torch.tensor([0, 9, 1]), 0),
                                 "dst page 9"))
        # and the pair still works afterwards
        if rank == 0:
            send_pages(pool[0], torch.tensor([2]), 1)
        else:
            mine = torch.zeros(4, 4, 2, 8, dtype=torch.bfloat16)
            recv_pages(mine, torch.tensor([1]), 0)
            assert torch.equal(mine[1], _pool(8, 4, seed=3)[0][2])
            lines.append("moved again")
        # a configurator pool: every layer's K and V in one call (KVPool.send_pages / recv_pages)
        from config_models import TINY
        from kvwrite import KVCacheConfigurator, ParallelSpec

        plan = KVCacheConfigurator(TINY["mha"], ParallelSpec(), page_size=4, kv_cache_dtype="auto",
                                   max_total_num_tokens=32).plan()
        kv = plan.build("cpu", backend=backend)
        g = torch.Generator().manual_seed(7)
        for t in kv.page_buffers():
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
        if rank == 0:
            kv.send_pages(torch.tensor([1, 2]), 1, transport=transport)
        else:
            sent = [t.clone() for t in kv.page_buffers()]
            kv.recv_pages(torch.tensor([3, 0]), 0, transport=transport)
            got = kv.page_buffers()
            assert len(got) >= 2 and all(torch.equal(x[3], y[1]) and torch.equal(x[0], y[2])
                                         for x, y in zip(got, sent)), "KVPool pages differ"
            lines.append("pool moved")
        if transport == "nixl":   # pages of 4 rows into pages of 8: ids count 4-row units on both sides
            if rank == 0:
                send_pages(_pool(8, 4, seed=11), torch.tensor([0, 1, 5]), 1)
            else:
                mine = _pool(4, 8, seed=12)
                want = [m.clone().view(8, 4, 2, 8) for m in mine]
                for w, s in zip(want, _pool(8, 4, seed=11)):
                    w[[2, 3, 7]] = s[[0, 1, 5]]
                recv_pages(mine, torch.tensor([2, 3, 7]), 0)
                assert all(torch.equal(m.view(8, 4, 2, 8), w) for m, w in zip(mine, want)), "bridged pages differ"
                lines.append("bridged")
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write("\n".join(lines))
