"""Streaming rows on and off (KVWRITE_CPU_STREAM_BYTES = 0 / -1, read once per process, so each side
its own process, the two alternating), cpu backend, one torch thread, thread-CPU-time medians: the
A/B behind csrc/kvwrite/stream.h (bench/results/cpu-quant/NOTES.md, "Streaming rows"). SLACK: the
pool holds SLACK times the tokens (the bench's own is 4; an engine's pool is far larger than the cache).

    python bench/stream_ab.py N CASES [SLACK] [ROUNDS]     e.g. python bench/stream_ab.py 1024 mha-fp8,mha-nvfp4 256 4
"""
from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys
import time

SIDES = (("plain", "-1"), ("streaming", "0"))


def one_side(n: int, cases: str, slack: int) -> None:
    """In this process: each case's store call, median thread-CPU µs (printed as `case us`)."""
    import torch

    import kvwrite.bench.cases as C

    torch.set_num_threads(1)
    C.random_locs.__defaults__ = (slack,)   # the pool's size relative to the tokens stored
    C.paged_locs.__defaults__ = (slack,)
    built, _ = C.available(cases.split(","))
    for c in built:
        s = c.build(n, torch.device("cpu"), torch.Generator().manual_seed(0))
        s.call("cpu", "off", None)
        times = []
        for _ in range(15):
            t = time.thread_time_ns()
            s.call("cpu", "off", None)
            times.append(time.thread_time_ns() - t)
        print(c.name, statistics.median(times) / 1e3, flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--side":
        return one_side(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]))
    n, cases = int(sys.argv[1]), sys.argv[2]
    slack = int(sys.argv[3]) if len(sys.argv) > 3 else 4
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 4
    got = collections.defaultdict(list)
    for _ in range(rounds):
        for side, value in SIDES:
            env = dict(os.environ, KVWRITE_CPU_STREAM_BYTES=value)
            out = subprocess.run([sys.executable, __file__, "--side", str(n), cases, str(slack)], env=env,
                                 capture_output=True, text=True, check=True).stdout
            for line in out.splitlines():
                name, us = line.split()
                got[name, side].append(float(us))
    print(f"N={n}, pool {slack}x the tokens, {rounds} alternating rounds, median (min) thread-CPU us a call")
    for name in dict.fromkeys(k[0] for k in got):
        plain, stream = (got[name, side] for side, _ in SIDES)
        print(f"{name:20s} plain {statistics.median(plain):8.1f} ({min(plain):.1f})  streaming "
              f"{statistics.median(stream):8.1f} ({min(stream):.1f})  ratio {statistics.median(stream) / statistics.median(plain):.2f}")


if __name__ == "__main__":
    main()
