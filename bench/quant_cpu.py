"""Every quantised store's cpu backend against the same-run memcpy scatter of the bytes it writes,
on the thread-CPU-time clock (steadier than wall time on a shared machine), one torch thread.
`KVWRITE_CPU_SIMD=0` runs the portable loops instead of the AVX2 lanes (csrc/kvwrite/simd_x86.h).

    python bench/quant_cpu.py [N] [case,case,...] [check,check,...] [values]
    (checks: off (default), assert, guard; values: normal (default) or outliers, kvwrite.bench.cases.values)
    KVWRITE_CPU_SIMD=0 python bench/quant_cpu.py 1024
"""
from __future__ import annotations

import statistics
import sys
import time

import torch

from kvwrite.bench.cases import available, values
from kvwrite.errors import ErrorBuffer

QUANT_CASES = ("mha-fp8,mha-int8-token,mha-int8-head,mha-fp8-token,mha-fp8-head,mla-fp8ds,mla-nvfp4,mha-nvfp4,indexer-k,dsv4-kv,"
               "dsv4-indexer-mxfp4,dsv4-kv-nvfp4,dsv4-kv-mxfp4,dsv4-kv-nvfp4-v41,dsv4-kv-nvfp4-rope")


def median_us(fn, reps: int = 15) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.thread_time_ns()
        fn()
        times.append(time.thread_time_ns() - t)
    return statistics.median(times) / 1e3


def main() -> None:
    torch.set_num_threads(1)
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 1024
    cases, _ = available((sys.argv[2] if len(sys.argv) > 2 else QUANT_CASES).split(","))
    checks = (sys.argv[3] if len(sys.argv) > 3 else "off").split(",")
    rows = sys.argv[4] if len(sys.argv) > 4 else "normal"
    for c in cases:
        with values(rows):
            s = c.build(n, torch.device("cpu"), torch.Generator().manual_seed(0))
        scatter = s.baselines.get("memcpy-scatter")
        for check in checks:
            errors = ErrorBuffer(torch.device("cpu")) if check == "guard" else None
            store = median_us(lambda: s.call("cpu", check, errors))
            line = f"{c.name:22s} N={n} {check:5s} store {store:9.1f} us"
            if scatter is not None:
                sc = median_us(scatter)
                line += f"  memcpy-scatter {sc:7.1f} us  {100 * sc / store:5.1f} % of scatter"
            print(line, flush=True)


if __name__ == "__main__":
    main()
