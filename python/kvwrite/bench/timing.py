"""How one store is timed: median per-call latency in microseconds.

CPU: `time.perf_counter_ns` around loops of calls (the inner count calibrated so a batch is long
enough for the clock), median over batches. CUDA: `triton.testing.do_bench` (CUDA events, L2
flushed between calls, median), and for decode sizes a CUDA-graph replay of `unroll` back-to-back
calls, median over replays: the per-call cost an engine pays once launch overhead is gone.
A ratio of two CPU calls on the same data (a store with and without a check: bench/duplicates.py)
can be taken paired (`paired_ratio`): on a shared machine whose speed drifts by tens of percent
within seconds, two medians taken apart can each land in another phase. Not for calls whose data
differ: each then evicts the other's (a store's 4 MiB input took a scatter's source out of the
cache, 38 -> 76 µs a call), and the pairing measures that instead.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from typing import Callable, ContextManager

import torch

Fn = Callable[[], None]


def cpu_median_us(fn: Fn, min_time: float = 0.05, max_repeats: int = 15) -> float:
    """Median µs per call of `fn` on the host: batches of `inner` calls (inner calibrated on the
    fastest of three single calls), at least 5 batches, median of the batch means; a call slower
    than `min_time` is timed three times alone."""
    t0 = time.perf_counter_ns()
    fn()
    first = (time.perf_counter_ns() - t0) * 1e-9
    if first > min_time:  # a slow call: three single-call samples are enough
        samples = []
        for _ in range(3):
            t0 = time.perf_counter_ns()
            fn()
            samples.append(time.perf_counter_ns() - t0)
        return statistics.median(samples) / 1e3
    once = float("inf")
    for _ in range(3):
        t0 = time.perf_counter_ns()
        fn()
        once = min(once, max(time.perf_counter_ns() - t0, 1) * 1e-9)
    repeats = int(min(max_repeats, max(5, min_time / once)))
    inner = max(1, min(10_000, int(min_time / repeats / once)))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter_ns()
        for _ in range(inner):
            fn()
        samples.append((time.perf_counter_ns() - t0) / inner)
    return statistics.median(samples) / 1e3


def cuda_median_us(fn: Fn, rep_ms: float = 40.0) -> float:
    """Median µs per call on the current CUDA stream (CUDA events)."""
    try:
        from triton.testing import do_bench
    except ImportError:
        do_bench = None
    if do_bench is not None:
        return float(do_bench(fn, warmup=max(5, rep_ms / 4), rep=rep_ms, return_mode="median")) * 1e3
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(max(10, int(rep_ms))):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)


def graph_median_us(fn: Fn, unroll: int = 20, replays: int = 30) -> float:
    """Median µs per call of `fn` captured `unroll` times into one CUDA graph and replayed."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(unroll):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / unroll)
    del graph
    return statistics.median(times)


def paired_ratio(a: Fn, b: Fn, pairs: int, around_b: Callable[[], ContextManager] = contextlib.nullcontext) -> float:
    """CPU: the median over `pairs` of time(a) / time(b), one call each, adjacent, the order
    alternating; `around_b` is entered around b's call, outside its timing (a bench switch)."""
    ratios = []
    for i in range(pairs):
        t = [0, 0]
        for which in ((0, 1) if i % 2 else (1, 0)):
            with around_b() if which else contextlib.nullcontext():
                t0 = time.perf_counter_ns()
                (b if which else a)()
                t[which] = time.perf_counter_ns() - t0
        ratios.append(t[0] / max(t[1], 1))
    return statistics.median(ratios)


def median_us(fn: Fn, device: torch.device, min_time: float) -> float:
    if device.type == "cuda":
        return cuda_median_us(fn, rep_ms=max(10.0, 1e3 * min_time))
    return cpu_median_us(fn, min_time)


def copy_fn(nbytes: int, device: torch.device) -> Fn:
    """A contiguous device-to-device copy that moves `nbytes` (reads + writes) in all."""
    half = max(1, nbytes // 2)
    src = torch.empty(half, dtype=torch.uint8, device=device).random_(0, 255)
    dst = torch.empty_like(src)
    return lambda: dst.copy_(src)  # noqa: E731  (returns the tensor; harmless)


try:
    import triton

    @triton.jit
    def _empty(x_ptr):
        pass
except ImportError:  # pragma: no cover
    _empty = None


def empty_kernel() -> Fn:
    """One launch of a Triton kernel that does nothing (the floor of a decode-size store)."""
    if _empty is None:
        raise RuntimeError("triton is not importable")
    x = torch.empty(1, device="cuda")
    return lambda: _empty[(1,)](x)  # noqa: E731
