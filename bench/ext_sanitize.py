"""One store of every kvwrite_ext op on CUDA (backend="cuda"), in `off` mode (good locs) and
`guard` mode (bad locs mixed in), each compared with the torch reference. Run it under
`compute-sanitizer --tool memcheck --error-exitcode 1` (bench/gpu_check.sh): the kernels must
make no out-of-bounds or misaligned access, including for the locs that guard skips.

    python bench/ext_sanitize.py [--modes off,guard]
"""
from __future__ import annotations

import argparse
import sys

import torch

import kvwrite

DEV = "cuda"  # --device cpu runs the same checks with the cpu backend (no sanitizer)


def locs(n: int, capacity: int, bad: bool, gen: torch.Generator) -> torch.Tensor:
    loc = torch.randperm(capacity, generator=gen)[:n]
    loc[::7] = -1
    if bad:
        loc[1::5] = capacity + torch.arange(loc[1::5].numel()) * 13
        loc[2::11] = -5
    return loc.to(DEV)


def cases(gen: torch.Generator):
    """(name, fn(backend, caches, loc, check, errors), caches factory, capacity)."""
    n = 50
    k = (torch.randn(n, 8, 128, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    v = (torch.randn(n, 8, 128, generator=gen) * 3).to(torch.bfloat16).to(DEV)
    kv_c = (torch.randn(n, 512 + 64 + 64, generator=gen)).to(torch.bfloat16).to(DEV)  # strided views
    lat, rope = kv_c[:, :512], kv_c[:, 576:]
    scale = torch.tensor([0.05], device=DEV)

    def kv(cache_dtype, layout):
        shape = (8, 16, 8, 128) if layout == "NHD" else (8, 8, 16, 128)
        def make():
            return [torch.zeros(shape, dtype=torch.float32, device=DEV).to(cache_dtype) for _ in range(2)]
        def run(b, c, loc, check, errors):
            kw = dict(k_scale=scale, v_scale=scale) if cache_dtype.is_floating_point and cache_dtype.itemsize == 1 else {}
            kvwrite.store_kv(k, v, c[0], c[1], loc, layout=layout, check=check, errors=errors, backend=b, **kw)
        return run, make

    for dt in (torch.bfloat16, torch.float8_e4m3fn):
        for layout in ("NHD", "HND"):
            run, make = kv(dt, layout)
            yield f"store_kv {str(dt)[6:]} {layout}", run, make, 128

    for fmt, dt, width in (("auto", torch.bfloat16, 576), ("fp8_e4m3", torch.float8_e4m3fn, 576),
                           ("fp8_ds_mla", torch.uint8, 656)):
        def run(b, c, loc, check, errors, fmt=fmt):
            kvwrite.store_mla(lat, rope, c[0], loc, kv_cache_dtype=fmt, scale=scale if fmt.startswith("fp8_e") else None,
                              check=check, errors=errors, backend=b)
        yield f"store_mla {fmt}", run, (lambda dt=dt, width=width: [torch.zeros(8, 16, width, device=DEV).to(dt)]), 128

    def run_mla_fp4(b, c, loc, check, errors):
        kvwrite.store_mla(lat, rope, c[0], loc, kv_cache_dtype="nvfp4", scale_cache=c[1], check=check, errors=errors,
                          backend=b)
    yield "store_mla nvfp4", run_mla_fp4, lambda: [torch.zeros(8, 16, 288, dtype=torch.uint8, device=DEV),
                                                   torch.zeros(8, 16, 36, device=DEV).to(torch.float8_e4m3fn)], 128

    ik = torch.randn(n, 128, generator=gen).to(DEV)
    def run_ik(b, c, loc, check, errors):
        kvwrite.store_indexer_k(ik, c[0], loc, scale_fmt="ue8m0", check=check, errors=errors, backend=b)
    yield "store_indexer_k", run_ik, lambda: [torch.zeros(8, 64 * 132, dtype=torch.uint8, device=DEV)], 512

    if hasattr(kvwrite, "store_kv_nvfp4"):
        def run_fp4(b, c, loc, check, errors):
            kvwrite.store_kv_nvfp4(k, v, c[0], c[1], c[2], c[3], loc, check=check, errors=errors, backend=b)
        def make_fp4():
            return [torch.zeros(8, 16, 8, 64, dtype=torch.uint8, device=DEV) for _ in range(2)] + \
                   [torch.zeros(8, 16, 8, 8, device=DEV).to(torch.float8_e4m3fn) for _ in range(2)]
        yield "store_kv_nvfp4", run_fp4, make_fp4, 128


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="off,guard")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    args = ap.parse_args()
    global DEV
    DEV = args.device
    gen = torch.Generator().manual_seed(0)
    failures = 0
    for name, run, make, capacity in cases(gen):
        for mode in args.modes.split(","):
            loc = locs(50, capacity, bad=mode == "guard", gen=gen)
            got, want = make(), make()
            errs, ref_errs = kvwrite.ErrorBuffer(DEV), kvwrite.ErrorBuffer(DEV)
            run(DEV, got, loc, mode, errs)
            run("torch", want, loc, mode, ref_errs)
            if DEV == "cuda":
                torch.cuda.synchronize()
            same = all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(got, want))
            same = same and torch.equal(errs.tensor, ref_errs.tensor)
            print(f"{name:28s} {mode:6s} {'ok' if same else 'MISMATCH'}", flush=True)
            failures += not same
    print(f"{failures} mismatches")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
