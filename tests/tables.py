"""Page tables for the page-table tests: random FlashInfer-style tables and an independent
token -> (page, row) placement (a plain Python loop over FlashInfer's documented formula)."""
from __future__ import annotations

import torch

from conftest import DEVICE
from kvwrite import PageTable


def random_table(gen: torch.Generator, batch: int, pps: int, num_pages: int, max_len: int,
                 idx_dtype=torch.int32, shuffle: bool = True) -> tuple[PageTable, torch.Tensor]:
    """(table, seq_lens): `batch` requests of random lengths on random distinct pages; each
    appends a random tail of its sequence (1 token = decode, all = prefill); token order shuffled."""
    lens = torch.randint(1, max_len + 1, (batch,), generator=gen)
    pages = (lens + pps - 1) // pps
    total = int(pages.sum())
    assert total <= num_pages, (total, num_pages)
    indices = torch.randperm(num_pages, generator=gen)[:total]
    indptr = torch.cat([torch.zeros(1, dtype=torch.int64), pages.cumsum(0)])
    appended = [int(torch.randint(1, int(n) + 1, (1,), generator=gen)) for n in lens]
    b = torch.repeat_interleave(torch.arange(batch), torch.tensor(appended))
    pos = torch.cat([torch.arange(int(n) - a, int(n)) for n, a in zip(lens, appended)])
    if shuffle:
        perm = torch.randperm(b.shape[0], generator=gen)
        b, pos = b[perm], pos[perm]
    t = PageTable(*(x.to(idx_dtype).to(DEVICE) for x in (b, pos, indices, indptr)))
    return t, lens.to(DEVICE)


def placement(t: PageTable, pps: int) -> list[tuple[int, int, int]]:
    """[(token, page, row)] of every token of a valid table, by FlashInfer's formula."""
    indptr, indices = t.kv_indptr.tolist(), t.kv_indices.tolist()
    out = []
    for i, (b, p) in enumerate(zip(t.batch_indices.tolist(), t.positions.tolist())):
        out.append((i, indices[indptr[b] + p // pps], p % pps))
    return out
