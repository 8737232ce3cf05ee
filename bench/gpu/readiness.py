"""GPU readiness: what no CPU test can see, checked on a CUDA GPU in one run (a few minutes).

  graph     every store op x kernel backend x check off/guard, captured in a CUDA graph and
            replayed on new inputs: bytes equal the torch reference's, the guard record too
  records   two calls bad at the same token leave one consistent record (the first call's);
            a guarded store on a side stream read with raise_if_any(stream=) is complete
  capture   the default guard record first needed inside a capture is a clear error; a record
            made before the capture accumulates over replays (its zero-fill is not replayed)
  nan       assert builds (debug=True: int32 overflow checks on) take positive NaN payloads
            >= 0x7FFF8000 in the bf16 rope paths (fp8_ds_mla, DeepSeek V4) without a device
            assert (subprocess: an assert would kill the CUDA context)
  devices   tensors on cuda:1 while cuda:0 is current run on cuda:1 (two GPUs; else skipped)
  ptx       the AOT arch flags embed PTX of the newest arch: a store_kv unit fatbin of sm_80 SASS +
            compute_80 PTX loads on this (newer) GPU through the driver's PTX JIT, while sm_80
            SASS alone does not ("no kernel image")

Prints one JSON line per check, then a summary; exit status 1 if any check failed.
`python bench/gpu/readiness.py [--only graph,records,...] [--out FILE]`
"""
from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

import kvwrite
from kvwrite.errors import ErrorBuffer, IncompleteRecord, OutOfBoundsWrite

DEV = torch.device("cuda")
RESULTS: list[dict] = []


def report(name: str, status: str, **detail) -> None:
    row = dict(check=name, status=status, **detail)
    RESULTS.append(row)
    print(json.dumps(row), flush=True)


def kernel_backends(device: torch.device = DEV) -> list[str]:
    return [b for b, why in kvwrite.backends(device).items() if why is None and b != "torch"]


# ------------------------------------------------------------------------------------ graph
class Case:
    """One op call on static tensors: `inputs` are refilled in place before a replay, `pools`
    written by the call, `call(backend, check, errors)` the store."""

    def __init__(self, name, n, capacity, inputs, pools, call):
        self.name, self.n, self.capacity = name, n, capacity
        self.inputs, self.pools, self.call = inputs, pools, call

    def refill(self, seed: int, bad: bool) -> None:
        gen = torch.Generator(device=DEV).manual_seed(seed)
        for t in self.inputs.values():
            if t.dtype.is_floating_point:
                t.copy_(torch.randn(t.shape, generator=gen, device=DEV) * 3)
        loc = torch.randperm(self.capacity, generator=gen, device=DEV)[: self.n]
        if bad:
            loc[1] = self.capacity + 5          # guard: skipped and recorded
            loc[3] = -1                         # padding
        self.loc.copy_(loc)
        for p in self.pools.values():
            p.zero_()


