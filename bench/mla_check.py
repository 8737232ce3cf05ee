"""store_mla / store_indexer_k on one device at DeepSeek sizes (kv_lora_rank 512, rope 64,
indexer D 128): every kernel backend byte-for-byte against the torch reference, the guard
record of a bad loc, and the time per call.

    python bench/mla_check.py [--device cuda] [--tokens 1 64 4096] [--out mla.json]

Prints one JSON line per case and exits 1 if any backend differs from the reference. On CPU it
runs the Triton interpreter (set TRITON_INTERPRET=1; use small --tokens).
"""
from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import kvwrite
from kvwrite.ops.indexer_k import row_bytes
from kvwrite.ops.mla import FORMATS

LORA, ROPE, INDEX_D, PPS = 512, 64, 128, 64
MLA_CASES = (("auto", torch.bfloat16), ("fp8_e4m3", torch.bfloat16), ("fp8_ds_mla", torch.bfloat16),
             ("fp8_ds_mla", torch.float32))
INDEXER_CASES = ((None, torch.bfloat16), ("ue8m0", torch.bfloat16))


def timed(fn, device: torch.device, iters: int) -> float:
    """Microseconds per call (CUDA events on a GPU, wall clock elsewhere)."""
    fn()
    if device.type != "cuda":
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - start) / iters * 1e6
    torch.cuda.synchronize()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return begin.elapsed_time(end) / iters * 1e3


def locs(n: int, capacity: int, gen: torch.Generator, device) -> torch.Tensor:
    loc = torch.randperm(capacity, generator=gen)[:n]
    loc[torch.rand(n, generator=gen) < 0.05] = -1
    return loc.to(device)


def mla_case(fmt: str, dtype: torch.dtype, n: int, device, backends, iters: int) -> dict:
    gen = torch.Generator().manual_seed(n)
    # DeepSeek's fused_qkv_a output: [q_lora 1536 | kv_lora 512 | rope 64]; kv_c, k_pe are slices
    proj = (torch.randn(n, 1536 + LORA + ROPE, generator=gen) * 3).to(dtype).to(device)
    kv_c, k_pe = proj[:, 1536:1536 + LORA], proj[:, 1536 + LORA:]
    f = FORMATS[fmt]
    pages = 2 * n // PPS + 2
    shape = (pages, PPS, f.row_width(LORA, ROPE))
    elem = torch.empty((), dtype=f.cache_dtype(dtype)).element_size()
    start = torch.randint(0, 256, (pages * PPS * shape[2] * elem,), generator=gen, dtype=torch.uint8).to(device)
    loc = locs(n, pages * PPS, gen, device)
    scale = torch.tensor(0.05, device=device) if f.takes_scale else None
    view = lambda raw: raw.view(f.cache_dtype(dtype)).view(shape)  # noqa: E731
    row = dict(op="store_mla", kv_cache_dtype=fmt, dtype=str(dtype)[6:], tokens=n)
    ref = start.clone()
    kvwrite.store_mla(kv_c, k_pe, view(ref), loc, kv_cache_dtype=fmt, scale=scale, backend="torch")
    for backend in backends:
        raw = start.clone()
        cache = view(raw)
        errors = kvwrite.ErrorBuffer(device)
        kvwrite.store_mla(kv_c, k_pe, cache, loc, kv_cache_dtype=fmt, scale=scale, check="guard",
                          errors=errors, backend=backend)
        row[f"{backend}_exact"] = bool(torch.equal(raw, ref)) and errors.error() is None
        bad = loc.clone()
        if n:
            bad[n // 2] = pages * PPS + 7
        kvwrite.store_mla(kv_c, k_pe, cache, bad, kv_cache_dtype=fmt, scale=scale, check="guard",
                          errors=errors, backend=backend)
        err = errors.error()
        row[f"{backend}_guard"] = (n == 0 and err is None) or (err is not None and err.token_index == n // 2)
        for check in ("off", "guard"):
            row[f"{backend}_{check}_us"] = round(timed(lambda: kvwrite.store_mla(
                kv_c, k_pe, cache, loc, kv_cache_dtype=fmt, scale=scale, check=check, errors=errors,
                backend=backend), device, iters), 2)
    row["row_bytes"] = shape[2] * elem
    return row


def indexer_case(scale_fmt, dtype, n: int, device, backends, iters: int) -> dict:
    gen = torch.Generator().manual_seed(n + 1)
    k = (torch.randn(n, INDEX_D, generator=gen) * 2).to(dtype).to(device)
    pages = 2 * n // PPS + 2
    ref = torch.randint(0, 256, (pages, PPS * row_bytes(INDEX_D, 128)), generator=gen, dtype=torch.uint8).to(device)
    start = ref.clone()
    loc = locs(n, pages * PPS, gen, device)
    row = dict(op="store_indexer_k", scale_fmt=scale_fmt, dtype=str(dtype)[6:], tokens=n)
    kvwrite.store_indexer_k(k, ref, loc, scale_fmt=scale_fmt, backend="torch")
    for backend in backends:
        cache = start.clone()
        errors = kvwrite.ErrorBuffer(device)
        kvwrite.store_indexer_k(k, cache, loc, scale_fmt=scale_fmt, check="guard", errors=errors, backend=backend)
        row[f"{backend}_exact"] = bool(torch.equal(cache, ref)) and errors.error() is None
        for check in ("off", "guard"):
            row[f"{backend}_{check}_us"] = round(timed(lambda: kvwrite.store_indexer_k(
                k, cache, loc, scale_fmt=scale_fmt, check=check, errors=errors, backend=backend),
                device, iters), 2)
    return row


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 64, 4096])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--out")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    backends = [b for b, why in kvwrite.backends(device).items() if why is None and b != "torch"]
    rows, failed = [], 0
    for n in args.tokens:
        for fmt, dtype in MLA_CASES:
            rows.append(mla_case(fmt, dtype, n, device, backends, args.iters))
        for scale_fmt, dtype in INDEXER_CASES:
            rows.append(indexer_case(scale_fmt, dtype, n, device, backends, args.iters))
    for row in rows:
        ok = all(v for key, v in row.items() if key.endswith(("_exact", "_guard")))
        failed += not ok
        print(json.dumps(dict(row, ok=ok)), flush=True)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump(dict(device=str(device), backends=backends, rows=rows), fh, indent=1)
    print(f"{len(rows) - failed}/{len(rows)} cases exact on {device} with backends {backends}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
