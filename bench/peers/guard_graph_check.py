"""The vLLM plugin's guard under CUDA-graph capture and torch.compile, as vLLM runs decode:
`python bench/peers/guard_graph_check.py --device cuda` (a step of bench/gpu_check.sh; on a
machine without a GPU, `--device cpu` runs the eager and compiled parts, no graph).

A stand-in `vllm._custom_ops` module (the plugin routes its `reshape_and_cache_flash`) and two
layers' caches registered with the guard. Then, for each way of running the step (eager, a
torch.compile'd step, a captured CUDA graph replayed): a clean step (the per-step check finds
nothing), then the same step with one slot moved one past the last block (the
slot_mapping edited in place, as vLLM fills its persistent buffer before a replay): the check
must raise naming the layers, the good rows must be written and no other byte changed, and
the next check must find the records cleared. Prints one
JSON line per mode and a summary line; exit status 1 if any mode fails.
"""
from __future__ import annotations

import argparse
import json
import sys
import types

import torch

NB, BS, H, D, N = 8, 16, 2, 64, 4


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args()
    dev = torch.device(args.device)
    from kvwrite import validate
    from kvwrite.compat import vllm as adapters
    from kvwrite.integrations import vllm as plugin

    ops = types.ModuleType("vllm._custom_ops")
    ops.reshape_and_cache_flash = lambda *a: (_ for _ in ()).throw(AssertionError("vLLM's own writer ran"))
    state = plugin.Installed()
    plugin.install(lambda name: ops if name == "vllm._custom_ops" else (_ for _ in ()).throw(ImportError(name)),
                   backend=args.backend, state=state, modules={}, ops=False)
    validate.DEFAULT_CHECK = "guard"
    g = plugin.guard()
    caches = {f"model.layers.{i}.attn": torch.zeros(2, NB, BS, H, D, dtype=torch.bfloat16, device=dev) for i in range(2)}
    g.register(caches, {n: BS for n in caches}, {n: NB * BS for n in caches})
    g.stepped = True
    key = torch.randn(N, H, D, device=dev).bfloat16()
    slots = torch.tensor([3, 17, 40, 100], device=dev)        # vLLM's persistent slot_mapping buffer
    scale = torch.ones((), device=dev)

    def step():
        for kv in caches.values():
            ops.reshape_and_cache_flash(key, key, kv[0], kv[1], slots, "auto", scale, scale)

    def expected():
        want = {n: torch.zeros_like(c) for n, c in caches.items()}
        for kv in want.values():
            adapters.reshape_and_cache_flash(key, key, kv[0], kv[1], slots, "auto", scale, scale, check="off",
                                             backend="torch")
        return want

    runners = {"eager": step, "compiled": torch.compile(step, dynamic=False)}
    if dev.type == "cuda":
        step()                                            # warm-up outside the capture
        g.check()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        runners["cuda_graph"] = graph.replay
    results, ok = {}, True
    for mode, run in runners.items():
        rec = {}
        for c in caches.values():
            c.zero_()
        slots.copy_(torch.tensor([3, 17, 40, 100], device=dev))
        run()
        try:
            g.check()
            rec["clean_step"] = "no error"
        except Exception as exc:  # noqa: BLE001 - recorded
            rec["clean_step"] = f"unexpected {type(exc).__name__}: {exc}"
        rec["clean_bytes_ok"] = all(torch.equal(caches[n], w) for n, w in expected().items())
        for c in caches.values():
            c.zero_()
        # the bad slot goes into the step's slot_mapping, which both layers' stores read (as in
        # vLLM): both layers' rows record it; the check raises the first and logs each
        before = len(g.faults)
        rec["error"] = None
        bad = slots.clone()
        bad[2] = NB * BS
        slots.copy_(bad)
        run()
        try:
            g.check()
        except Exception as exc:  # noqa: BLE001 - recorded
            rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
        rec["layers_reported"] = sorted({f.layer for f in g.faults[before:]})
        rec["caught"] = bool(rec["error"]) and "OutOfBoundsWrite" in rec["error"] and \
            rec["layers_reported"] == sorted(caches)
        want = {n: torch.zeros_like(c) for n, c in caches.items()}
        for kv in want.values():
            sm = slots.clone()
            sm[2] = -1
            adapters.reshape_and_cache_flash(key, key, kv[0], kv[1], sm, "auto", scale, scale, check="off", backend="torch")
        rec["bad_step_bytes_ok"] = all(torch.equal(caches[n], w) for n, w in want.items())
        try:
            g.check()
            rec["record_cleared"] = True
        except Exception:  # noqa: BLE001
            rec["record_cleared"] = False
        good = (rec["clean_step"] == "no error" and rec["clean_bytes_ok"] and rec["caught"]
                and rec["bad_step_bytes_ok"] and rec["record_cleared"])
        ok &= good
        results[mode] = rec
        print(json.dumps({"mode": mode, "ok": good, **rec}))
    validate.DEFAULT_CHECK = "off"
    plugin.uninstall(state)
    print(json.dumps({"device": str(dev), "modes": list(results), "all_ok": ok}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
