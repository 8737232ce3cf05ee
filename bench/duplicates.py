"""What duplicate-row detection costs (kvwrite.ops.claims): guard with the pre-pass against guard
without it (the bench-only switch `kvwrite.ops.claims.disabled()`), off alongside, on the same
inputs (unique locs, the normal case) in one process: the three variants run in turn within each
round, median of the round medians. On the CPU also a paired figure: guard with and without the
check one call each, alternating (which goes first alternates too), for `--pairs` pairs; the median
of the per-pair ratios. A machine whose speed drifts moves both calls of a pair alike, where it
can move one variant's batch of a round and not the other's. The target is judged on it. On a GPU
also a CUDA-graph capture and replay of a guarded store with a duplicate (the record must say so
after the replay).

    python bench/duplicates.py [--device cpu] [--backends cpu] [--cases mha-bf16,mha-fp8]
                               [--sizes 1024 4096] [--rounds 5] [--min-time 0.05] [--pairs 400] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
from pathlib import Path

import torch

import kvwrite
from kvwrite.bench import cases as registry, timing
from kvwrite.errors import DuplicateWrite
from kvwrite.ops import claims

TARGET = 1.15   # the target: guard with detection at most 15 % over guard without (cpu, N >= 1024)


def measure(setup, backend: str, device: torch.device, rounds: int, min_time: float, pairs: int) -> dict:
    errors = kvwrite.ErrorBuffer(device)
    fns = {"off": lambda: setup.call(backend, "off", None),
           "guard": lambda: setup.call(backend, "guard", errors)}
    samples: dict[str, list[float]] = {"off": [], "guard": [], "guard_no_dup_check": []}
    for _ in range(rounds):
        samples["off"].append(timing.median_us(fns["off"], device, min_time))
        samples["guard"].append(timing.median_us(fns["guard"], device, min_time))
        with claims.disabled():
            samples["guard_no_dup_check"].append(timing.median_us(fns["guard"], device, min_time))
    paired = (timing.paired_ratio(fns["guard"], fns["guard"], pairs, around_b=claims.disabled)
              if device.type == "cpu" and pairs > 0 else None)
    errors.raise_if_any()   # unique locs: nothing recorded
    med = {k: statistics.median(v) for k, v in samples.items()}
    return dict(**{f"{k}_us": v for k, v in med.items()}, ratio=med["guard"] / med["guard_no_dup_check"],
                paired=paired)


def graph_check(device: torch.device, backend: str) -> str:
    """A guarded store with a duplicate, captured into a CUDA graph and replayed: the record
    names the duplicate and the first writer's row is kept."""
    k = torch.randn(4, 8, 128, dtype=torch.bfloat16, device=device)
    kc = torch.zeros(4, 16, 8, 128, dtype=torch.bfloat16, device=device)
    vc = torch.zeros_like(kc)
    loc = torch.tensor([5, 9, 5, 17], device=device)
    errors = kvwrite.ErrorBuffer(device)
    kvwrite.store_kv(k, k, kc, vc, loc, check="guard", errors=errors, backend=backend)   # warm up
    errors.reset()
    kc.zero_()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        kvwrite.store_kv(k, k, kc, vc, loc, check="guard", errors=errors, backend=backend)
    graph.replay()
    torch.cuda.synchronize()
    err = errors.error()
    ok = (isinstance(err, DuplicateWrite) and (err.token_index, err.first_token) == (2, 0)
          and torch.equal(kc.view(-1, 8, 128)[5], k[0]))
    return "ok" if ok else f"FAILED: {err!r}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backends", default=None, help="comma list (default: cpu on CPU; cuda,triton on CUDA)")
    ap.add_argument("--cases", default="mha-bf16,mha-fp8,mla-fp8ds,indexer-k")
    ap.add_argument("--sizes", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.05)
    ap.add_argument("--pairs", type=int, default=400, help="CPU: adjacent guard calls with / without the check")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    device = torch.device(a.device)
    backends = a.backends.split(",") if a.backends else (["cpu"] if device.type == "cpu" else ["cuda", "triton"])
    chosen, skipped = registry.available(a.cases.split(","))
    rows = []
    for case in chosen:
        for n in a.sizes:
            setup = case.build(n, device, torch.Generator().manual_seed(0))
            for backend in backends:
                why = kvwrite.backends(device).get(backend)
                if why is not None:
                    skipped[f"{case.name} {backend}"] = why
                    continue
                rows.append(dict(case=case.name, n=n, backend=backend,
                                 **measure(setup, backend, device, a.rounds, a.min_time, a.pairs)))
    lines = ["| case | backend | N | off (µs) | guard, no dup check (µs) | guard (µs) | guard / no check "
             "| paired |", "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        paired = "-" if r["paired"] is None else f"{r['paired']:.3f}"
        lines.append(f"| {r['case']} | {r['backend']} | {r['n']} | {r['off_us']:.1f} | {r['guard_no_dup_check_us']:.1f} "
                     f"| {r['guard_us']:.1f} | {r['ratio']:.3f} | {paired} |")
    for backend in backends:   # the target is the cpu backend's (paired); the others' worst ratio is reported
        big = [r for r in rows if r["backend"] == backend and r["n"] >= 1024]
        if not big:
            continue
        line = f"\n{backend}, N >= 1024: worst guard / no-check ratio of medians {max(r['ratio'] for r in big):.3f}"
        if all(r["paired"] is not None for r in big):
            worst = max(r["paired"] for r in big)
            line += f"; worst paired ratio {worst:.3f}"
            if backend == "cpu":
                line += f" (target <= {TARGET}: {'met' if worst <= TARGET else 'NOT met'})"
        lines.append(line)
    graphs = {}
    if device.type == "cuda":
        for backend in backends:
            graphs[backend] = graph_check(device, backend)
            lines.append(f"CUDA graph, guarded store with a duplicate [{backend}]: {graphs[backend]}")
    for what, why in skipped.items():
        lines.append(f"skipped {what}: {why}")
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = dict(machine=platform.processor() or platform.machine(), torch=torch.__version__,
                    threads=torch.get_num_threads(), rounds=a.rounds, min_time=a.min_time,
                    command="python bench/duplicates.py " + " ".join(
                        f"--{k.replace('_', '-')} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                        for k, v in vars(a).items() if v is not None and k != "out"))
        (a.out / "duplicates.json").write_text(json.dumps(dict(meta=meta, rows=rows, graphs=graphs), indent=1))
        (a.out / "duplicates.md").write_text(f"`{meta['command']}`, torch {meta['torch']}, "
                                             f"{meta['threads']} thread(s)\n\n{text}\n")


if __name__ == "__main__":
    main()
