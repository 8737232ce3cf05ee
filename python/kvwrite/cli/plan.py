"""`kvwrite plan`: print the pool plan of a preset or a Hugging Face config.json."""
from __future__ import annotations

import argparse
import re
import sys

NAME = "plan"
HELP = "plan the KV-cache pools of a model: sub-pools, geometry, buffers, bytes, kernels"

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
          "t": 10**12, "tb": 10**12, "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """"40GiB", "512MiB", "1.5GB", "1000000" -> bytes."""
    m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 40GiB, 512MiB, 1.5GB, 1000000)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human(n: float) -> str:
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:g} B"


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvwrite.config.variants import KV_CACHE_DTYPES

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a built-in preset (see `kvwrite presets`)")
    src.add_argument("--config", help="a local Hugging Face config.json (or its directory)")
    p.add_argument("--page-size", type=int, default=64, help="base page size in tokens (default 64)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size (divides KV heads)")
    p.add_argument("--dcp", type=int, default=1, help="decode-context-parallel size")
    p.add_argument("--dcp-rank", type=int, default=0)
    p.add_argument("--draft", action="store_true", help="plan the speculative draft worker's pools")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--memory", type=parse_bytes, help="KV budget per rank, e.g. 40GiB (default 40GiB)")
    size.add_argument("--max-tokens", type=int, help="tokens per rank instead of a memory budget")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES)
    p.add_argument("--swa-ratio", type=float, default=0.8, help="swa_full_tokens_ratio (hybrid SWA)")
    p.add_argument("--json", action="store_true", help="print plan.to_dict() as JSON")


def _layers(ids: tuple[int, ...], total: int) -> str:
    if ids == tuple(range(len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    shown = ",".join(map(str, ids[:6])) + (",..." if len(ids) > 6 else "")
    return f"{shown} ({len(ids)} of {total})"


def render(plan, console=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    m, par = plan.model, plan.parallel
    role = "draft worker" if par.is_draft_worker else "target worker"
    console.print(f"[bold]{m.name or m.variant}[/bold]: variant={plan.variant}, {role}, tp={par.tp_size}, "
                  f"dcp={par.dcp_size} (rank {par.dcp_rank}), kv_cache_dtype={plan.kv_cache_dtype}")
    console.print(f"page_size={plan.page_size}  loc_space_scale={plan.loc_space_scale}  "
                  f"pool_page_size={plan.pool_page_size}  max_total_num_tokens={plan.max_total_num_tokens:,}  "
                  f"cell_size_bytes={plan.cell_size_bytes:,}")
    budget = "" if plan.memory_bytes is None else f" of {human(plan.memory_bytes)} ({plan.memory_bytes:,} B)"
    console.print(f"total_bytes={plan.total_bytes:,} ({human(plan.total_bytes)}){budget}")
    t = Table(show_lines=True)
    for col in ("sub-pool", "layers", "geometry", "allocator it serves", "buffers (per layer)", "bytes", "kernel"):
        t.add_column(col)
    for p in plan.pools:
        g, s = p.geometry, p.space
        geo = (f"{g.num_pages:,} pages x {g.pool_page_size} rows\n(page_size {g.page_size} x scale "
               f"{g.loc_space_scale})\ncapacity {g.capacity:,}")
        alloc = f"{s.name}: {s.num_locs:,} locs\npages of {s.page_size}\n{p.addressing}"
        bufs = "\n".join(f"{b.name} {list(b.shape)} {b.dtype}" + ("" if b.per_layer else " (shared)")
                         for b in p.buffers)
        t.add_row(p.name, _layers(p.layer_ids, m.num_layers), geo, alloc, bufs, human(p.bytes), p.kernel)
    console.print(t)


def run(args: argparse.Namespace) -> int:
    from kvwrite.config import ConfigError, KVCacheConfigurator, ModelSpec, ParallelSpec

    try:
        model = ModelSpec.from_preset(args.preset) if args.preset else ModelSpec.from_hf_config(args.config)
        parallel = ParallelSpec(tp_size=args.tp, dcp_size=args.dcp, dcp_rank=args.dcp_rank,
                                is_draft_worker=args.draft)
        memory = args.memory if args.memory is not None or args.max_tokens is not None else 40 * 2**30
        plan = KVCacheConfigurator(model, parallel, page_size=args.page_size, kv_cache_dtype=args.kv_cache_dtype,
                                   memory_bytes=memory, max_total_num_tokens=args.max_tokens,
                                   swa_full_tokens_ratio=args.swa_ratio).plan()
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"kvwrite plan: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.to_json())
    else:
        render(plan)
    return 0
