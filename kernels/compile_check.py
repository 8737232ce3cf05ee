"""Compile every Triton kernel variant for real GPU targets, no GPU needed.

`python -m kvwrite.kernels.compile_check [--family store_kv] [--cc 80 90] [--check guard]`
prints one JSON line per variant: name, cc, ok, whether its PTX calls `__assertfail`.
Run it without TRITON_INTERPRET (the interpreter replaces `triton.jit`).
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import time

import torch

FAMILIES = ("store_kv", "store_mla", "store_indexer_k", "store_kv_nvfp4", "store_mla_nvfp4",
            "store_dsv4")
CHECKS = {"off": 0, "assert": 1, "guard": 2}
_PTR = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
        torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5", torch.int32: "i32",
        torch.int64: "i64", torch.uint8: "u8"}


def signature(kernel, pointers: dict[str, torch.dtype], constexprs: dict) -> dict[str, str]:
    """Triton signature: pointers by dtype, constexprs marked, every other scalar int64."""
    sig = {}
    for name in kernel.arg_names:
        if name in constexprs:
            sig[name] = "constexpr"
        elif name in pointers:
            sig[name] = "*" + _PTR[pointers[name]]
        else:
            sig[name] = "i64"
    missing = set(pointers) - set(kernel.arg_names)
    if missing:
        raise KeyError(f"{kernel.__name__} has no arguments {missing}")
    return sig


# Page-table kwargs every store kernel takes (kernels/_common.claim_rows), off unless a variant
# sets HAS_TABLE: variants() that predate them compile unchanged.
TABLE_POINTERS = {"pt_batch_ptr": torch.int32, "pt_indices_ptr": torch.int32,
                  "pt_indptr_ptr": torch.int32}


def with_table_defaults(kernel, pointers: dict, constexprs: dict) -> tuple[dict, dict]:
    if "HAS_TABLE" not in kernel.arg_names:
        return pointers, constexprs
    return {**TABLE_POINTERS, **pointers}, {"HAS_TABLE": False, **constexprs}


def compile_variant(kernel, pointers, constexprs, cc: int) -> dict:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton

    pointers, constexprs = with_table_defaults(kernel, pointers, constexprs)
    src = ASTSource(kernel, signature(kernel, pointers, constexprs), constexprs)
    debug = constexprs.get("CHECK") == CHECKS["assert"]
    start = time.perf_counter()
    compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options={"debug": debug})
    ptx = compiled.asm["ptx"]
    return {"cc": cc, "ok": True, "assertfail": "__assertfail" in ptx,
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
