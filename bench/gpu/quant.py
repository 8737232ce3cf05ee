"""GPU check of store_kv's int8 / dynamic-scale modes (kernels/store_kv_quant.py, the cuda
backend's csrc/kvwrite/store_kv_quant.h): every backend on CUDA equals the torch reference byte
for byte (codes and scale caches, canary bytes around them untouched), eagerly and as a CUDA
graph captured once and replayed on new inputs (guard mode records into a captured buffer).

`python bench/gpu/quant.py [--out FILE]`: one JSON line per case and a summary line; exit 1 on
any mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import kvwrite

FORMATS = [  # (cache dtype, scales, quant_rule)
    (torch.int8, "token", "rne"), (torch.int8, "head", "rne"), (torch.int8, "token", "vllm"),
    (torch.int8, "head", "vllm"), (torch.float8_e4m3fn, "token", "rne"), (torch.float8_e4m3fn, "head", "vllm"),
    (torch.float8_e5m2, "head", "rne"), (torch.int8, "static", "rne"),
]


def buffers(dtype, scales, pages, pps, h, d, dev):
    pad = 256
    raw = torch.randint(0, 256, (4 * pad + 2 * pages * pps * h * d + 2 * pages * pps * h * 4,),
                        dtype=torch.uint8, device=dev)
    out, off = {}, pad
    for name in ("k", "v"):
        n = pages * pps * h * d
        out[name] = raw[off:off + n].view(dtype).view(pages, pps, h, d)
        off += n + pad
    if scales in ("token", "head"):
        shape = (pages, pps) if scales == "token" else (pages, pps, h)
        for name in ("ks", "vs"):
            n = pages * pps * (h if scales == "head" else 1) * 4
            t = raw[off:off + n].view(torch.float32).view(shape)
            t.zero_()
            out[name] = t
            off += n + pad
    return raw, out


def call(b, k, v, loc, scales, rule, backend, check, errors):
    kw = dict(check=check, errors=errors, backend=backend)
    if scales == "static":
        kw.update(k_scale=torch.full((k.shape[1],), 0.03, device=k.device), v_scale=torch.full((), 0.05, device=k.device))
    else:
        kw.update(k_scale_cache=b["ks"], v_scale_cache=b["vs"], quant_rule=rule)
    kvwrite.store_kv(k, v, b["k"], b["v"], loc, **kw)


def run_case(dtype, scales, rule, backend, n=64, h=8, d=128, pps=16, pages=16) -> dict:
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(1)
    k = torch.randn(n, h, d, device=dev, generator=gen).bfloat16() * 3
    v = torch.randn(n, h, d, device=dev, generator=gen).bfloat16() * 3
    k[0, 0, 0], k[1, 1, 1] = float("inf"), float("nan")
    loc = torch.randperm(pages * pps, device=dev, generator=gen)[:n]
    loc[3] = -1
    res = {"format": f"{str(dtype)[6:]} {scales} {rule}", "backend": backend}
    raw, b = buffers(dtype, scales, pages, pps, h, d, dev)
    raw_ref, bref = buffers(dtype, scales, pages, pps, h, d, dev)
    raw_ref.copy_(raw)
    errs = kvwrite.ErrorBuffer(dev)
    call(b, k, v, loc, scales, rule, backend, "guard", errs)
    call(bref, k, v, loc, scales, rule, "torch", "off", None)
    torch.cuda.synchronize()
    res["eager_equal"] = bool(torch.equal(raw, raw_ref))
    res["eager_no_error"] = errs.error() is None
    # CUDA graph: capture once (guard, default-free buffer), replay on new inputs and locs
    k2, v2 = torch.empty_like(k), torch.empty_like(v)
    loc2 = torch.empty_like(loc)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        call(b, k2.copy_(k), v2.copy_(v), loc2.copy_(loc), scales, rule, backend, "guard", errs)  # warm-up
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(g):
            call(b, k2, v2, loc2, scales, rule, backend, "guard", errs)
    except Exception as exc:  # capture refused (a host sync in the op): the point of this check
        res["graph"] = f"capture failed: {type(exc).__name__}: {str(exc)[:200]}"
        res["ok"] = False
        return res
    for rep in range(3):
        k2.copy_(torch.randn(n, h, d, device=dev, generator=gen).bfloat16() * (rep + 1))
        v2.copy_(torch.randn(n, h, d, device=dev, generator=gen).bfloat16())
        loc2.copy_(torch.randperm(pages * pps, device=dev, generator=gen)[:n])
        if rep == 2:
            loc2[5] = pages * pps + 7   # out of the pool: guard skips and records it
        g.replay()
        call(bref, k2, v2, loc2, scales, rule, "torch", "guard" if rep == 2 else "off",
             kvwrite.ErrorBuffer(dev) if rep == 2 else None)
    torch.cuda.synchronize()
    res["graph_equal"] = bool(torch.equal(raw, raw_ref))
    err = errs.error()
    res["graph_guard_record"] = None if err is None else (err.token_index, err.loc, err.count)
    res["ok"] = res["eager_equal"] and res["eager_no_error"] and res["graph_equal"] and \
        err is not None and err.token_index == 5
    return res


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print(json.dumps({"ok": False, "why": "no CUDA device"}))
        return 1
    rows = []
    for backend in ("triton", "cuda"):
        why = kvwrite.backends("cuda").get(backend)
        if why is not None:
            rows.append({"backend": backend, "ok": False, "why": why})
            continue
        for dtype, scales, rule in FORMATS:
            try:
                r = run_case(dtype, scales, rule, backend)
            except Exception as exc:
                r = {"format": f"{str(dtype)[6:]} {scales} {rule}", "backend": backend, "ok": False,
                     "error": f"{type(exc).__name__}: {str(exc)[:300]}"}
            rows.append(r)
            print(json.dumps(r), flush=True)
    bad = [r for r in rows if not r.get("ok")]
    summary = {"quant_gpu_check": "ok" if not bad else "FAILED", "cases": len(rows), "failed": len(bad)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    print(json.dumps(summary), flush=True)
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
