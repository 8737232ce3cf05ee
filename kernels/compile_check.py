"""Compile every Triton kernel variant for real GPU targets, no GPU needed.

`python -m kvwrite.kernels.compile_check [--family store_kv] [--cc 80 90] [--check guard]`
prints one JSON line per variant: name, cc, ok, whether its PTX calls `__assertfail`, its
ptxas registers / stack / spill bytes and its 16-byte (`.v4`) global loads and stores.
Run it without TRITON_INTERPRET (the interpreter replaces `triton.jit`).
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# Every kernel module that lists its variants (`def variants()`): a new kernel file is checked
# without being named here.
FAMILIES = tuple(sorted(p.stem for p in Path(__file__).resolve().parent.glob("*.py")
                        if re.search(r"^def variants\(", p.read_text(), re.M)))
CHECKS = {"off": 0, "assert": 1, "guard": 2}
_PTR = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
        torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int32: "i32",
        torch.int64: "i64", torch.uint8: "u8", torch.int16: "i16", torch.int8: "i8"}


# A variant names its addressing as flags and dtypes (the descriptor's members are not kernel
# arguments): loc_ptr (int64; int32 positions with a page table), loc_map_ptr (with HAS_MAP),
# HAS_DCP (0 / 1 / DCP_PAGE) and HAS_TABLE (int32 tables, as FlashInfer's); the guard record
# (int64) exists in guard mode only, as a launch passes it (`kernels._launch.addr`).
ADDR_KEYS = ("loc_ptr", "loc_map_ptr", "err_ptr", "HAS_MAP", "HAS_DCP", "HAS_TABLE")


def addr_signature(pointers: dict, constexprs: dict):
    """(signature, constexpr members) of the `addr` argument (an `Addr` of type strings, as a
    launch specialises it: None members and `dcp` constexpr, every scalar int32)."""
    from kvwrite.kernels._common import Addr

    ptr = lambda key, default, on: "*" + _PTR[pointers.get(key, default)] if on else "constexpr"  # noqa: E731
    table = bool(constexprs.get("HAS_TABLE"))
    sig = Addr(loc=ptr("loc_ptr", torch.int64, True),
               loc_map=ptr("loc_map_ptr", torch.int32, constexprs.get("HAS_MAP")),
               errors=ptr("err_ptr", torch.int64, constexprs.get("CHECK") == CHECKS["guard"]),
               n_tokens="i32", capacity="i32", page_size="i32", map_len="i32", dcp_rank="i32",
               dcp_size="i32", dcp="constexpr", batch_indices=ptr("", torch.int32, table),
               kv_indices=ptr("", torch.int32, table), kv_indptr=ptr("", torch.int32, table),
               num_batches="i32", num_indices="i32")
    values = {"dcp": int(constexprs.get("HAS_DCP", 0))}
    return sig, {j: values.get(f) for j, (f, t) in enumerate(zip(Addr._fields, sig)) if t == "constexpr"}


def signature(kernel, pointers: dict[str, torch.dtype], constexprs: dict) -> dict:
    """Triton signature as a launch specialises it: pointers by dtype; constexprs (the variant's,
    then the kernel's own defaults: `KX: tl.constexpr = 0`); an argument a launch leaves at its
    default None is a constexpr None; `addr` the descriptor (`addr_signature`); every other
    scalar int32 (a launch passes Python ints that fit in 32 bits: tokens, strides)."""
    sig = {}
    for p in kernel.params:
        name = p.name
        if name == "addr":
            sig[name] = addr_signature(pointers, constexprs)[0]
        elif name in constexprs or p.is_constexpr or (name not in pointers and p.has_default
                                                      and p.default is None):
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + _PTR[pointers[name]]
        else:
            sig[name] = "i32"
    missing = set(pointers) - set(kernel.arg_names) - set(ADDR_KEYS)
    if missing:
        raise KeyError(f"{kernel.__name__} has no arguments {missing}")
    return sig


def launch_constexprs(kernel, pointers: dict, constexprs: dict) -> dict:
    """The variant's constexprs (less its addressing flags) plus what a launch fixes: a
    constexpr's default, None for a None-defaulted pointer, and the descriptor's constexpr
    members (keyed by their path)."""
    out = {k: v for k, v in constexprs.items() if k not in ADDR_KEYS}
    for i, p in enumerate(kernel.params):
        if p.name in out or p.name in pointers:
            continue
        if p.name == "addr":
            out.update({(i, j): v for j, v in addr_signature(pointers, constexprs)[1].items()})
        elif p.is_constexpr:
            if not p.has_default:
                raise KeyError(f"{kernel.__name__}: the variant sets no constexpr {p.name}")
            out[p.name] = p.default
        elif p.has_default and p.default is None:
            out[p.name] = None
    return out


# Integer arguments that are strides (k_sn, kc_sp, ks_sh, ...): a real launch passes multiples of
# 16 elements there, and Triton's launcher then specialises them (and 16-byte aligned pointers)
# as divisible by 16; the static compile gives the same hints, so its PTX is the launch's PTX.
# So does an integer a launch leaves at its default 0 (kc_sx=0: 0 is divisible by 16).
_STRIDE = re.compile(r"_s[a-z]{1,2}$")
_V4_LD = re.compile(r"\bld\.global[\w.]*\.v4\b")
_V4_ST = re.compile(r"\bst\.global[\w.]*\.v4\b")
_REGS = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


def aligned_attrs(kernel, pointers: dict, constexprs: dict, addr_sig=None) -> dict:
    """tt.divisibility=16 on every pointer (`addr_sig`'s members too), stride and zero-defaulted
    integer argument (what a launch specialises)."""
    div = [["tt.divisibility", 16]]
    attrs = {(i,): div for i, p in enumerate(kernel.params)
             if p.name not in constexprs and p.name != "addr" and (
                 p.name in pointers or _STRIDE.search(p.name) or (p.has_default and p.default == 0))}
    if addr_sig is not None:
        i = kernel.arg_names.index("addr")
        attrs.update({(i, j): div for j, t in enumerate(addr_sig) if t.startswith("*")})
    return attrs


def ptxas_usage(log: str) -> dict:
    """Registers, stack and spill bytes of the kernel(s) in a `ptxas -v` log (the maxima)."""
    regs = [int(m) for m in _REGS.findall(log)]
    spill = [tuple(map(int, m)) for m in _SPILL.findall(log)]
    if not regs:
        raise RuntimeError(f"no register count in the ptxas log: {log[-500:]!r}")
    return {"regs": max(regs), "stack": max((s[0] for s in spill), default=0),
            "spill": max((s[1] + s[2] for s in spill), default=0)}


def run_ptxas(ptx: str, cc: int) -> str:
    """`ptxas -v` (Triton's own ptxas, Triton's flags) on `ptx`; returns the log."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(cc).path, "-lineinfo", "-v", "--regAllocOptLevel=2",
                              f"--gpu-name={sm_arch_from_capability(cc)}", src, "-o", src + ".o"],
                             capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


def compile_variant(kernel, pointers, constexprs, cc: int) -> dict:
    """Compile one variant for sm_`cc`: whether it asserts, its ptxas registers / stack / spill
    bytes (Triton's own `ptxas -v` log; ptxas run again on a cache hit) and its 16-byte global
    loads / stores in the PTX."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    from kvwrite.kernels._launch import is_copy, num_warps
    from triton.compiler import ASTSource
    import triton

    addressing = constexprs
    constexprs = launch_constexprs(kernel, pointers, constexprs)
    # a family's own launch options (kernels/rope_store.py: warps, fp fusion off), else the shared ones
    module = sys.modules.get(getattr(getattr(kernel, "fn", None), "__module__", ""), None)
    own = getattr(module, "compile_options", None)
    options = dict(own(constexprs)) if own else {"num_warps": num_warps(constexprs), "copy": is_copy(constexprs)}
    copy = options.pop("copy")
    sig = signature(kernel, pointers, addressing)
    src = ASTSource(kernel, sig, constexprs, aligned_attrs(kernel, pointers, constexprs, sig.get("addr")))
    debug = constexprs.get("CHECK") == CHECKS["assert"]
    start = time.perf_counter()
    log = io.StringIO()
    saved = knobs.nvidia.dump_ptxas_log
    knobs.nvidia.dump_ptxas_log = True
    try:
        with contextlib.redirect_stdout(log):
            compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32),
                                      options={"debug": debug, **options})
    finally:
        knobs.nvidia.dump_ptxas_log = saved
    ptx = compiled.asm["ptx"]
    text = log.getvalue()
    usage = ptxas_usage(text if _REGS.search(text) else run_ptxas(ptx, cc))
    return {"cc": cc, "ok": True, "assertfail": "__assertfail" in ptx, **usage,
            "num_warps": options["num_warps"], "copy": copy,
            "v4_ld": len(_V4_LD.findall(ptx)), "v4_st": len(_V4_ST.findall(ptx)),
            "seconds": round(time.perf_counter() - start, 3)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--family", action="append", choices=FAMILIES)
    p.add_argument("--cc", type=int, nargs="+", default=[80, 90])
    p.add_argument("--check", choices=tuple(CHECKS), action="append")
    p.add_argument("--match", help="only variants whose name contains this text")
    args = p.parse_args(argv)
    failed = 0
    for family in args.family or FAMILIES:
        module = importlib.import_module(f"kvwrite.kernels.{family}")
        for name, kernel, pointers, constexprs in module.variants():
            if args.check and constexprs["CHECK"] not in [CHECKS[c] for c in args.check]:
                continue
            if args.match and args.match not in name:
                continue
            for cc in args.cc:
                try:
                    row = compile_variant(kernel, pointers, constexprs, cc)
                except Exception as exc:  # report every failure, not just the first
                    row = {"cc": cc, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
                    failed += 1
                row.update(family=family, variant=name, check=constexprs["CHECK"])
                print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
