"""GPU check of store_kv's int4 format (vLLM's INT4_PER_TOKEN_HEAD; kernels/store_kv_int4.py and
the cuda backend's csrc/kvwrite/kv_int4.h): every CUDA backend equals the torch reference byte
for byte (codes and scale caches, canary bytes around them untouched) for bf16 / fp16 / fp32
inputs and several head dims, special values included; a slot past the pool in guard mode is
skipped and recorded with no stray byte; the decoded rows keep the documented error bound.

`python bench/gpu/int4.py [--out FILE] [--device cuda]`: one JSON line per case and a summary line; exit 1 on any
mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import kvwrite

CASES = [(torch.bfloat16, 128, 128), (torch.float16, 64, 64), (torch.float32, 96, 96), (torch.bfloat16, 256, 80)]


def buffers(pages, pps, h, d, dv, dev):
    """One random byte buffer holding the four caches with 256 canary bytes around each."""
    pad = 256
    sizes = [pages * pps * h * d // 2, pages * pps * h * dv // 2, pages * pps * h * 4, pages * pps * h * 4]
    raw = torch.randint(0, 256, (pad + sum(s + pad for s in sizes),), dtype=torch.uint8, device=dev)
    out, off = [], pad
    shapes = [((pages, pps, h, d // 2), torch.uint8), ((pages, pps, h, dv // 2), torch.uint8),
              ((pages, pps, h), torch.float32), ((pages, pps, h), torch.float32)]
    for n, (shape, dtype) in zip(sizes, shapes):
        out.append(raw[off:off + n].view(dtype).view(shape))
        off += n + pad
    return raw, out


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def store(b, k, v, loc, backend, check, errors):
    kvwrite.store_kv(k, v, b[0], b[1], loc, k_scale_cache=b[2], v_scale_cache=b[3], check=check, errors=errors,
                     backend=backend)


def run_case(dtype, d, dv, backend, dev, n=64, h=8, pps=16, pages=16) -> dict:
    gen = torch.Generator(device=dev).manual_seed(1)
    k = (torch.randn(n, h, d, device=dev, generator=gen) * 3).to(dtype)
    v = torch.randn(n, h, dv, device=dev, generator=gen).to(dtype)
    k[0, 0, 0], k[1, 1, 1], v[2, 0, 3] = float("inf"), float("nan"), float("-inf")
    loc = torch.randperm(pages * pps, device=dev, generator=gen)[:n]
    loc[3] = -1
    res = {"case": f"{str(dtype)[6:]} D={d} Dv={dv}", "backend": backend}
    raw, b = buffers(pages, pps, h, d, dv, dev)
    raw_ref, bref = buffers(pages, pps, h, d, dv, dev)
    raw_ref.copy_(raw)
    errs = kvwrite.ErrorBuffer(dev)
    store(b, k, v, loc, backend, "guard", errs)
    store(bref, k, v, loc, "torch", "off", None)
    sync(dev)
    res["equal"] = bool(torch.equal(raw, raw_ref))
    res["bytes_differ"] = int((raw != raw_ref).sum())
    res["no_error"] = errs.error() is None
    # a slot past the pool (guard): skipped, recorded, the rest written as the reference does
    bad = loc.clone()
    bad[5] = pages * pps + 7
    before = raw.clone()
    store(b, k, v, bad, backend, "guard", errs)
    err = errs.error()
    res["guard_recorded"] = err is not None and (err.token_index, err.loc) == (5, pages * pps + 7)
    good = loc.clone()
    good[5] = -1
    raw_ref.copy_(before)
    store(bref, k, v, good, "torch", "off", None)
    sync(dev)
    res["guard_no_stray_byte"] = bool(torch.equal(raw, raw_ref))
    # decoded rows within half a step of the input (+ the rotated values' rounding)
    live = loc[loc >= 0]
    idx = (loc >= 0).nonzero().flatten()
    back = kvwrite.dequant_kv_int4(b[1], b[3], live)
    step = (b[3].view(torch.int32) & ~0xF).view(torch.float32)[live // pps, live % pps]
    from kvwrite.reference.kv_int4 import rht
    x = v[idx].float()
    fin = torch.isfinite(x).all(-1)
    bound = step * 0.5 * (1 + 1e-5) + rht(x).abs().amax(-1) * 2.0 ** -8 + 1e-6
    res["round_trip_ok"] = bool((((back - x).abs().amax(-1) <= bound) | ~fin).all())
    res["ok"] = res["equal"] and res["no_error"] and res["guard_recorded"] and res["guard_no_stray_byte"] \
        and res["round_trip_ok"]
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    ap.add_argument("--device", default="cuda", help="cuda (the check); cpu runs the script's own smoke test")
    args = ap.parse_args()
    dev = torch.device(args.device)
    rows = []
    kernels = ("cuda", "triton") if dev.type == "cuda" else ("cpu", "triton")
    backends = [b for b in kernels if kvwrite.backends(dev)[b] is None]
    for dtype, d, dv in CASES:
        for be in backends:
            r = run_case(dtype, d, dv, be, dev)
            rows.append(r)
            print(json.dumps(r), flush=True)
    ok = all(r["ok"] for r in rows)
    summary = {"int4_cases": len(rows), "backends": backends, "all_ok": ok}
    print(json.dumps(summary))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "summary": summary}, f, indent=1)
    return 0 if ok and rows else 1


if __name__ == "__main__":
    sys.exit(main())
