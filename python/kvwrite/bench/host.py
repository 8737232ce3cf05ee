"""Host cost per call at N = 1 (against the host-cost targets): each kvwrite entry point, kernel included,
against its nearest torch equivalent on the same tensors, each pair timed interleaved in one run
(batches of A then B, repeated; median of each), so the ratio shares the machine's state.

MHA Llama-3.1-8B layer (8 x 128 bf16, pool 64 pages x 16), MLA 512 + 64 bf16, DSA indexer
K 128 bf16 (pages of 16 x (128 + 4) bytes), NVFP4 MHA 8 x 128. The torch equivalents write the
same rows without kvwrite's checks (and, for the quantising ops, without the quantisation: the
bytes are quantised beforehand), so they are lower bounds of what such a store costs in torch.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

import kvwrite

Fn = Callable[[], object]
H, D, PAGES, PPS = 8, 128, 64, 16


def interleaved_us(a: Fn, b: Fn, min_time: float = 0.2, rounds: int = 21) -> tuple[float, float]:
    """(median µs per call of a, of b), batches of the two alternating."""
    for fn in (a, b):  # warm up (first-call builds, caches)
        for _ in range(20):
            fn()
    t0 = time.perf_counter_ns()
    for _ in range(50):
        a()
    once = max((time.perf_counter_ns() - t0) / 50 * 1e-9, 1e-8)
    inner = max(1, min(20_000, int(min_time / rounds / once)))
    out: tuple[list[float], list[float]] = ([], [])
    for _ in range(rounds):
        for fn, samples in zip((a, b), out):
            t0 = time.perf_counter_ns()
            for _ in range(inner):
                fn()
            samples.append((time.perf_counter_ns() - t0) / inner / 1e3)
    return statistics.median(out[0]), statistics.median(out[1])


def _pairs(device: torch.device, gen: torch.Generator) -> list[tuple[str, Fn, str, Fn, float]]:
    """(entry point, call, nearest torch equivalent, call, target ratio)."""
    bf = torch.bfloat16
    rnd = lambda *s: torch.randn(*s, generator=gen).to(bf).to(device)  # noqa: E731
    loc = torch.randint(0, PAGES * PPS, (1,), generator=gen).to(device)
    out = []

    # MHA bf16
    k, v = rnd(1, H, D), rnd(1, H, D)
    kc, vc = torch.zeros(PAGES, PPS, H, D, dtype=bf, device=device), torch.zeros(PAGES, PPS, H, D, dtype=bf, device=device)
    kf, vf = kc.view(-1, H, D), vc.view(-1, H, D)
    pair = lambda: (kf.index_copy_(0, loc, k), vf.index_copy_(0, loc, v))  # noqa: E731
    errors = kvwrite.ErrorBuffer(device)
    op = torch.ops.kvwrite.store_kv.default
    out += [
        ("kvwrite.store_kv", lambda: kvwrite.store_kv(k, v, kc, vc, loc), "index_copy_ pair (K, V)", pair, 1.5),
        ("kvwrite.store_kv check=guard", lambda: kvwrite.store_kv(k, v, kc, vc, loc, check="guard", errors=errors),
         "index_copy_ pair (K, V)", pair, 1.5),
        ("torch.ops.kvwrite.store_kv",
         lambda: op(k, v, kc, vc, loc, "NHD", None, None, "off", None, None, 0, 1, "auto"),
         "index_copy_ pair (K, V)", pair, 1.5),
    ]
    spec = kvwrite.ModelSpec("mha", 1, num_kv_heads=H, head_dim=D)
    pool = kvwrite.KVCacheConfigurator(spec, kvwrite.ParallelSpec(), page_size=PPS,
                                       memory_bytes=PAGES * PPS * H * D * 2 * 2).build(device)
    pk, pv = pool.layer("kv", 0)["k"], pool.layer("kv", 0)["v"]
    out.append(("pool.store (KVPool, mha)", lambda: pool.store(0, loc, k, v),
                "kvwrite.store_kv (same buffers)", lambda: kvwrite.store_kv(k, v, pk, pv, loc), 1.1))

    # MLA bf16 512 + 64
    kv_c, k_pe = rnd(1, 512), rnd(1, 64)
    mla = torch.zeros(PAGES, PPS, 576, dtype=bf, device=device)
    mf = mla.view(-1, 576)
    out.append(("kvwrite.store_mla", lambda: kvwrite.store_mla(kv_c, k_pe, mla, loc),
                "torch.cat + index_copy_", lambda: mf.index_copy_(0, loc, torch.cat([kv_c, k_pe], -1)), 1.5))

    # DSA indexer K: 128 bf16 -> 128 e4m3 bytes + one fp32 scale
    ik = rnd(1, 128)
    icache = torch.zeros(PAGES, PPS * 132, dtype=torch.uint8, device=device)
    values = icache[:, :PPS * 128].unflatten(1, (PPS, 128))
    scales = icache[:, PPS * 128:].view(torch.float32)
    page, off = loc // PPS, loc % PPS
    q = ik.float().clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    s = ik.float().abs().amax(-1)
    out.append(("kvwrite.store_indexer_k", lambda: kvwrite.store_indexer_k(ik, icache, loc),
                "index_put_ pair (quantised bytes, fp32 scale)",
                lambda: (values.index_put_((page, off), q), scales.index_put_((page, off), s)), 1.5))

    # NVFP4 MHA 8 x 128: uint8 [.., 64] values + e4m3 [.., 8] scales, K and V
    ncache = [torch.zeros(PAGES, PPS, H, w, dtype=dt, device=device)
              for w, dt in ((D // 2, torch.uint8),) * 2 + ((D // 16, torch.float8_e4m3fn),) * 2]
    flat = [c.view(torch.uint8).view(-1, H, c.shape[-1]) for c in ncache]  # e4m3 has no index_copy_
    rows = [torch.zeros(1, H, c.shape[-1], dtype=torch.uint8, device=device) for c in ncache]
    out.append(("kvwrite.store_kv_nvfp4", lambda: kvwrite.store_kv_nvfp4(k, v, *ncache, loc),
                "index_copy_ x4 (quantised K/V values + scales)",
                lambda: [f.index_copy_(0, loc, r) for f, r in zip(flat, rows)], 1.5))
    return out


def measure(device: torch.device | str = "cpu", min_time: float = 0.2, seed: int = 0) -> list[dict]:
    """One row per entry point: its µs, its torch equivalent's µs, the ratio and the target."""
    device = torch.device(device)
    rows = []
    for what, fn, vs, base, target in _pairs(device, torch.Generator().manual_seed(seed)):
        us, vs_us = interleaved_us(fn, base, min_time)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        ratio = us / vs_us
        rows.append({"what": what, "us": round(us, 3), "vs": vs, "vs_us": round(vs_us, 3),
                     "ratio": round(ratio, 3), "target": target, "met": ratio <= target})
    return rows


def markdown(rows: list[dict]) -> list[str]:
    """The report's host-cost section."""
    if not rows:
        return []
    lines = ["## Host cost per call at N = 1", "",
             "Each entry point (kernel included) against its nearest torch equivalent on the same "
             "tensors, the two timed interleaved in this run (median µs per call); the torch "
             "equivalents write the same rows without checks and, for the quantising ops, from "
             "bytes quantised beforehand.", "",
             "| call | µs | nearest torch equivalent | µs | ratio | target | met |",
             "|---|---:|---|---:|---:|---:|---|"]
    for r in rows:
        lines.append(f"| `{r['what']}` | {r['us']:.2f} | {r['vs']} | {r['vs_us']:.2f} | {r['ratio']:.2f}x | "
                     f"<= {r['target']}x | {'yes' if r['met'] else '**no**'} |")
    return lines + [""]
