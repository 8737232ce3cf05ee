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
    from kvwrite.cli._args import non_negative_int, positive_int
    from kvwrite.config.variants import KV_CACHE_DTYPES

    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--preset", help="a built-in preset (see `kvwrite presets`)")
    src.add_argument("--config", help="a local Hugging Face config.json (or its directory)")
    p.add_argument("--page-size", type=positive_int, default=None,
                   help="base page size in tokens (default: the variant's, else 64; dsv4: 256 as SGLang)")
    p.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel size (divides KV heads)")
    p.add_argument("--dcp", type=positive_int, default=1, help="decode-context-parallel size")
    p.add_argument("--dcp-rank", type=non_negative_int, default=0,
                   help="this rank's index in the DCP group, 0..dcp-1 (which tokens a sharded pool keeps)")
    p.add_argument("--draft", action="store_true", help="plan the speculative draft worker's pools")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--memory", type=parse_bytes, help="KV budget per rank, e.g. 40GiB (default 40GiB)")
    size.add_argument("--max-tokens", type=positive_int, help="tokens per rank instead of a memory budget")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="default auto: the model's native format (its dtype; dsv4: fp8_e4m3)")
    p.add_argument("--swa-ratio", type=float, default=None,
                   help="swa_full_tokens_ratio (hybrid SWA; default SGLang's: 0.8, dsv4 0.1)")
    p.add_argument("--max-running-requests", type=positive_int, default=None,
                   help="request slots of recurrent-state / dsv4 c128-state pools (default: the engines' "
                        "memory share / estimate)")
    p.add_argument("--engine", default="sglang", choices=("sglang", "vllm", "kvwrite"),
                   help="whose layout to plan: the model as SGLang's / vLLM's code lays it out (refused where "
                        "the engine has none; also the DCP KV-head rule: sglang H // (tp // dcp), vllm H // tp), "
                        "or kvwrite's own (every variant as read)")
    p.add_argument("--sizing", default="engine", choices=("engine", "strict"),
                   help="engine: tokens = (memory - fixed) // cell as SGLang (padding page and SWA loc map "
                        "beside the budget); strict: everything inside the budget")
    p.add_argument("--layout", default="NHD", choices=("NHD", "HND"), help="paged K/V buffer layout")
    p.add_argument("--no-padding-page", action="store_true",
                   help="the -1 padding convention (vLLM): no page 0 reserved for padding")
    p.add_argument("--target", default="gpu", choices=("gpu", "npu"),
                   help="npu: SGLang's Ascend pool layouts (stored through the torch backend)")
    p.add_argument("--json", action="store_true", help="print plan.to_dict() as JSON")


def _layers(ids: tuple[int, ...], total: int) -> str:
    if ids == tuple(range(len(ids))):
        return f"{ids[0]}-{ids[-1]}" if len(ids) > 1 else str(ids[0])
    shown = ",".join(map(str, ids[:6])) + (",..." if len(ids) > 6 else "")
    return f"{shown} ({len(ids)} of {total})"


