"""GPU-only checks of the page moves (bench/gpu_check.sh): pinned host <-> GPU copy_pages on every
backend vs torch indexing (bytes, guard record), CUDA-graph capture of copy_pages / gather /
slot_mapping in guard mode (replayed: same bytes, the record filled by the replay), and times of
host <-> GPU and GPU <-> GPU page copies against a plain copy of the same bytes.

`python bench/gpu/pages.py [--out pages.json]`: one JSON line per check; exit 1 on a mismatch.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

import kvwrite
from kvwrite import ErrorBuffer, PageGeometry
from kvwrite.bench import timing

ok = True


def emit(**row) -> None:
    global ok
    ok = ok and row.get("ok", True)
    print(json.dumps(row), flush=True)


def host_gpu(backend: str) -> None:
    g = torch.Generator().manual_seed(0)
    host = torch.randn(64, 32, 8, 128, generator=g).to(torch.bfloat16).pin_memory()
    dev = torch.zeros(48, 16, 8, 128, dtype=torch.bfloat16, device="cuda")   # pages of 16: factor 2
    sp = torch.tensor([5, 63, 0, 17, -1], dtype=torch.int64)                    # host units of 16 rows
    dp = torch.tensor([1, 0, 47, 9, 3], dtype=torch.int64, device="cuda")
    want = dev.clone()
    units = host.view(128, 16, 8, 128)
    for s, d in zip(sp.tolist(), dp.tolist()):
        if s >= 0 and d >= 0:
            want[d] = units[s].cuda()
    kvwrite.copy_pages(host, dev, sp, dp, backend=backend)
    torch.cuda.synchronize()
    emit(check="pinned host -> GPU copy_pages (factor 2)", backend=backend, ok=bool(torch.equal(dev, want)))
    back = torch.zeros(64, 32, 8, 128, dtype=torch.bfloat16).pin_memory()
    kvwrite.copy_pages(dev, back, dp.cpu(), sp, backend=backend)
    torch.cuda.synchronize()
    ref = torch.zeros_like(back).view(128, 16, 8, 128)
    for s, d in zip(sp.tolist(), dp.tolist()):
        if s >= 0 and d >= 0:
            ref[s] = dev[d].cpu()
    emit(check="GPU -> pinned host copy_pages", backend=backend, ok=bool(torch.equal(back.view_as(ref), ref)))
    err = ErrorBuffer("cuda")
    kvwrite.copy_pages(host, dev, torch.tensor([1, 999]), torch.tensor([0, 1], device="cuda"), check="guard",
                       errors=err, backend=backend)
    e = err.error()
    emit(check="host -> GPU guard record", backend=backend, ok=e is not None and e.target == 999,
         error=str(e))


def graphs(backend: str) -> None:
    src = torch.randn(32, 16, 8, 128, device="cuda").to(torch.bfloat16)
    dst = torch.zeros_like(src)
    sp = torch.tensor([3, 7, 40], device="cuda")
    dp = torch.tensor([0, 1, 2], device="cuda")
    cache = torch.randn(16, 16, 8, 128, device="cuda").to(torch.float8_e4m3fn)
    loc = torch.tensor([5, 17, -1, 300], device="cuda")
    out = torch.empty(4, 8, 128, dtype=cache.dtype, device="cuda")
    bt = torch.tensor([[3, 1], [2, 99]], dtype=torch.int32, device="cuda")
    b = torch.tensor([0, 1, 1, 2], dtype=torch.int32, device="cuda")
    pos = torch.tensor([5, 3, 20, 0], dtype=torch.int32, device="cuda")
    geo = PageGeometry(page_size=16, num_pages=16)
    err = ErrorBuffer("cuda")
    slots = torch.empty(4, dtype=torch.int64, device="cuda")

    def step():
        kvwrite.copy_pages(src, dst, sp, dp, check="guard", errors=err, backend=backend)
        kvwrite.gather(cache, loc, check="guard", errors=err, backend=backend, out=out)
        slots.copy_(kvwrite.slot_mapping(bt, b, pos, geo, check="guard", errors=err, backend=backend))

    try:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            step()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        dst.zero_()
        err.reset()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        graph.replay()
        torch.cuda.synchronize()
        good = (torch.equal(dst[0], src[3]) and torch.equal(dst[1], src[7]) and not dst[2].any()
                and torch.equal(out[0].view(torch.uint8), cache[0, 5].view(torch.uint8))
                and not out[3].view(torch.uint8).any() and slots.tolist() == [53, 35, -1, -1])
        e = err.error()
        emit(check="CUDA graph: copy_pages + gather + slot_mapping (guard)", backend=backend,
             ok=bool(good) and e is not None and e.count == 4, error=str(e), slots=slots.tolist())
    except Exception as exc:  # noqa: BLE001
        emit(check="CUDA graph: copy_pages + gather + slot_mapping (guard)", backend=backend, ok=False,
             error=f"{type(exc).__name__}: {exc}")


def bandwidth(backend: str) -> None:
    pages, num = 256, 1024
    host = torch.randn(num, 32, 8, 128).to(torch.bfloat16).pin_memory()
    dev = torch.zeros(num, 32, 8, 128, dtype=torch.bfloat16, device="cuda")
    sp = torch.randperm(num)[:pages]
    dp = torch.randperm(num)[:pages].cuda()
    nbytes = pages * 32 * 8 * 128 * 2
    flat_h = host.view(-1)[:nbytes // 2]
    flat_d = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    h2d = timing.cuda_median_us(lambda: kvwrite.copy_pages(host, dev, sp, dp, backend=backend))
    plain = timing.cuda_median_us(lambda: flat_d.copy_(flat_h, non_blocking=True))
    emit(check="host -> GPU copy_pages, 256 pages of 64 KiB", backend=backend, us=h2d, plain_copy_us=plain,
         pct_of_copy=round(100 * plain / h2d, 1))
    d2 = torch.zeros_like(dev)
    spd = sp.cuda()
    dd = timing.cuda_median_us(lambda: kvwrite.copy_pages(dev, d2, spd, dp, backend=backend))
    copy = timing.copy_fn(2 * nbytes, torch.device("cuda"))
    cu = timing.cuda_median_us(copy)
    guard_err = ErrorBuffer("cuda")
    dg = timing.cuda_median_us(lambda: kvwrite.copy_pages(dev, d2, spd, dp, check="guard", errors=guard_err,
                                                          backend=backend))
    emit(check="GPU -> GPU copy_pages, 256 pages of 64 KiB", backend=backend, us=dd, guard_us=dg,
         copy_us=cu, pct_of_copy=round(100 * cu / dd, 1), guard_over_off=round(dg / dd - 1, 3))


def main() -> int:
    p = argparse.ArgumentParser()
    p.parse_args()
    for backend in ("cuda", "triton", "torch"):
        why = kvwrite.backends("cuda").get(backend)
        if why is not None:
            emit(check="backend", backend=backend, ok=False, error=why)
            continue
        host_gpu(backend)
        if backend != "torch":
            graphs(backend)
        bandwidth(backend)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
