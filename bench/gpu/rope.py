"""GPU-only checks of the fused rope stores (bench/gpu_check.sh runs this on a CUDA machine):
for rope_store_kv (bf16 copy with q/k norm, e4m3 static, int8 dynamic per token) and rope_store_mla (auto, fp8_ds_mla,
nvfp4), on the "cuda" and "triton" backends, guard mode:

  1. eager call == the torch reference, byte for byte (caches, q, error record);
  2. CUDA graph: the call captured in a torch.cuda.CUDAGraph, replayed on fresh inputs copied
     into the captured buffers == the reference on those inputs (no host sync in the op: capture
     fails on one);
  3. torch.compile(fullgraph=True) of a function calling the op == the reference.

Prints one JSON line per (op, case, backend, stage) and exits 1 on any mismatch or error.
"""
from __future__ import annotations

import json
import sys

import torch

import kvwrite


def kv_case(kind: str, n: int = 37, gen: torch.Generator | None = None) -> dict:
    hq, h, d, pps, pages, max_pos = 8, 2, 128, 16, 8, 512
    dev = "cuda"
    g = gen or torch.Generator().manual_seed(0)
    fp8 = kind == "e4m3"
    dyn = kind == "int8_token"
    cdt = torch.float8_e4m3fn if fp8 else torch.int8 if dyn else torch.bfloat16
    ang = torch.rand(max_pos, d // 2, generator=g) * 6
    loc = torch.randperm(pages * pps, generator=g)[:n]
    loc[::7] = -1
    return dict(
        positions=torch.randint(0, max_pos, (n,), generator=g).to(dev),
        q=torch.randn(n, hq, d, generator=g).bfloat16().to(dev),
        k=torch.randn(n, h, d, generator=g).bfloat16().to(dev),
        v=torch.randn(n, h, d, generator=g).bfloat16().to(dev),
        cos_sin_cache=torch.cat([ang.cos(), ang.sin()], -1).to(dev),
        k_cache=torch.zeros(pages, pps, h, d, device=dev).to(cdt),
        v_cache=torch.zeros(pages, pps, h, d, device=dev).to(cdt),
        loc=loc.to(dev),
        extra=dict(q_norm_weight=(torch.rand(d, generator=g) + 0.5).to(dev),
                   k_norm_weight=(torch.rand(d, generator=g) + 0.5).to(dev),
                   **(dict(k_scale=torch.tensor([0.02], device=dev),
                           v_scale=torch.tensor([0.03], device=dev)) if fp8 else {}),
                   **(dict(k_scale_cache=torch.zeros(pages, pps, device=dev),
                           v_scale_cache=torch.zeros(pages, pps, device=dev)) if dyn else {})))


def mla_case(fmt: str, n: int = 29, gen: torch.Generator | None = None) -> dict:
    hq, L, R, pps, pages, max_pos = 16, 512, 64, 16, 8, 512
    dev = "cuda"
    g = gen or torch.Generator().manual_seed(1)
    f = kvwrite.ops.mla.FORMATS[fmt]
    ang = torch.rand(max_pos, R // 2, generator=g) * 6
    loc = torch.randperm(pages * pps, generator=g)[:n]
    loc[::5] = -1
    extra = {}
    if f.takes_scale_cache:
        extra["scale_cache"] = torch.zeros(pages, pps, (L + R) // 16, device=dev).to(torch.float8_e4m3fn)
    return dict(
        positions=torch.randint(0, max_pos, (n,), generator=g).to(dev),
        q_pe=torch.randn(n, hq, R, generator=g).bfloat16().to(dev),
        kv_c=torch.randn(n, L, generator=g).bfloat16().to(dev),
        k_pe=torch.randn(n, R, generator=g).bfloat16().to(dev),
        cos_sin_cache=torch.cat([ang.cos(), ang.sin()], -1).to(dev),
        kv_cache=torch.zeros(pages, pps, f.row_width(L, R), device=dev).to(f.cache_dtype(torch.bfloat16)),
        loc=loc.to(dev), extra=dict(kv_cache_dtype=fmt, **extra))


MUTATED = {"kv": ("q", "k_cache", "v_cache", "k_scale_cache", "v_scale_cache"),
           "mla": ("q_pe", "kv_cache", "scale_cache")}


def call(op: str, t: dict, backend: str, errors: kvwrite.ErrorBuffer) -> None:
    extra = {k: v for k, v in t["extra"].items()}
    if op == "kv":
        kvwrite.rope_store_kv(t["positions"], t["q"], t["k"], t["v"], t["cos_sin_cache"], t["k_cache"],
                              t["v_cache"], t["loc"], check="guard", errors=errors, backend=backend, **extra)
    else:
        kvwrite.rope_store_mla(t["positions"], t["q_pe"], t["kv_c"], t["k_pe"], t["cos_sin_cache"],
                               t["kv_cache"], t["loc"], check="guard", errors=errors, backend=backend, **extra)


def clone(t: dict) -> dict:
    out = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t.items()}
    out["extra"] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in t["extra"].items()}
    return out


def outputs(op: str, t: dict, errors: kvwrite.ErrorBuffer) -> list[torch.Tensor]:
    outs = [t.get(k, t["extra"].get(k)) for k in MUTATED[op]]
    return [o.view(torch.uint8) for o in outs if o is not None] + [errors.tensor]


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def reference(op: str, t: dict) -> list[torch.Tensor]:
    r = clone(t)
    e = kvwrite.ErrorBuffer("cuda")
    call(op, r, "torch", e)
    return outputs(op, r, e)


def check(op: str, case: str, backend: str, make) -> list[dict]:
    rows = []
    # 1. eager
    t = make()
    want = reference(op, t)
    e = kvwrite.ErrorBuffer("cuda")
    call(op, t, backend, e)
    torch.cuda.synchronize()
    rows.append(dict(stage="eager", ok=same(outputs(op, t, e), want)))
    # 2. CUDA graph: capture on buffers, replay on new inputs copied in
    t = make()
    e = kvwrite.ErrorBuffer("cuda")
    call(op, clone(t), backend, kvwrite.ErrorBuffer("cuda"))  # warm-up (JIT, autotune) outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    snapshot = clone(t)
    with torch.cuda.graph(graph):
        call(op, t, backend, e)
    fresh = make(torch.Generator().manual_seed(99))
    for k, v in fresh.items():
        if isinstance(v, torch.Tensor):
            t[k].copy_(v)
    for k, v in fresh["extra"].items():
        if isinstance(v, torch.Tensor):
            t["extra"][k].copy_(v)
    e.reset()
    want = reference(op, t)
    graph.replay()
    torch.cuda.synchronize()
    rows.append(dict(stage="cuda_graph", ok=same(outputs(op, t, e), want)))
    del snapshot
    # 3. torch.compile(fullgraph=True)
    t = make()
    want = reference(op, t)
    e = kvwrite.ErrorBuffer("cuda")
    compiled = torch.compile(lambda: call(op, t, backend, e), fullgraph=True)
    compiled()
    torch.cuda.synchronize()
    rows.append(dict(stage="compile", ok=same(outputs(op, t, e), want)))
    return [dict(op=op, case=case, backend=backend, **r) for r in rows]


def main() -> int:
    failed = 0
    for backend in ("cuda", "triton"):
        for op, cases in (("kv", ("bf16", "e4m3", "int8_token")), ("mla", ("auto", "fp8_ds_mla", "nvfp4"))):
            for case in cases:
                make = (lambda g=None, c=case: kv_case(c, gen=g)) if op == "kv" else (lambda g=None, c=case: mla_case(c, gen=g))
                try:
                    rows = check(op, case, backend, make)
                except Exception as exc:  # report and go on
                    rows = [dict(op=op, case=case, backend=backend, stage="error", ok=False,
                                 error=f"{type(exc).__name__}: {exc}"[:800])]
                for r in rows:
                    failed += not r["ok"]
                    print(json.dumps(r), flush=True)
    print(json.dumps({"rope_gpu_check": "ok" if not failed else f"{failed} failed"}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
