"""Fused rope + store vs the unfused pair and vs a raw index_copy_ pair, one run, one thread.

`python -m kvwrite.bench.rope [--device cpu] [--n 1 256 4096] [--backend auto] [--threads 1]
[--clock thread|wall] [--no-norm]` prints median µs per call (on the CPU the calling thread's CPU
time: the shared dev machine's wall time mostly measures waiting for a core) and the target ratios:
  - fused: `kvwrite.rope_store_kv` (q/k RMS norm unless --no-norm (a Llama layer), neox RoPE, q in
    place, K/V stored);
  - unfused: a plain torch RoPE + RMS norm (the usual `forward_native` formulation: rsqrt of the
    mean square, chunk / cat halves) for q and k, then `kvwrite.store_kv` on the same backend;
  - index_copy_: `k_cache.index_copy_(0, loc, k)` and the same for v (the store alone, no RoPE).
Shapes: a Qwen3-8B-like layer, 32 q heads / 8 KV heads x 128, bf16, pages of 16, locs unique
in a 4x pool, positions < 4096. The unfused RoPE rounds differently (not kvwrite's order): it
is a speed baseline only.
"""
from __future__ import annotations

import argparse
import time

import torch

import kvwrite


CLOCKS = {"thread": time.thread_time, "wall": time.perf_counter}


def _median_us(fn, min_time: float = 0.3, clock=time.thread_time) -> float:
    fn()
    times, start = [], time.perf_counter()
    while time.perf_counter() - start < min_time or len(times) < 5:
        t0 = clock()
        fn()
        times.append(clock() - t0)
    times.sort()
    return times[len(times) // 2] * 1e6


def torch_rope(x: torch.Tensor, pos: torch.Tensor, cos_sin: torch.Tensor, w: torch.Tensor | None,
               eps: float) -> torch.Tensor:
    """RMS norm (w, or none) + neox RoPE of x [N, H, D] in plain torch ops (fp32 math, rounded to
    x.dtype)."""
    xf = x.float()
    if w is not None:
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w.float()
    cos, sin = cos_sin[pos].float().unsqueeze(1).chunk(2, dim=-1)
    x1, x2 = xf.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def rows(device: torch.device, ns, backend: str, clock=time.thread_time, norm: bool = True):
    hq, h, d, page, max_pos, eps = 32, 8, 128, 16, 4096, 1e-6
    gen = torch.Generator().manual_seed(0)
    for n in ns:
        q = torch.randn(n, hq, d, generator=gen).bfloat16().to(device)
        k = torch.randn(n, h, d, generator=gen).bfloat16().to(device)
        v = torch.randn(n, h, d, generator=gen).bfloat16().to(device)
        ang = torch.rand(max_pos, d // 2, generator=gen) * 6
        cs = torch.cat([ang.cos(), ang.sin()], -1).to(device)
        pos = torch.randint(0, max_pos, (n,), generator=gen).to(device)
        w = (torch.rand(d, generator=gen) + 0.5).to(device)
        # q is rotated in place on every timed call: a unit q norm weight keeps its values
        # stable (a weight < 1 applied again and again would drive them into fp32 subnormals)
        qw = torch.ones(d, device=device)
        if not norm:
            qw = w = None
        pages = -(-4 * n // page)
        loc = torch.randperm(pages * page, generator=gen)[:n].to(device)
        kc = torch.zeros(pages, page, h, d, dtype=torch.bfloat16, device=device)
        vc = torch.zeros_like(kc)
        kflat, vflat = kc.view(-1, h, d), vc.view(-1, h, d)

        def fused():
            kvwrite.rope_store_kv(pos, q, k, v, cs, kc, vc, loc, q_norm_weight=qw, k_norm_weight=w,
                                  norm_eps=eps, backend=backend)

        def unfused():
            q.copy_(torch_rope(q, pos, cs, qw, eps))
            kvwrite.store_kv(torch_rope(k, pos, cs, w, eps), v, kc, vc, loc, backend=backend)

        def index_copy():
            kflat.index_copy_(0, loc, k)
            vflat.index_copy_(0, loc, v)

        q0 = q.clone()
        yield (n, _median_us(fused, clock=clock), _median_us(unfused, clock=clock),
               _median_us(index_copy, clock=clock))
        q.copy_(q0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cpu")
    p.add_argument("--n", type=int, nargs="+", default=[1, 256, 4096])
    p.add_argument("--backend", default="auto")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--no-norm", action="store_true", help="no q/k RMS norm (a Llama layer)")
    p.add_argument("--clock", choices=tuple(CLOCKS), default=None,
                   help="thread: CPU time of the calling thread (default on cpu: a shared machine's "
                        "wall time includes waiting for a core); wall: elapsed time (default on cuda)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    clock = args.clock or ("thread" if dev.type == "cpu" else "wall")
    print(f"rope_store_kv, backend={args.backend}, {torch.get_num_threads()} thread(s), {clock} clock, "
          f"bf16, 32 q / 8 kv heads x 128, {'no norm' if args.no_norm else 'q/k RMS norm'}, neox")
    print("| N | fused µs | unfused (torch RoPE + store_kv) µs | index_copy_ pair µs | "
          "unfused / fused | fused / index_copy_ |")
    print("|---:|---:|---:|---:|---:|---:|")
    for n, f, u, ic in rows(dev, args.n, args.backend, CLOCKS[clock], norm=not args.no_norm):
        print(f"| {n} | {f:.1f} | {u:.1f} | {ic:.1f} | {u / f:.2f}x | {f / ic:.2f}x |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