def cases() -> list[Case]:
    from kvwrite.ops.dsv4 import indexer_row_bytes, kv_page_bytes
    from kvwrite.ops.mla import ds_mla_row_bytes

    out = []
    n, pages, pps = 8, 4, 4
    cap = pages * pps

    def add(name, inputs, pools, call, capacity=cap):
        c = Case(name, n, capacity, inputs, pools, None)
        c.loc = torch.zeros(n, dtype=torch.int64, device=DEV)
        c.call = lambda b, chk, err, c=c: call(c, b, chk, err)
        out.append(c)

    def z(*shape, dtype=torch.float32):
        return torch.zeros(*shape, dtype=dtype, device=DEV)

    for cache_dtype in (torch.bfloat16, torch.float8_e4m3fn):
        quant = cache_dtype != torch.bfloat16
        scale = torch.tensor([0.5], device=DEV) if quant else None
        add(f"store_kv[{str(cache_dtype)[6:]}]",
            dict(k=z(n, 2, 64, dtype=torch.bfloat16), v=z(n, 2, 64, dtype=torch.bfloat16)),
            dict(kc=z(pages, pps, 2, 64, dtype=cache_dtype), vc=z(pages, pps, 2, 64, dtype=cache_dtype)),
            lambda c, b, chk, err, scale=scale: kvwrite.store_kv(
                c.inputs["k"], c.inputs["v"], c.pools["kc"], c.pools["vc"], c.loc, k_scale=scale,
                v_scale=scale, check=chk, errors=err, backend=b))
    add("store_mla[auto]", dict(c=z(n, 512, dtype=torch.bfloat16), pe=z(n, 64, dtype=torch.bfloat16)),
        dict(kv=z(pages, pps, 576, dtype=torch.bfloat16)),
        lambda c, b, chk, err: kvwrite.store_mla(c.inputs["c"], c.inputs["pe"], c.pools["kv"], c.loc,
                                                 check=chk, errors=err, backend=b))
    add("store_mla[fp8_ds_mla]", dict(c=z(n, 512), pe=z(n, 64)),
        dict(kv=z(pages, pps, ds_mla_row_bytes(512, 64), dtype=torch.uint8)),
        lambda c, b, chk, err: kvwrite.store_mla(c.inputs["c"], c.inputs["pe"], c.pools["kv"], c.loc,
                                                 kv_cache_dtype="fp8_ds_mla", check=chk, errors=err,
                                                 backend=b))
    add("store_mla[nvfp4]", dict(c=z(n, 512), pe=z(n, 64)),
        dict(kv=z(pages, pps, 288, dtype=torch.uint8), s=z(pages, pps, 36, dtype=torch.float8_e4m3fn)),
        lambda c, b, chk, err: kvwrite.store_mla(c.inputs["c"], c.inputs["pe"], c.pools["kv"], c.loc,
                                                 kv_cache_dtype="nvfp4", scale_cache=c.pools["s"],
                                                 check=chk, errors=err, backend=b))
    add("store_indexer_k", dict(k=z(n, 128, dtype=torch.bfloat16)),
        dict(c=z(pages, pps * 132, dtype=torch.uint8)),
        lambda c, b, chk, err: kvwrite.store_indexer_k(c.inputs["k"], c.pools["c"], c.loc, check=chk,
                                                       errors=err, backend=b))
    add("store_kv_nvfp4", dict(k=z(n, 2, 64), v=z(n, 2, 64)),
        dict(kc=z(pages, pps, 2, 32, dtype=torch.uint8), vc=z(pages, pps, 2, 32, dtype=torch.uint8),
             ks=z(pages, pps, 2, 4, dtype=torch.float8_e4m3fn), vs=z(pages, pps, 2, 4, dtype=torch.float8_e4m3fn)),
        lambda c, b, chk, err: kvwrite.store_kv_nvfp4(
            c.inputs["k"], c.inputs["v"], c.pools["kc"], c.pools["vc"], c.pools["ks"], c.pools["vs"],
            c.loc, check=chk, errors=err, backend=b))
    add("store_dsv4_kv", dict(kv=z(n, 512, dtype=torch.bfloat16)),
        dict(c=z(pages, kv_page_bytes(pps), dtype=torch.uint8)),
        lambda c, b, chk, err: kvwrite.store_dsv4_kv(c.inputs["kv"], c.pools["c"], c.loc, page_size=pps,
                                                     check=chk, errors=err, backend=b))
    for fmt, d in (("fp8", 128), ("mxfp4", 64)):
        add(f"store_dsv4_indexer_k[{fmt}]", dict(k=z(n, d, dtype=torch.bfloat16)),
            dict(c=z(pages, pps * indexer_row_bytes(d, fmt), dtype=torch.uint8)),
            lambda c, b, chk, err, fmt=fmt: kvwrite.store_dsv4_indexer_k(
                c.inputs["k"], c.pools["c"], c.loc, page_size=pps, fmt=fmt, check=chk, errors=err, backend=b))
    add("store_rows", dict(src=z(n, 48)), dict(pool=z(cap, 48)),
        lambda c, b, chk, err: kvwrite.store_rows(c.inputs["src"], c.pools["pool"], c.loc, check=chk,
                                                  errors=err, backend=b))
    return out


def record_of(err: ErrorBuffer):
    e = err.error()
    return None if e is None else (type(e).__name__, e.count, e.token_index, e.loc, e.limit)


