"""No op's torch-level host code synchronises with the GPU.

Every public store op (and the engine adapters) runs on fake CUDA tensors (FakeTensorMode: no
GPU, no data) with backend "triton" and "cuda" under a detector that records what would block the
host or break CUDA-graph capture: reading a device value (`.item()`, `bool(t)`, `int(t)`,
`.tolist()`: aten._local_scalar_dense), ops whose output size depends on data (nonzero, masked
select, unique, ...), and any copy between the CPU and the device (a per-call host-to-device
copy, or a device-to-host read). Kernel launches are replaced by recorders that also check every
tensor handed to the kernel is on the device. The scenarios run in a subprocess (fake CUDA
tensors must not reach the process-wide default buffers and caches of the real suite); a
self-test first shows the detector catches each kind of sync.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent

# ---- the detector (runs in the subprocess) ---------------------------------------------------

SYNC_OPS = ("_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique", "_unique2",
            "unique_consecutive", "unique_dim", "is_nonzero", "equal", "allclose", "item",
            "repeat_interleave", "masked_scatter", "bincount", "histc")
COPY_OPS = ("_to_copy", "copy_", "_copy_from", "_copy_from_and_resize", "lift_fresh_copy")


def _detector_classes():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    class Sync(Exception):
        pass

    class SyncDetector(TorchDispatchMode):
        """Records (and refuses) every host-syncing aten call and every CPU <-> device copy."""

        def __init__(self):
            super().__init__()
            self.found: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            name = func.overloadpacket.__name__
            if name in SYNC_OPS and not (name == "repeat_interleave" and kwargs.get("output_size") is not None):
                self.found.append(f"aten.{name}")
                raise Sync(f"aten.{name}")
            if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
                indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
                if any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
                    self.found.append(f"aten.{name} with a boolean mask")
                    raise Sync(f"aten.{name}")
            out = func(*args, **kwargs)
            if name in COPY_OPS:
                devs = set()
                for t in list(args) + list(kwargs.values()) + [out]:
                    if isinstance(t, torch.Tensor):
                        devs.add(t.device.type)
                if "device" in kwargs and kwargs["device"] is not None:
                    devs.add(torch.device(kwargs["device"]).type)
                if "cpu" in devs and len(devs) > 1:
                    self.found.append(f"aten.{name} between {sorted(devs)}")
            return out

    return Sync, SyncDetector


def _patch_launches(record: list[str]):
    """Replace Triton launches and the extension's kernel calls with recorders that check the
    tensors they would hand to the kernel."""
    import torch
    import triton.runtime.jit as jit

    from kvwrite import _ext
    from kvwrite import backend as backends

    def check_tensors(where, values):
        for v in values:
            if isinstance(v, torch.Tensor) and v.device.type != "cuda":
                record.append(f"{where}: a {v.device.type} tensor {list(v.shape)} handed to a GPU kernel")

    def jit_run(self, *args, grid=None, warmup=False, **kwargs):
        check_tensors(f"triton {self.__name__}", list(args) + list(kwargs.values()))
        record.append(f"launch triton {self.__name__}")

    jit.JITFunction.run = jit_run
    try:
        from triton.runtime.interpreter import InterpretedFunction
        InterpretedFunction.run = jit_run
    except ImportError:
        pass

    def ext_run(a, name, *args, tail=True):
        extra = [a.check.errors]
        if tail:
            locs = a.locs
            t = getattr(locs, "table", None)
            extra += [locs.loc, locs.loc_map] + ([] if t is None else [t.batch_indices, t.kv_indices, t.kv_indptr])
        check_tensors(f"cuda {name}", list(args) + extra)
        record.append(f"launch cuda {name}")

    _ext._run = ext_run

    def ext_claim(locs, geometry, chk):   # the duplicate-row pre-pass's C++ op (kvwrite.ops.claims)
        t = getattr(locs, "table", None)
        check_tensors("cuda claim_rows", [locs.loc, locs.loc_map, chk.errors] +
                      ([] if t is None else [t.batch_indices, t.kv_indices, t.kv_indptr]))
        record.append("launch cuda claim_rows")
        return locs

    _ext.claim_rows = ext_claim
    ext_reason = _ext.unavailable_reason("cpu")   # loaded: the raw kernels' schemas name their arguments
    _ext.LOADED = False   # the Python host path (the C++ op's host code reads metadata only)
    real = backends.unavailable_reason

    def unavailable(backend, device):
        if device.type == "cuda" and (backend in ("triton", "torch") or (backend == "cuda" and ext_reason is None)):
            return None
        return real(backend, device)

    backends.unavailable_reason = unavailable
    torch.cuda.current_device = lambda: 0


def _scenarios(dev):
    """name -> (callable(backend)) over fake CUDA tensors created here."""
    import torch

    import kvwrite
    from kvwrite.compat import flashinfer as fi, sglang as sg, vllm as vl
    from kvwrite.ops import dsv4
    from kvwrite.ops.indexer_k import row_bytes

    e4m3 = torch.float8_e4m3fn
    n, h, d, pps, pages = 4, 2, 16, 4, 3

    def t(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, dtype=dtype, device=dev)

    def idx(*vals, dtype=torch.int64):
        return torch.zeros(len(vals), dtype=dtype, device=dev)   # data is never read

    k, v = t(n, h, d), t(n, h, d)
    loc = idx(0, 1, 2, 3)
    errs = kvwrite.ErrorBuffer(dev)
    table = kvwrite.PageTable(idx(0, 0, 1, 1, dtype=torch.int32), idx(0, 1, 0, 1, dtype=torch.int32),
                              idx(0, 1, dtype=torch.int32), idx(0, 1, 2, dtype=torch.int32))
    cache = lambda dt, layout="NHD": t(*((pages, pps, h, d) if layout == "NHD" else (pages, h, pps, d)),  # noqa: E731
                                       dtype=dt)
    s1 = torch.ones((), device=dev)
    sh = torch.ones(h, device=dev)
    tok_sc, head_sc = t(pages, pps, dtype=torch.float32), t(pages, pps, h, dtype=torch.float32)
    out = {}

    def kv(name, cdt, **kw):
        lay = kw.get("layout", "NHD")
        l0 = kw.pop("loc", loc)
        out[f"store_kv {name}"] = lambda be: kvwrite.store_kv(k, v, cache(cdt, lay), cache(cdt, lay), l0,
                                                             backend=be, **kw)

    kv("bf16", torch.bfloat16)
    kv("bf16 HND guard", torch.bfloat16, layout="HND", check="guard", errors=errs)
    kv("bf16 guard default buffer", torch.bfloat16, check="guard")
    kv("bf16 assert", torch.bfloat16, check="assert")
    kv("bf16 loc_map dcp", torch.bfloat16, loc_map=idx(0, 1, 2, 3, 4), dcp_rank=1, dcp_size=2)
    kv("bf16 pagetable", torch.bfloat16, loc=table)
    kv("fp8 static", e4m3, k_scale=s1, v_scale=sh)
    kv("int8 static", torch.int8, k_scale=sh, v_scale=s1)
    kv("int8 per-token", torch.int8, k_scale_cache=tok_sc, v_scale_cache=tok_sc.clone())
    kv("fp8 per-token-head guard", e4m3, k_scale_cache=head_sc, v_scale_cache=head_sc.clone(), check="guard",
       errors=errs)
    kv("int8 per-token-head vllm rule", torch.int8, k_scale_cache=head_sc, v_scale_cache=head_sc.clone(),
       quant_rule="vllm")
    kv("int8 per-token pagetable", torch.int8, k_scale_cache=tok_sc, v_scale_cache=tok_sc.clone(), loc=table)

    lora, rope = 128, 16
    kv_c, k_pe = t(n, lora), t(n, rope)
    for fmt, width, dt in (("auto", lora + rope, torch.bfloat16), ("fp8_e4m3", lora + rope, e4m3),
                           ("fp8_ds_mla", lora + 4 + 2 * rope, torch.uint8), ("nvfp4", (lora + rope) // 2, torch.uint8)):
        extra = dict(scale=s1) if fmt == "fp8_e4m3" else {}
        if fmt == "nvfp4":
            extra = dict(scale_cache=t(pages, pps, (lora + rope) // 16, dtype=e4m3))
        out[f"store_mla {fmt}"] = (lambda fmt, width, dt, extra: lambda be: kvwrite.store_mla(
            kv_c, k_pe, t(pages, pps, width, dtype=dt), loc, kv_cache_dtype=fmt, check="guard", errors=errs,
            backend=be, **extra))(fmt, width, dt, extra)
    out["store_indexer_k"] = lambda be: kvwrite.store_indexer_k(
        t(n, 128), t(pages, pps * row_bytes(128, 128), dtype=torch.uint8), loc, backend=be)
    out["store_kv_nvfp4"] = lambda be: kvwrite.store_kv_nvfp4(
        t(n, h, 32), t(n, h, 32), t(pages, pps, h, 16, dtype=torch.uint8), t(pages, pps, h, 16, dtype=torch.uint8),
        t(pages, pps, h, 2, dtype=e4m3), t(pages, pps, h, 2, dtype=e4m3), loc, check="guard", errors=errs, backend=be)
    out["store_dsv4_kv"] = lambda be: kvwrite.store_dsv4_kv(
        t(n, dsv4.KV_DIM), t(pages, dsv4.kv_page_bytes(64), dtype=torch.uint8), loc, backend=be)
    out["store_dsv4_indexer_k fp8"] = lambda be: kvwrite.store_dsv4_indexer_k(
        t(n, 128), t(pages, 64 * dsv4.indexer_row_bytes(128), dtype=torch.uint8), loc, page_size=64, backend=be)
    out["store_dsv4_indexer_k mxfp4"] = lambda be: kvwrite.store_dsv4_indexer_k(
        t(n, 128), t(pages, 64 * dsv4.indexer_row_bytes(128, "mxfp4"), dtype=torch.uint8), loc, page_size=64,
        fmt="mxfp4", backend=be)
    out["store_rows"] = lambda be: kvwrite.store_rows(t(n, 32), t(16, 32), loc, check="guard", errors=errs,
                                                      backend=be)
    q = t(n, 4, d)
    cos_sin = t(32, d, dtype=torch.float32)
    out["rope_store_kv"] = lambda be: kvwrite.rope_store_kv(loc, q, k, v, cos_sin, cache(torch.bfloat16),
                                                            cache(torch.bfloat16), loc, backend=be)
    out["rope_store_kv int8 per-token-head"] = lambda be: kvwrite.rope_store_kv(
        loc, q, k, v, cos_sin, cache(torch.int8), cache(torch.int8), loc, k_scale_cache=head_sc,
        v_scale_cache=head_sc.clone(), backend=be)
    out["rope_store_mla"] = lambda be: kvwrite.rope_store_mla(
        loc, t(n, 4, rope), kv_c, k_pe, t(32, rope, dtype=torch.float32), t(pages, pps, lora + rope), loc,
        backend=be)
    # engine adapters
    out["vllm reshape_and_cache_flash fp8"] = lambda be: vl.reshape_and_cache_flash(
        k, v, cache(torch.uint8), cache(torch.uint8), loc, "fp8", s1, s1, backend=be)
    out["vllm reshape_and_cache"] = lambda be: vl.reshape_and_cache(
        k, v, t(pages, h, d // 8, pps, 8), t(pages, h, d, pps), loc, "auto", s1, s1, backend=be)
    out["vllm concat_and_cache_mla"] = lambda be: vl.concat_and_cache_mla(
        kv_c, k_pe, t(pages, pps, lora + rope), loc, "auto", s1, backend=be)
    out["vllm indexer_k_quant_and_cache"] = lambda be: vl.indexer_k_quant_and_cache(
        t(n, 128), t(pages, pps, 132, dtype=torch.uint8), loc, 128, "", backend=be)
    out["vllm per_token_head int8"] = lambda be: vl.triton_reshape_and_cache_flash_per_token_head_quant(
        k, v, cache(torch.int8), cache(torch.int8), head_sc, head_sc.clone(), loc, 2, backend=be)
    out["vllm per_token_head fp8"] = lambda be: vl.triton_reshape_and_cache_flash_per_token_head_quant(
        k, v, cache(torch.uint8), cache(torch.uint8), head_sc, head_sc.clone(), loc, 3, backend=be)
    out["sglang set_kv_buffer fp8 float scale"] = lambda be: sg.set_kv_buffer(
        t(pages * pps, h, d, dtype=e4m3), t(pages * pps, h, d, dtype=e4m3), loc, k, v, pps, 0.5, 0.25,
        backend=be)
    out["sglang set_mla_kv_buffer"] = lambda be: sg.set_mla_kv_buffer(
        t(pages * pps, 1, lora + rope), loc, t(n, 1, lora), t(n, 1, rope), pps, backend=be)
    out["sglang set_index_k_buffer"] = lambda be: sg.set_index_k_buffer(
        t(pages, pps * 132, dtype=torch.uint8), loc, t(n, 128), pps, backend=be)
    ind32 = lambda *vals: idx(*vals, dtype=torch.int32)  # noqa: E731
    out["flashinfer append_paged_kv_cache"] = lambda be: fi.append_paged_kv_cache(
        k, v, ind32(0, 0, 1, 1), ind32(0, 1, 0, 1), (cache(torch.bfloat16), cache(torch.bfloat16)),
        ind32(0, 1), ind32(0, 1, 2), ind32(2, 2), backend=be)
    out["flashinfer append_paged_mla_kv_cache"] = lambda be: fi.append_paged_mla_kv_cache(
        kv_c, k_pe, ind32(0, 0, 1, 1), ind32(0, 1, 0, 1), t(pages, pps, lora), t(pages, pps, rope),
        ind32(0, 1), ind32(0, 1, 2), ind32(2, 2), backend=be)
    return out


def _self_test(dev):
    """The detector must catch each kind of sync (else the scenarios prove nothing)."""
    import torch

    x = torch.empty(4, device=dev)
    return {
        "item": lambda: x.sum().item(),
        "bool": lambda: bool(x.any()),
        "nonzero": lambda: torch.nonzero(x),
        "mask index": lambda: x[x > 0],
        "tolist": lambda: x.tolist(),
        "h2d tensor": lambda: torch.tensor([1.0, 2.0], device=dev),
        "h2d to": lambda: torch.ones(3).to(dev),
        "d2h": lambda: x.cpu(),
    }


def main() -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from kvwrite.backend import BackendUnavailable

    Sync, SyncDetector = _detector_classes()
    launches: list[str] = []
    _patch_launches(launches)
    report = {"self_test": {}, "scenarios": {}}
    with FakeTensorMode(allow_non_fake_inputs=False):
        dev = torch.device("cuda", 0)
        for name, fn in _self_test(dev).items():
            det = SyncDetector()
            try:
                with det:
                    fn()
            except Exception:
                pass
            report["self_test"][name] = det.found
        scenarios = _scenarios(dev)
        for name, fn in scenarios.items():
            for be in ("triton", "cuda"):
                det = SyncDetector()
                launches.clear()
                status = "ok"
                try:
                    with det:
                        fn(be)
                except BackendUnavailable as exc:
                    status = f"unavailable: {exc}"
                except Sync:
                    status = "sync"
                except Exception as exc:  # a fake-tensor limit or a bug: reported, not hidden
                    status = f"error: {type(exc).__name__}: {str(exc)[:300]}"
                bad = [m for m in launches if not m.startswith("launch")]
                report["scenarios"][f"{name} [{be}]"] = {
                    "status": status, "found": det.found + bad,
                    "launched": [m for m in launches if m.startswith("launch")]}
    return report


# ---- the tests (run the scenarios once, in a subprocess) -------------------------------------

@pytest.fixture(scope="module")
def report():
    env = dict(os.environ, TRITON_INTERPRET="0", KVWRITE_TEST_DEVICE="cpu")
    res = subprocess.run([sys.executable, str(Path(__file__).resolve())], cwd=HERE, env=env,
                         capture_output=True, text=True, timeout=600)
    lines = [ln for ln in res.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"the detector subprocess failed (rc {res.returncode}):\n{res.stderr[-3000:]}"
    return json.loads(lines[-1])


def test_detector_catches_every_kind_of_sync(report):
    missed = [name for name, found in report["self_test"].items() if not found]
    assert not missed, f"the detector missed: {missed}"


# Ops whose GPU backends still fall back to host-syncing code (owner's work in progress): the
# test names them instead of failing the suite; remove an entry once it passes.
KNOWN: dict[str, str] = {}


def test_no_op_syncs_the_host(report):
    offenders, errors = {}, {}
    for name, r in report["scenarios"].items():
        if r["status"].startswith("unavailable"):
            continue
        if r["found"]:
            offenders[name] = r["found"]
        elif r["status"] != "ok":
            errors[name] = r["status"]
    offenders = {k: v for k, v in offenders.items() if k.split(" [")[0] not in KNOWN}
    assert not offenders, "host sync on a GPU backend:\n" + "\n".join(f"  {k}: {v}" for k, v in offenders.items())
    assert not errors, "scenario errors:\n" + "\n".join(f"  {k}: {v}" for k, v in errors.items())


def test_every_scenario_launches_a_kernel_or_says_why(report):
    """A scenario that launched nothing proved nothing: it must run a kernel, or its backend must
    be unavailable for a stated reason (an op with no kernel for that backend yet)."""
    silent = [name for name, r in report["scenarios"].items()
              if r["status"] == "ok" and not r["launched"]]
    assert not silent, f"ran no kernel: {silent}"


def test_unavailable_backends_are_listed(report):
    """Backends an op has no kernel for show up here (informational, never a silent pass)."""
    missing = sorted(name for name, r in report["scenarios"].items() if r["status"].startswith("unavailable"))
    if missing:
        pytest.skip("no kernel yet for: " + "; ".join(missing))


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    out = main()
    print(json.dumps(out), flush=True)
    os._exit(0)
