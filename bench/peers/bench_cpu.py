"""CPU store speed against vLLM's own CPU cache ops, one thread, in one process (ratios of one run).

Run inside a peer environment (bench/peers/envs.sh): `python bench/peers/bench_cpu.py [--json F]`.
vLLM 0.32 has `cpu_attn_reshape_and_cache` (its CPU attention layout); vLLM 0.11 has the legacy
head-major `reshape_and_cache`. Whatever the environment's vLLM has is timed beside kvwrite's
store of the same layout (cpu backend), plus kvwrite's fp8 stores against its bf16 stores per
element. Times are medians of repeated batches (ns per K+V element).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from kvwrite.bench.timing import cpu_median_us

H, D, BS = 8, 128, 16
NUM_BLOCKS = 4096


def timeit(fn, elems: int) -> float:
    """Median ns per element of `fn()` (kvwrite's own CPU timer, `kvwrite.bench.timing`)."""
    return cpu_median_us(fn, min_time=0.15) * 1e3 / elems


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", help="write the rows here")
    ap.add_argument("--tokens", default="256,1024")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import kvwrite
    from kvwrite.compat import vllm as kv_vllm
    try:
        import vllm
        from vllm import _custom_ops as ops  # noqa: F401  (registers torch.ops._C*)
        vllm_version = vllm.__version__
    except Exception as exc:  # noqa: BLE001
        vllm_version, ops = f"unavailable ({type(exc).__name__})", None
    has_cpu_attn = ops is not None and hasattr(torch.ops._C, "cpu_attn_reshape_and_cache")
    cache_ops = getattr(torch.ops, "_C_cache_ops", None)
    has_head_major = ops is not None and cache_ops is not None and hasattr(cache_ops, "reshape_and_cache")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for n in [int(x) for x in args.tokens.split(",")]:
        elems = 2 * n * H * D
        key = torch.randn(n, H, D, generator=gen).bfloat16()
        value = torch.randn(n, H, D, generator=gen).bfloat16()
        slots = torch.randperm(NUM_BLOCKS * BS, generator=gen)[:n].long()
        one = torch.tensor(1.0)

        def row(name, fn, group):
            rows.append(dict(tokens=n, name=name, group=group, ns_per_elem=timeit(fn, elems)))

        # vLLM's CPU attention layout
        kv = torch.zeros(NUM_BLOCKS, H, 2 * BS, D, dtype=torch.bfloat16)
        kc, vc = kv.chunk(2, dim=2)
        if has_cpu_attn:
            row(f"vllm {vllm_version} cpu_attn_reshape_and_cache bf16",
                lambda: torch.ops._C.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec", 1.0, 1.0, "auto"),
                "cpu_attn")
        row("kvwrite compat.vllm.cpu_attn_reshape_and_cache bf16",
            lambda: kv_vllm.cpu_attn_reshape_and_cache(key, value, kc, vc, slots, "vec", backend="cpu"),
            "cpu_attn")
        row("kvwrite store_kv(layout='cpu_attn') bf16",
            lambda: kvwrite.store_kv(key, value, kc, vc, slots, layout="cpu_attn", backend="cpu"), "cpu_attn")
        kv8 = torch.zeros(NUM_BLOCKS, H, 2 * BS, D, dtype=torch.uint8)
        kc8, vc8 = kv8.chunk(2, dim=2)
        row("kvwrite compat.vllm.cpu_attn_reshape_and_cache fp8",
            lambda: kv_vllm.cpu_attn_reshape_and_cache(key, value, kc8, vc8, slots, "vec", 1.0, 1.0, "fp8",
                                                       backend="cpu"), "cpu_attn")
        del kv, kv8
        # legacy head-major layout
        x = 8
        khm = torch.zeros(NUM_BLOCKS, H, D // x, BS, x, dtype=torch.bfloat16)
        vhm = torch.zeros(NUM_BLOCKS, H, D, BS, dtype=torch.bfloat16)
        if has_head_major:
            row(f"vllm {vllm_version} reshape_and_cache bf16",
                lambda: cache_ops.reshape_and_cache(key, value, khm, vhm, slots, "auto", one, one), "head_major")
        row("kvwrite compat.vllm.reshape_and_cache bf16",
            lambda: kv_vllm.reshape_and_cache(key, value, khm, vhm, slots, "auto", one, one, backend="cpu"),
            "head_major")
        khm8 = torch.zeros(NUM_BLOCKS, H, D // 16, BS, 16, dtype=torch.uint8)
        vhm8 = torch.zeros(NUM_BLOCKS, H, D, BS, dtype=torch.uint8)
        row("kvwrite compat.vllm.reshape_and_cache fp8",
            lambda: kv_vllm.reshape_and_cache(key, value, khm8, vhm8, slots, "fp8", one, one, backend="cpu"),
            "head_major")
        del khm, vhm, khm8, vhm8
        # flash (NHD) layout
        kf = torch.zeros(NUM_BLOCKS, BS, H, D, dtype=torch.bfloat16)
        vf = torch.zeros_like(kf)
        row("kvwrite store_kv NHD bf16", lambda: kvwrite.store_kv(key, value, kf, vf, slots, backend="cpu"), "flash")
        kf8 = torch.zeros(NUM_BLOCKS, BS, H, D, dtype=torch.float8_e4m3fn)
        vf8 = torch.zeros_like(kf8)
        row("kvwrite store_kv NHD fp8_e4m3",
            lambda: kvwrite.store_kv(key, value, kf8, vf8, slots, k_scale=one, v_scale=one, backend="cpu"), "flash")
        del kf, vf, kf8, vf8
    # ratios within the run
    by = {(r["tokens"], r["name"]): r["ns_per_elem"] for r in rows}
    ratios = []
    for n in [int(x) for x in args.tokens.split(",")]:
        def ratio(a, b, what):
            if (n, a) in by and (n, b) in by:
                ratios.append(dict(tokens=n, what=what, ratio=by[(n, a)] / by[(n, b)]))
        ratio(f"vllm {vllm_version} cpu_attn_reshape_and_cache bf16", "kvwrite compat.vllm.cpu_attn_reshape_and_cache bf16",
              "vLLM cpu_attn / kvwrite adapter (>1: kvwrite faster)")
        ratio(f"vllm {vllm_version} reshape_and_cache bf16", "kvwrite compat.vllm.reshape_and_cache bf16",
              "vLLM head-major / kvwrite adapter (>1: kvwrite faster)")
        ratio("kvwrite store_kv NHD fp8_e4m3", "kvwrite store_kv NHD bf16", "kvwrite fp8 / bf16 per element, NHD")
        ratio("kvwrite compat.vllm.reshape_and_cache fp8", "kvwrite compat.vllm.reshape_and_cache bf16",
              "kvwrite fp8 / bf16 per element, head-major")
        ratio("kvwrite compat.vllm.cpu_attn_reshape_and_cache fp8", "kvwrite compat.vllm.cpu_attn_reshape_and_cache bf16",
              "kvwrite fp8 / bf16 per element, cpu_attn")
    out = dict(vllm=vllm_version, torch=torch.__version__, threads=1, H=H, D=D, block_size=BS,
               num_blocks=NUM_BLOCKS, rows=rows, ratios=ratios)
    for r in rows:
        print(f"N={r['tokens']:5d}  {r['ns_per_elem']:8.3f} ns/elem  {r['name']}")
    for r in ratios:
        print(f"N={r['tokens']:5d}  ratio {r['ratio']:7.2f}  {r['what']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
