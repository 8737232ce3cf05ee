"""NVFP4 on a device: every kernel backend of store_kv_nvfp4 (and Triton's store_mla "nvfp4")
bit-exact against the torch reference on a large random batch, and the measured round-trip error
against the documented bound.

`python bench/nvfp4_check.py [--device cuda] [--tokens 65536]` prints one JSON line. On a CPU
without TRITON_INTERPRET it measures the reference's error alone.
"""
from __future__ import annotations

import argparse
import json

import torch

import kvwrite
from kvwrite.reference.nvfp4 import BLOCK, error_bound


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=65536)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    args = p.parse_args(argv)
    dev, n, h, d = torch.device(args.device), args.tokens, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(n, h, d // BLOCK, BLOCK, generator=gen)
    x = (x * torch.exp2(torch.randint(-6, 8, (n, h, d // BLOCK, 1), generator=gen).float()))
    x = x.reshape(n, h, d).to(torch.bfloat16).to(dev)
    g = torch.tensor(0.37, device=dev)
    loc = torch.randperm(n, generator=gen).to(dev)
    pps = 16

    def pool():
        return (torch.zeros(n // pps, pps, h, d // 2, dtype=torch.uint8, device=dev),
                torch.zeros(n // pps, pps, h, d // 2, dtype=torch.uint8, device=dev),
                torch.zeros(n // pps, pps, h, d // BLOCK, dtype=torch.float8_e4m3fn, device=dev),
                torch.zeros(n // pps, pps, h, d // BLOCK, dtype=torch.float8_e4m3fn, device=dev))

    ref = pool()
    kvwrite.store_kv_nvfp4(x, x, *ref, loc, k_global_scale=g, v_global_scale=g, backend="torch")
    result = {"device": str(dev), "tokens": n, "heads": h, "head_dim": d, "backends": {}}
    ok = True
    for backend, why in kvwrite.backends(dev).items():
        if backend == "torch" or why is not None:
            continue
        try:
            got = pool()
            errs = kvwrite.ErrorBuffer(dev)
            kvwrite.store_kv_nvfp4(x, x, *got, loc, k_global_scale=g, v_global_scale=g,
                                   check="guard", errors=errs, backend=backend)
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, ref))
            result["backends"][backend] = {"bit_exact": same, "clean": errs.error() is None}
            ok &= same and errs.error() is None
        except Exception as exc:  # report, do not hide
            result["backends"][backend] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
            ok = False
    # MLA rows (DeepSeek 512 + 64) in NVFP4 through store_mla, sliced from one projection
    proj = (torch.randn(n, 8 + 512 + 64, generator=gen) * 3).to(torch.bfloat16).to(dev)
    kv_c, k_pe = proj[:, 8:520], proj[:, 520:]

    def mla_pool():
        return (torch.zeros(n // pps, pps, 288, dtype=torch.uint8, device=dev),
                torch.zeros(n // pps, pps, 36, dtype=torch.float8_e4m3fn, device=dev))

    mla_ref = mla_pool()
    kvwrite.store_mla(kv_c, k_pe, mla_ref[0], loc, kv_cache_dtype="nvfp4", scale_cache=mla_ref[1],
                      global_scale=g, backend="torch")
    if kvwrite.backends(dev)["triton"] is None:
        got = mla_pool()
        errs = kvwrite.ErrorBuffer(dev)
        kvwrite.store_mla(kv_c, k_pe, got[0], loc, kv_cache_dtype="nvfp4", scale_cache=got[1],
                          global_scale=g, check="guard", errors=errs, backend="triton")
        same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, mla_ref))
        result["mla_nvfp4_triton"] = {"bit_exact": same, "clean": errs.error() is None}
        ok &= same and errs.error() is None
    rows = loc.long()
    kc, ksc = ref[0].flatten(0, 1)[rows], ref[2].flatten(0, 1)[rows]
    deq = kvwrite.dequant_nvfp4(kc, ksc, g)
    xf = x.float()
    amax = xf.reshape(n, h, d // BLOCK, BLOCK).abs().amax(-1)
    s = amax / 6 / g
    normal = ((s >= 2.0 ** -6) & (s <= 448)).repeat_interleave(BLOCK, -1)
    err = (xf - deq).abs()
    bound = error_bound(xf, deq, ksc, g)
    within = bool((err <= bound * (1 + 2 ** -20))[normal].all())
    result.update(normal_fraction=float(normal.float().mean()),
                  max_err_over_amax=float((err / amax.repeat_interleave(BLOCK, -1))[normal].max()),
                  max_err_over_bound=float((err / bound)[normal].max()), within_bound=within)
    ok &= within
    result["ok"] = ok
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