def check_graph() -> None:
    for case in cases():
        for backend in kernel_backends():
            for chk in ("off", "guard"):
                name = f"graph:{case.name}:{backend}:{chk}"
                try:
                    err = ErrorBuffer(DEV) if chk == "guard" else None
                    case.refill(0, bad=chk == "guard")
                    case.call(backend, chk, err)             # warm-up: compiles, loads
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        case.call(backend, chk, err)
                    if err is not None:
                        err.reset()
                    got, want_pools, records = [], [], []
                    for seed in (1, 2):                       # replays on new inputs and locs
                        case.refill(seed, bad=chk == "guard")
                        g.replay()
                        torch.cuda.synchronize()
                        got.append({k: p.clone() for k, p in case.pools.items()})
                        ref_err = ErrorBuffer(DEV) if chk == "guard" else None
                        for p in case.pools.values():
                            p.zero_()
                        case.call("torch", chk, ref_err)
                        want_pools.append({k: p.clone() for k, p in case.pools.items()})
                        if err is not None:
                            records.append((record_of(err), record_of(ref_err)))
                            err.reset()
                    same = all(torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8))
                               for a, b in zip(got, want_pools) for k in a)
                    rec_ok = all(a == b and a is not None for a, b in records) if chk == "guard" else True
                    report(name, "ok" if same and rec_ok else "FAIL", bytes_equal=same,
                           records=[list(r) for r in records])
                except Exception as exc:
                    report(name, "FAIL", error=f"{type(exc).__name__}: {exc}"[:600],
                           trace=traceback.format_exc()[-1500:])


# ---------------------------------------------------------------------------------- records
def _store(capacity, loc, err, backend, stream=None, n_rep=1):
    k = torch.randn(len(loc) * n_rep, 1, 16, device=DEV)
    kc = torch.zeros(capacity, 1, 1, 16, device=DEV)
    loc_t = torch.tensor(loc, device=DEV).repeat(n_rep)
    kvwrite.store_kv(k, k, kc, kc.clone(), loc_t, check="guard", errors=err, backend=backend)


