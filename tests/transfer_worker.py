"""One rank of test_transfer (imported by the spawned processes; keep imports light). Rank 0 is
the prefill side (send_pages), rank 1 the decode side (recv_pages)."""
from __future__ import annotations

import torch
import torch.distributed as dist

from kvwrite import GeometryError, OutOfBoundsWrite, PageGeometry
from kvwrite.transfer import recv_pages, send_pages


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


def run(rank: int, init: str, backend: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    lines = []
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
    finally:
        dist.destroy_process_group()
    with open(f"{out}.{rank}", "w") as f:
        f.write("\n".join(lines))