def render(plan, console=None, fp8=None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console(width=160)
    m, par = plan.model, plan.parallel
    role = "draft worker" if par.is_draft_worker else "target worker"
    heads = f", {par.kv_heads_per_rank(m.num_kv_heads)} KV heads/rank ({par.engine})" if m.num_kv_heads else ""
    console.print(f"[bold]{m.name or m.variant}[/bold]: variant={plan.variant}, {role}, tp={par.tp_size}{heads}, "
                  f"dcp={par.dcp_size} (rank {par.dcp_rank}), kv_cache_dtype={plan.kv_cache_dtype}")
    console.print(f"layout of engine={plan.engine}" + "".join(f"\n  {n}" for n in plan.engine_notes))
    console.print(f"page_size={plan.page_size}  loc_space_scale={plan.loc_space_scale}  "
                  f"pool_page_size={plan.pool_page_size}  max_total_num_tokens={plan.max_total_num_tokens:,}  "
                  f"cell_size_bytes={plan.cell_size_bytes:,}")
    budget = "" if plan.memory_bytes is None else f" of {human(plan.memory_bytes)} ({plan.memory_bytes:,} B)"
    console.print(f"total_bytes={plan.total_bytes:,} ({human(plan.total_bytes)}){budget}  "
                  f"({plan.sizing} sizing: fixed {plan.fixed_bytes:,} B, padding pages / loc map "
                  f"{plan.overhead_bytes:,} B)")
    if fp8 is not None:   # a DeepSeek V4 FP4 record: its capacity against the fp8 record's
        from kvwrite.config.dsv4 import fp4_record
        from kvwrite.facts import TOKEN_BYTES

        rec, n, n8 = fp4_record(plan.kv_cache_dtype), plan.max_total_num_tokens, fp8.max_total_num_tokens
        console.print(f"capacity against the fp8 record: {rec.name} {TOKEN_BYTES} -> {rec.token_bytes} B a token: "
                      f"{TOKEN_BYTES / rec.token_bytes:.2f}x the tokens per GiB of KV records")
        console.print(f"  this plan: {n:,} tokens against {n8:,} with the fp8 record ({n / n8:.2f}x; the indexer, "
                      f"compress states and c128 ring do not shrink)")
    if plan.state_pools:
        console.print(f"  kv_bytes={plan.kv_bytes:,} ({human(plan.kv_bytes)}) + state_bytes={plan.state_bytes:,} "
                      f"({human(plan.state_bytes)}: {plan.max_running_requests} + 1 request slots)")
    if plan.layout != "NHD" or plan.target != "gpu" or not plan.spaces["full"].reserve_padding_page:
        console.print(f"layout={plan.layout}  target={plan.target}  "
                      f"reserve_padding_page={plan.spaces['full'].reserve_padding_page}")
    t = Table(show_lines=True)
    for col in ("sub-pool", "layers", "geometry", "allocator it serves", "buffers (per copy)", "bytes", "kernel"):
        t.add_column(col)
    for p in plan.pools:
        g, s = p.geometry, p.space
        geo = (f"{g.num_pages:,} rows, addressed by row\n(no pages)" if g.pool_page_size == 1 and s.page_size == 1
               and p.addressing == "local" and s.name == p.name else
               f"{g.num_pages:,} pages x {g.pool_page_size} rows\n(page_size {g.page_size} x scale "
               f"{g.loc_space_scale})\ncapacity {g.capacity:,}")
        alloc = f"{s.name}: {s.num_locs:,} locs\npages of {s.page_size}\n{p.addressing}"
        bufs = "\n".join(f"{b.name} {list(b.shape)} {b.dtype}" + ("" if b.per_layer else " (shared)")
                         for b in p.buffers)
        layers = _layers(p.layer_ids, m.num_layers)
        if p.spec.num_buffers != len(p.layer_ids):
            layers += f"\n{p.spec.num_buffers} buffer copies\nshared by them"
        t.add_row(p.name, layers, geo, alloc, bufs, human(p.bytes), p.kernel)
    for st in plan.state_pools:
        bufs = "\n".join(f"{b.name} {list(b.shape)} {b.dtype}" for b in st.buffers)
        t.add_row(st.name, _layers(st.layer_ids, m.num_layers), f"{st.slots} request slots\n"
                  f"{human(st.bytes_per_slot)} per slot", "per request (not paged)", bufs, human(st.bytes),
                  "(recurrent state: written by the model's kernels)")
    console.print(t)


def run(args: argparse.Namespace) -> int:
    from kvwrite.config import ConfigError, KVCacheConfigurator, ModelSpec, ParallelSpec
    from kvwrite.config.dsv4 import fp4_record

    try:
        model = ModelSpec.from_preset(args.preset) if args.preset else ModelSpec.from_hf_config(args.config)
        parallel = ParallelSpec(tp_size=args.tp, dcp_size=args.dcp, dcp_rank=args.dcp_rank,
                                is_draft_worker=args.draft, engine=args.engine)
        memory = args.memory if args.memory is not None or args.max_tokens is not None else 40 * 2**30
        # unset options take the configurator's defaults (kvwrite.config.registry.plan_defaults)
        kw = dict(page_size=args.page_size, memory_bytes=memory, max_total_num_tokens=args.max_tokens,
                  swa_full_tokens_ratio=args.swa_ratio, max_running_requests=args.max_running_requests,
                  layout=args.layout, reserve_padding_page=not args.no_padding_page, target=args.target,
                  sizing=args.sizing)
        plan = KVCacheConfigurator(model, parallel, kv_cache_dtype=args.kv_cache_dtype, **kw).plan()
        fp8 = None
        if plan.variant == "dsv4" and fp4_record(plan.kv_cache_dtype) is not None:
            fp8 = KVCacheConfigurator(model, parallel, kv_cache_dtype="fp8_e4m3", **kw).plan()
    except (ConfigError, OSError, ValueError) as err:
        print(f"kvwrite plan: {type(err).__name__}: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(plan.to_json())
    else:
        render(plan, fp8=fp8)
    return 0
