"""The cpu backend on one thread and on torch's intra-op threads, same run (best of `--reps` calls):
store_kv bf16 / fp8 / per-token-head int8, store_mla fp8_ds_mla and gather, MHA 8 x 128 heads, random
rows. `python bench/cpu_threads.py [--threads 2] [--sizes 128,512,4096]`."""
from __future__ import annotations

import argparse
import time

import torch

import kvwrite


def cases(n: int, g: torch.Generator) -> dict:
    bf, (h, d, pages, rows) = torch.bfloat16, (8, 128, 512, 16)
    k, v = torch.randn(n, h, d, generator=g).to(bf), torch.randn(n, h, d, generator=g).to(bf)
    loc = torch.randperm(pages * rows, generator=g)[:n]
    z = lambda dt, *s: torch.zeros(pages, rows, *s, dtype=dt)  # noqa: E731
    kc, vc = z(bf, h, d), z(bf, h, d)
    f8, i8 = [z(torch.float8_e4m3fn, h, d) for _ in "kv"], [z(torch.int8, h, d) for _ in "kv"]
    sc, one = [z(torch.float32, h) for _ in "kv"], torch.tensor(0.05)
    kv_c, k_pe = torch.randn(n, 512, generator=g).to(bf), torch.randn(n, 64, generator=g).to(bf)
    mla = z(torch.uint8, 656)
    return {"store_kv bf16": lambda: kvwrite.store_kv(k, v, kc, vc, loc),
            "store_kv fp8": lambda: kvwrite.store_kv(k, v, *f8, loc, k_scale=one, v_scale=one),
            "store_kv int8 per token-head": lambda: kvwrite.store_kv(k, v, *i8, loc, k_scale_cache=sc[0],
                                                                     v_scale_cache=sc[1]),
            "store_mla fp8_ds_mla": lambda: kvwrite.store_mla(kv_c, k_pe, mla, loc, kv_cache_dtype="fp8_ds_mla"),
            "gather bf16": lambda: kvwrite.gather(kc, loc)}


def best_us(f, reps: int) -> float:
    for _ in range(3):
        f()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t)
    return best * 1e6


def main() -> None:
    a = argparse.ArgumentParser(description=__doc__)
    a.add_argument("--threads", type=int, default=2)
    a.add_argument("--sizes", default="128,512,4096")
    a.add_argument("--reps", type=int, default=30)
    args = a.parse_args()
    print(f"backend cpu, best of {args.reps} calls, {torch.get_num_threads()} intra-op threads by default")
    print(f"| case | N | 1 thread us | {args.threads} threads us | speed-up |\n|---|---:|---:|---:|---:|")
    g = torch.Generator().manual_seed(0)
    for n in (int(s) for s in args.sizes.split(",")):
        for name, f in cases(n, g).items():
            t = {}
            for th in (1, args.threads):
                torch.set_num_threads(th)
                t[th] = best_us(f, args.reps)
            print(f"| {name} | {n} | {t[1]:.1f} | {t[args.threads]:.1f} | {t[1] / t[args.threads]:.2f}x |")
    if hasattr(torch.ops.kvwrite_ext, "cpu_threads"):  # builds before 2026-12-06 ran one thread
        torch.set_num_threads(args.threads)
        print(f"a parallel region of the CPU kernels ran on {torch.ops.kvwrite_ext.cpu_threads(1 << 12)} thread(s)")


if __name__ == "__main__":
    main()