def check_records() -> None:
    for backend in kernel_backends():
        try:   # call A: loc 20 into capacity 8; call B: loc 2**32 + 7 into capacity 256; token 0
            err = ErrorBuffer(DEV)
            _store(8, [20], err, backend)
            _store(256, [2 ** 32 + 7], err, backend)
            e = err.error()
            ok = (e.token_index, e.loc, e.limit, e.count) == (0, 20, 8, 2)
            s = err.tensor.tolist()
            report(f"records:two_calls:{backend}", "ok" if ok and s[14] == 2 and s[15] == 0 else "FAIL",
                   got=[e.token_index, e.loc, e.limit, e.count], epoch=s[14], done=s[15])
        except Exception as exc:
            report(f"records:two_calls:{backend}", "FAIL", error=f"{type(exc).__name__}: {exc}"[:600])
        try:   # a large guarded store on a side stream: the ordered read is complete and lowest
            n = 1 << 20
            err = ErrorBuffer(DEV)
            side = torch.cuda.Stream()
            k = torch.randn(n, 8, 128, device=DEV, dtype=torch.bfloat16)
            kc = torch.zeros(n // 16, 16, 8, 128, device=DEV, dtype=torch.bfloat16)
            loc = torch.arange(n, device=DEV)
            loc[n // 2:] += n              # the upper half is out of range: lowest bad token n/2
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                kvwrite.store_kv(k, k, kc, kc.clone(), loc, check="guard", errors=err, backend=backend)
            early = err.tensor.tolist()    # unordered: may be clean, incomplete or complete
            from kvwrite.errors import decode
            try:
                seen = decode(early)
                seen = "clean" if seen is None else type(seen).__name__
            except Exception as exc:       # an IndexError here was the old reader's failure
                seen = f"reader raised {type(exc).__name__}"
            try:
                err.raise_if_any(stream=side)
                report(f"records:side_stream:{backend}", "FAIL", error="no error raised")
            except IncompleteRecord as exc:
                report(f"records:side_stream:{backend}", "FAIL", error=str(exc)[:300])
            except OutOfBoundsWrite as exc:
                ok = exc.token_index == n // 2 and exc.count == n // 2 and not seen.startswith("reader")
                report(f"records:side_stream:{backend}", "ok" if ok else "FAIL", token=exc.token_index,
                       count=exc.count, unordered_read=seen)
        except Exception as exc:
            report(f"records:side_stream:{backend}", "FAIL", error=f"{type(exc).__name__}: {exc}"[:600])


# ---------------------------------------------------------------------------------- capture
_CAPTURE_CHILD = r"""
import torch, kvwrite
from kvwrite.errors import ErrorBuffer
backend = BACKEND
k = torch.randn(4, 1, 16, device="cuda")
kc = torch.zeros(8, 1, 1, 16, device="cuda")
loc = torch.tensor([1, 9, 2, 3], device="cuda")
kvwrite.store_kv(k, k, kc, kc.clone(), loc, check="off", backend=backend)   # warm-up, no record
torch.cuda.synchronize()
g = torch.cuda.CUDAGraph()
msg = "no error"
try:
    with torch.cuda.graph(g):
        kvwrite.store_kv(k, k, kc, kc.clone(), loc, check="guard", backend=backend)
except RuntimeError as exc:
    msg = str(exc)
assert "before the capture" in msg, msg
err = ErrorBuffer("cuda")            # made before the capture: accumulates over replays
kvwrite.store_kv(k, k, kc, kc.clone(), loc, check="guard", errors=err, backend=backend)
err.reset()
torch.cuda.synchronize()
g2 = torch.cuda.CUDAGraph()
with torch.cuda.graph(g2):
    kvwrite.store_kv(k, k, kc, kc.clone(), loc, check="guard", errors=err, backend=backend)
for _ in range(3):
    g2.replay()
torch.cuda.synchronize()
e = err.error()
assert e is not None and e.count == 3 and e.token_index == 1 and e.loc == 9, e
print("OK")
"""


def _child(code: str, timeout: int = 240) -> tuple[bool, str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=timeout)
    return r.returncode == 0 and "OK" in r.stdout, (r.stdout + r.stderr)[-1500:]


def check_capture() -> None:
    for backend in kernel_backends():
        ok, log = _child(_CAPTURE_CHILD.replace("BACKEND", repr(backend)))
        report(f"capture:default_record:{backend}", "ok" if ok else "FAIL", **({} if ok else {"log": log}))


# -------------------------------------------------------------------------------------- nan
_NAN_CHILD = r"""
import torch, kvwrite
from kvwrite.ops.dsv4 import kv_page_bytes
from kvwrite.ops.mla import ds_mla_row_bytes
backend = BACKEND
pats = torch.tensor([0x7FFFFFFF, 0x7FFF8000, 0x7FFFC000, 0x7FC00000, -1, -32768, 0x3F808000, 0x7F7FFFFF],
                    dtype=torch.int64)
pats = torch.where(pats >= 2 ** 31, pats - 2 ** 32, pats).to(torch.int32).view(torch.float32)
for dtype in (torch.float32, torch.float16):
    kv_c = torch.randn(4, 512).to(dtype)
    k_pe = pats.repeat(32)[:4 * 64].reshape(4, 64).to(dtype)
    loc = torch.tensor([5, 0, 7, 2], device="cuda")
    out = []
    for b in (backend, "torch"):
        c = torch.zeros(2, 4, ds_mla_row_bytes(512, 64), dtype=torch.uint8, device="cuda")
        kvwrite.store_mla(kv_c.cuda(), k_pe.cuda(), c, loc, kv_cache_dtype="fp8_ds_mla", check="assert", backend=b)
        out.append(c.cpu())
    assert torch.equal(out[0], out[1]), ("ds_mla", dtype)
kv = torch.randn(3, 512) * 3
kv[:, 448:] = pats.repeat(24)[:3 * 64].reshape(3, 64)
out = []
for b in (backend, "torch"):
    c = torch.zeros(3, kv_page_bytes(4), dtype=torch.uint8, device="cuda")
    kvwrite.store_dsv4_kv(kv.cuda(), c, torch.tensor([9, -1, 2], device="cuda"), page_size=4, check="assert", backend=b)
    out.append(c.cpu())
assert torch.equal(out[0], out[1]), "dsv4"
torch.cuda.synchronize()
print("OK")
"""


def check_nan() -> None:
    for backend in kernel_backends():
        ok, log = _child(_NAN_CHILD.replace("BACKEND", repr(backend)), timeout=400)
        report(f"nan:assert_build:{backend}", "ok" if ok else "FAIL", **({} if ok else {"log": log}))


# ---------------------------------------------------------------------------------- devices
def check_devices() -> None:
    if torch.cuda.device_count() < 2:
        report("devices:cuda1_while_cuda0_current", "skip", reason=f"{torch.cuda.device_count()} GPU(s)")
        return
    d1 = torch.device("cuda", 1)
    for backend in kernel_backends(d1):
        try:
            torch.cuda.set_device(0)
            k = torch.randn(8, 2, 64, device=d1, dtype=torch.bfloat16)
            loc = torch.randperm(16, device=d1)[:8]
            out = []
            for b in (backend, "torch"):
                kc = torch.zeros(4, 4, 2, 64, device=d1, dtype=torch.bfloat16)
                kvwrite.store_kv(k, k, kc, kc.clone(), loc, check="guard", backend=b)
                out.append(kc)
            torch.cuda.synchronize(d1)
            same = torch.equal(out[0], out[1])
            report(f"devices:cuda1_while_cuda0_current:{backend}", "ok" if same else "FAIL",
                   current=torch.cuda.current_device())
        except Exception as exc:
            report(f"devices:cuda1_while_cuda0_current:{backend}", "FAIL", error=f"{type(exc).__name__}: {exc}"[:600])


# -------------------------------------------------------------------------------------- ptx
def _nvcc_fatbin(src: Path, gencode: list[str], out: Path) -> tuple[bool, str]:
    from kvwrite import _ext

    nvcc = os.path.join(_ext.find_cuda_home() or "/usr/local/cuda", "bin", "nvcc")
    cmd = [nvcc, "-fatbin", "-std=c++20", "-O3", "--expt-relaxed-constexpr", f"-I{_ext.csrc_dir()}",
           f"-I{src.parent}", *gencode, str(src), "-o", str(out)]   # src.parent: its kvw_ops.h
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return r.returncode == 0, r.stderr[-800:]


def _cu_load(data: bytes) -> int:
    """cuModuleLoadData on the current context: 0 = loaded (CUresult otherwise)."""
    cu = ctypes.CDLL("libcuda.so.1")
    torch.cuda.init()
    torch.zeros(1, device=DEV)      # the primary context is current on this thread
    mod = ctypes.c_void_p()
    rc = cu.cuModuleLoadData(ctypes.byref(mod), ctypes.c_char_p(data))
    if rc == 0:
        cu.cuModuleUnload(mod)
    return rc


def check_ptx() -> None:
    from torch.utils import cpp_extension

    from kvwrite import _ext

    try:
        os.environ["TORCH_CUDA_ARCH_LIST"] = _ext.with_ptx("8.0")
        aot = [f for f in cpp_extension._get_cuda_arch_flags() if f.startswith("-gencode")]
        os.environ["TORCH_CUDA_ARCH_LIST"] = "8.0"
        sass_only = [f for f in cpp_extension._get_cuda_arch_flags() if f.startswith("-gencode")]
        cap = torch.cuda.get_device_capability()
        with tempfile.TemporaryDirectory() as tmp:
            units = _ext.launch_units(_ext.csrc_dir(), Path(tmp) / "units")
            src = next(u for u in units if u.name == _ext.unit_name("StoreKVParams"))
            results = {}
            for name, flags in (("sass+ptx", aot), ("sass_only", sass_only)):
                fb = Path(tmp) / f"{name}.fatbin"
                ok, log = _nvcc_fatbin(src, flags, fb)
                if not ok:
                    report("ptx:newer_gpu_loads_ptx", "FAIL", error=f"nvcc {name}: {log}")
                    return
                results[name] = _cu_load(fb.read_bytes())
        ok = cap[0] > 8 and results["sass+ptx"] == 0 and results["sass_only"] != 0
        report("ptx:newer_gpu_loads_ptx", "ok" if ok else ("skip" if cap[0] <= 8 else "FAIL"),
               gpu=f"sm_{cap[0]}{cap[1]}", aot_flags=aot, cuModuleLoadData=results,
               note="sm_80 SASS + compute_80 PTX on a newer GPU: loads only through the PTX")
    except Exception as exc:
        report("ptx:newer_gpu_loads_ptx", "FAIL", error=f"{type(exc).__name__}: {exc}"[:600])
    finally:
        os.environ.pop("TORCH_CUDA_ARCH_LIST", None)


CHECKS = dict(records=check_records, capture=check_capture, nan=check_nan, devices=check_devices,
              ptx=check_ptx, graph=check_graph)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(CHECKS))
    p.add_argument("--out", default=None, help="write every result as JSON here")
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("readiness: no CUDA device", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    for name in args.only.split(","):
        t = time.perf_counter()
        CHECKS[name]()
        print(f"# {name}: {time.perf_counter() - t:.1f} s", flush=True)
    failed = [r["check"] for r in RESULTS if r["status"] == "FAIL"]
    summary = (f"readiness: {sum(r['status'] == 'ok' for r in RESULTS)} ok, "
               f"{sum(r['status'] == 'skip' for r in RESULTS)} skipped, {len(failed)} failed "
               f"in {time.perf_counter() - t0:.0f} s" + (f": {', '.join(failed)}" if failed else ""))
    print(summary)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(summary=summary, results=RESULTS), indent=1))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
