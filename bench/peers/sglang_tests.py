"""Run SGLang's own memory-pool unit tests on CPU with kvwrite's SGLang hook installed.

The tests are SGLang's files from its repository (test/registered/unit/mem_cache/, taken through
the code index into /work/peers/src/sglang_tests/, see SOURCES.md there; not part of this repo).
Each file runs twice under pytest in the sglang env: once as it is and once with a plugin that
installs `kvwrite.integrations.sglang` before SGLang's pool module is imported (guard mode,
`KVWRITE_CHECK=guard`). Outcomes per test for both runs, and what the hook routed meanwhile
(its calls and fallbacks), go to --json: a test that passes alone and fails with the hook is
the hook's fault. Usage (sglang env, any cwd):
    python bench/peers/sglang_tests.py [TESTS_DIR] --json bench/results/peers/sglang-tests.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve().parent
TREE = HERE.parent.parent
PLUGIN = '''import json, os


def pytest_configure(config):
    from kvwrite.integrations import sglang as hook
    hook.install_when_imported()


def pytest_unconfigure(config):
    from kvwrite.integrations import sglang as hook
    with open(os.environ["KVWRITE_SGLANG_STATS"], "w") as f:
        json.dump({"routed": sorted(hook.STATE.originals), "calls": hook.STATE.calls,
                   "fallbacks": hook.STATE.fallbacks}, f)
'''


def outcomes(xml: Path) -> dict[str, str]:
    out = {}
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '').split('.')[-1]}::{case.get('name')}"
        kind = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                kind = "failed" if child.tag == "failure" else "error"
                out[name + " (message)"] = (child.get("message") or "")[:300]
            elif child.tag == "skipped":
                kind = "skipped"
        out[name] = kind
    return out


def run(test: Path, hooked: bool, work: Path) -> dict:
    xml = work / f"{test.stem}-{'hook' if hooked else 'alone'}.xml"
    stats = work / f"{test.stem}-stats.json"
    env = dict(os.environ, SGLANG_USE_CPU_ENGINE="1", TRITON_INTERPRET="1", KVWRITE_EXT="0",
               PYTHONPATH=os.pathsep.join([str(TREE / "python"), str(work)]))
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(test), f"--junitxml={xml}"]
    if hooked:
        env.update(KVWRITE_CHECK="guard", KVWRITE_SGLANG_STATS=str(stats))
        cmd[4:4] = ["-p", "kvwrite_sglang_plugin"]
    proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True, timeout=900)
    res = {"returncode": proc.returncode, "tail": proc.stdout[-600:]}
    if xml.exists():
        res["tests"] = outcomes(xml)
        res["counts"] = dict(Counter(v for k, v in res["tests"].items() if not k.endswith("(message)")))
    if hooked and stats.exists():
        res["hook"] = json.loads(stats.read_text())
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("tests", nargs="?", type=Path, default=Path("/work/peers/src/sglang_tests"))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvwrite-sglang-tests-"))
    (work / "kvwrite_sglang_plugin.py").write_text(PLUGIN)
    out = {"sglang": "0.5.23", "source": str(args.tests), "files": {}}
    total = {"alone": Counter(), "hook": Counter()}
    for test in sorted(args.tests.glob("test_*.py")):
        alone, hook = run(test, False, work), run(test, True, work)
        same = {k: (alone.get("tests", {}).get(k), v) for k, v in hook.get("tests", {}).items()
                if not k.endswith("(message)") and alone.get("tests", {}).get(k) != v}
        out["files"][test.name] = {"alone": alone, "hook": hook, "differs_with_hook": same}
        total["alone"].update(alone.get("counts", {}))
        total["hook"].update(hook.get("counts", {}))
        print(f"{test.name}: alone {alone.get('counts')} / with hook {hook.get('counts')}; "
              f"differ: {same or 'none'}; routed calls {hook.get('hook', {}).get('calls')}")
    out["totals"] = {k: dict(v) for k, v in total.items()}
    print("totals:", out["totals"])
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
