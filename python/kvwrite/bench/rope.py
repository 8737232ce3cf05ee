"""Fused rope + store vs the unfused pair (rope in torch, then store), one run.

`python -m kvwrite.bench.rope [--device cpu] [--n 1 64 1024] [--backend auto]` prints median µs
per call. Until the triton/cpu/cuda kernels of `rope_store_kv` exist, "fused" runs the torch
reference (the only backend of the op), so the row measures the reference composition, not a
fused kernel. Shapes: Qwen3-8B-like layer, 32 q heads / 8 KV heads x 128, bf16, q/k RMS norm,
neox, pages of 16; caches bf16 and int8 per-token dynamic.
"""
from __future__ import annotations

import argparse
import time

import torch

import kvwrite
from kvwrite.reference.rope import rope


def _median_us(fn, min_time: float = 0.3) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def rows(device: torch.device, ns, backend: str, cache: str):
    hq, h, d, page, max_pos = 32, 8, 128, 16, 4096
    gen = torch.Generator().manual_seed(0)
    for n in ns:
        q = torch.randn(n, hq, d, generator=gen).bfloat16().to(device)
        k = torch.randn(n, h, d, generator=gen).bfloat16().to(device)
        v = torch.randn(n, h, d, generator=gen).bfloat16().to(device)
        ang = torch.rand(max_pos, d // 2, generator=gen) * 6
        cs = torch.cat([ang.cos(), ang.sin()], -1).to(device)
        pos = torch.randint(0, max_pos, (n,), generator=gen).to(device)
        w = (torch.rand(d, generator=gen) + 0.5).bfloat16().to(device)
        pages = -(-4 * n // page)
        loc = torch.randperm(pages * page, generator=gen)[:n].to(device)
        dt = torch.int8 if cache == "int8_per_token" else torch.bfloat16
        kc = torch.zeros(pages, page, h, d, dtype=dt, device=device)
        vc = torch.zeros_like(kc)
        sc = {}
        if dt == torch.int8:
            sc = dict(k_scale_cache=torch.zeros(pages, page, device=device),
                      v_scale_cache=torch.zeros(pages, page, device=device))

        def fused():
            kvwrite.rope_store_kv(pos, q, k, v, cs, kc, vc, loc, q_norm_weight=w, k_norm_weight=w,
                                  backend=backend, **sc)

        def unfused():
            q.copy_(rope(q, pos, cs, d, True, w))
            kvwrite.store_kv(rope(k, pos, cs, d, True, w), v, kc, vc, loc, backend=backend, **sc)

        yield n, cache, _median_us(fused), _median_us(unfused)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, nargs="+", default=[1, 64, 1024])
    p.add_argument("--backend", default="auto")
    args = p.parse_args(argv)
    dev = torch.device(args.device)
    print(f"| N | cache | fused rope_store_kv µs | unfused (torch rope + store_kv) µs |")
    print("|---:|---|---:|---:|")
    for cache in ("bf16", "int8_per_token"):
        for n, c, f, u in rows(dev, args.n, args.backend, cache):
            print(f"| {n} | {c} | {f:.1f} | {u:.1f} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
