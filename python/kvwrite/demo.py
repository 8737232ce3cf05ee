"""`kvwrite demo`: store K/V for a few layers, check them against the reference, then replay
the SGLang #33348 bug (a DCP draft pool paged per rank) and show guard mode catching it."""
from __future__ import annotations

import argparse
import time

import torch

import kvwrite
from kvwrite.geometry import GeometryError, PageGeometry

NAME = "demo"
HELP = "store K/V into a small pool, verify it, and catch the #33348 out-of-bounds write"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--backend", default="auto")


def _paged_locs(lengths: list[int], geometry: PageGeometry, gen: torch.Generator) -> torch.Tensor:
    """Locs of requests laid out in whole pool pages (page 0 reserved for padding)."""
    pps = geometry.pool_page_size
    free = (torch.randperm(geometry.num_pages - 1, generator=gen) + 1).tolist()
    out = []
    for n in lengths:
        pages = [free.pop() for _ in range(-(-n // pps))]
        out += [p * pps + i for p in pages for i in range(pps)][:n]
    return torch.tensor(out, dtype=torch.int64)


def run(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    gen = torch.Generator().manual_seed(0)
    print(f"kvwrite {kvwrite.__version__} on {device}; backends: "
          + ", ".join(f"{b}={'yes' if r is None else 'no'}" for b, r in kvwrite.backends(device).items()))

    # 1. A small MHA pool: 4 layers, 8 KV heads x 128, bf16, pages of 16 tokens.
    layers, heads, dim = 4, 8, 128
    geometry = PageGeometry(page_size=16, num_pages=64)
    shape = (geometry.num_pages, geometry.pool_page_size, heads, dim)
    k_cache = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    v_cache = [torch.zeros(shape, dtype=torch.bfloat16, device=device) for _ in range(layers)]
    loc = _paged_locs([37, 100, 5, 1], geometry, gen).to(device)
    loc[-1] = -1  # one padded slot, skipped
    start = time.perf_counter()
    for layer in range(layers):
        k = torch.randn(len(loc), heads, dim, generator=gen).to(torch.bfloat16).to(device)
        v = torch.randn(len(loc), heads, dim, generator=gen).to(torch.bfloat16).to(device)
        kvwrite.store_kv(k, v, k_cache[layer], v_cache[layer], loc, check="guard", backend=args.backend)
        kr, vr = torch.zeros_like(k_cache[layer]), torch.zeros_like(v_cache[layer])
        kvwrite.store_kv(k, v, kr, vr, loc, backend="torch")
        if not (torch.equal(kr, k_cache[layer]) and torch.equal(vr, v_cache[layer])):
            print(f"layer {layer}: MISMATCH against the torch reference")
            return 1
    kvwrite.default_errors(device).raise_if_any()
    print(f"stored {len(loc)} tokens x {layers} layers into {geometry} "
          f"(backend={args.backend}, check=guard) in {1e3 * (time.perf_counter() - start):.1f} ms: "
          "bit-exact with the torch reference")

    # 2. SGLang #33348: DCP draft worker. The allocator pages the virtual loc space in units of
    #    page_size * dcp_size; the replicated draft pool kept the per-rank page_size.
    page_size, dcp_size, per_rank_tokens = 16, 4, 256
    virtual_tokens = per_rank_tokens * dcp_size
    alloc_page = page_size * dcp_size
    alloc_locs = virtual_tokens + alloc_page  # one padding page (page 0) + the usable pages
    buggy = PageGeometry(page_size=page_size, num_pages=virtual_tokens // page_size + 1)
    fixed = PageGeometry(page_size=page_size, num_pages=virtual_tokens // alloc_page + 1,
                         loc_space_scale=dcp_size)
    print(f"\n#33348 replay: dcp_size={dcp_size}, allocator pages of {alloc_page} locs over "
          f"[0, {alloc_locs}); draft pool {buggy} (capacity {buggy.capacity})")
    try:
        buggy.check_allocator(alloc_page, alloc_locs)
    except GeometryError as err:
        print(f"  check_allocator refuses it: {err}")
    # The allocator's last page, handed to a decode batch of 8 draft tokens.
    last_page = alloc_locs // alloc_page - 1
    loc = torch.arange(8, dtype=torch.int64) * 8 + last_page * alloc_page
    loc = loc.to(device)
    errors = kvwrite.ErrorBuffer(device)
    for geometry_ in (buggy, fixed):
        cache = torch.zeros(geometry_.num_pages, geometry_.pool_page_size, 1, 576,
                            dtype=torch.bfloat16, device=device)
        x = torch.randn(len(loc), 1, 576, generator=gen).to(torch.bfloat16).to(device)
        kvwrite.store_kv(x, x, cache, cache, loc, check="guard", errors=errors, backend=args.backend)
        err = errors.error()
        if geometry_ is buggy:
            if err is None:
                print("  guard mode missed the bad write")
                return 1
            print(f"  guard mode skipped {err.count} write(s) and recorded: {err}")
            print(f"  -> token {err.token_index}, loc {err.loc}, page {err.page} "
                  f"(pool has {err.num_pages} pages of {err.pool_page_size})")
            errors.reset()
        else:
            fixed.check_allocator(alloc_page, alloc_locs)
            print(f"  with loc_space_scale={dcp_size}: {fixed} (capacity {fixed.capacity}) passes "
                  f"check_allocator and the same store is clean: {err is None}")
            if err is not None:
                return 1
    return 0
