"""`kvwrite demo`: plan and build a small pool with the configurator, store K/V for a few layers
through it and check them against the reference, then replay SGLang's DCP draft-pool bug (a draft
pool paged per rank while its allocator pages page_size * dcp_size locs) and show check_allocator
refusing it and guard mode catching its write."""
from __future__ import annotations

import argparse
import time

import torch

import kvwrite
from kvwrite import KVCacheConfigurator, ModelSpec, ParallelSpec
from kvwrite.geometry import GeometryError, PageGeometry

NAME = "demo"
HELP = ("store K/V into a small configured pool, verify it, and catch a DCP draft pool's "
        "out-of-bounds write")


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvwrite.backend import BACKENDS
    from kvwrite.cli._args import default_device, device

    p.add_argument("--device", type=device, default=None,
                   help=f"cpu or cuda[:N] (default here: {default_device()})")
    p.add_argument("--backend", default="auto", choices=("auto",) + BACKENDS,
                   help="kernel backend of every store (default auto: the fastest that runs on the device)")


def _request_locs(alloc: kvwrite.PagedAllocator, lengths: list[int]) -> torch.Tensor:
    """Each request gets whole pages from the allocator and uses its first `n` locs."""
    return torch.cat([alloc.alloc(n)[:n] for n in lengths])


def run(args: argparse.Namespace) -> int:
    from kvwrite.cli._args import UsageError, default_device

    device = args.device or torch.device(default_device())
    if args.backend != "auto":
        why = kvwrite.backends(device)[args.backend]
        if why is not None:
            raise UsageError(f"--backend {args.backend} does not run on {device}: {why}")
    gen = torch.Generator().manual_seed(0)
    print(f"kvwrite {kvwrite.__version__} on {device}; backends: "
          + ", ".join(f"{b}={'yes' if r is None else 'no'}" for b, r in kvwrite.backends(device).items()))

    # 1. A small MHA model (4 layers, 8 KV heads x 128, bf16), pages of 16 tokens, 1008 tokens.
    model = ModelSpec("mha", 4, num_kv_heads=8, head_dim=128, name="demo-mha")
    plan = KVCacheConfigurator(model, page_size=16, max_total_num_tokens=1008).plan()
    pool = plan.build(device, check="guard", backend=args.backend)
    ref = plan.build(device, check="guard", backend="torch")
    g = plan.pool("kv").geometry
    print(f"plan: {model.name}, {g.num_pages} pages x {g.pool_page_size} rows, cell {plan.cell_size_bytes} B/token, "
          f"{plan.total_bytes / 2**20:.1f} MiB; kernel {plan.pool('kv').kernel}")
    loc = _request_locs(plan.allocator(), [37, 100, 5, 1]).to(device)
    loc[-1] = -1  # one padded slot, skipped
    start = time.perf_counter()
    for layer in range(model.num_layers):
        k, v = pool.sample_inputs(layer, len(loc), gen)
        pool.store(layer, loc, k, v)
        ref.store(layer, loc, k, v)
    elapsed = time.perf_counter() - start
    pool.errors.raise_if_any()
    for layer in range(model.num_layers):
        mine, theirs = pool.layer("kv", layer), ref.layer("kv", layer)
        if not all(torch.equal(mine[n], theirs[n]) for n in mine):
            print(f"layer {layer}: MISMATCH against the torch reference")
            return 1
    print(f"stored {len(loc)} tokens x {model.num_layers} layers (backend={args.backend}, check=guard) "
          f"in {1e3 * elapsed:.1f} ms: bit-exact with the torch reference")

    # 2. SGLang's DCP draft-pool bug: DeepSeek-V3's MTP draft worker under DCP 4. The shared allocator pages the
    #    virtual loc space in units of page_size * dcp_size; the buggy draft pool kept page_size.
    page_size, dcp_size, per_rank = 16, 4, 256
    draft = KVCacheConfigurator(ModelSpec.from_preset("deepseek-v3"),
                                ParallelSpec(dcp_size=dcp_size, is_draft_worker=True),
                                page_size=page_size, max_total_num_tokens=per_rank).plan()
    alloc = draft.allocator()
    fixed = draft.pool("kv").geometry
    buggy_geometry = PageGeometry(page_size=page_size, num_pages=per_rank * dcp_size // page_size + 1)
    buggy = draft.replace_geometry("kv", buggy_geometry)
    mla = draft.pool("kv")
    print(f"\nDCP draft-pool replay (SGLang PR 33348): {draft.model.name}, variant {draft.variant}, "
          f"dcp_size={dcp_size}, draft worker; allocator {alloc}")
    print(f"  configured {draft.variant} pool '{mla.name}' (stored by {mla.kernel}): {fixed} (capacity {fixed.capacity}); "
          f"buggy one {buggy_geometry} (capacity {buggy_geometry.capacity})")
    try:
        buggy.check_allocator(alloc.page_size, alloc.num_locs)
        print("  check_allocator accepted the buggy pool")
        return 1
    except GeometryError as err:
        print(f"  check_allocator refuses it: {err}")
    draft.check_allocator(alloc.page_size, alloc.num_locs)
    # The allocator's last page, handed to a decode batch of 8 draft tokens.
    locs = alloc.alloc(alloc.usable_locs)
    loc = locs[-alloc.page_size::8].contiguous().to(device)
    for name, p in (("buggy", buggy), ("configured", draft)):
        built = p.build(device, check="guard", backend=args.backend, verify=False)
        built.store(0, loc, *built.sample_inputs(0, len(loc), gen))
        err = built.errors.error()
        if name == "buggy":
            if err is None:
                print("  guard mode missed the bad write")
                return 1
            print(f"  built anyway, guard mode skipped {err.count} write(s) and recorded: {err}")
            print(f"  -> token {err.token_index}, loc {err.loc}, page {err.page} "
                  f"(pool has {err.num_pages} pages of {err.pool_page_size})")
        else:
            print(f"  with loc_space_scale={draft.loc_space_scale} (pool_page_size={draft.pool_page_size}) the "
                  f"same store is clean: {err is None}")
            if err is not None:
                return 1
    return 0
