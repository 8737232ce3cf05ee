"""What the cpu backend's off-mode bound costs: the CPU store_kv token loop (csrc/kvwrite/
store_kv.h through locs.h), MHA Llama-3.1-8B layer (8 x 128 bf16), one thread, built with the
bound (the default host build) and with -DKVWRITE_OFF_BOUND=0; the two binaries run alternately,
median of the rounds' medians.

    python bench/off_bound.py [--rounds 5] [--reps 50] [--tokens 1 256 1024 4096] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def build(out: Path, bound: bool) -> Path:
    exe = out / f"off_bound_{int(bound)}"
    cmd = [os.environ.get("CXX", "g++"), "-O3", "-std=c++17", f"-I{ROOT / 'csrc'}",
           f"-DKVWRITE_OFF_BOUND={int(bound)}", str(ROOT / "bench" / "off_bound.cpp"), "-o", str(exe)]
    subprocess.run(cmd, check=True)
    return exe


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 256, 1024, 4096])
    ap.add_argument("--out", type=Path, default=None, help="write off_bound.json/.md here")
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        exes = {b: build(Path(tmp), b) for b in (True, False)}
        runs: dict[bool, dict[int, list[float]]] = {b: {n: [] for n in a.tokens} for b in exes}
        for _ in range(a.rounds):
            for b, exe in exes.items():
                out = subprocess.run([str(exe), str(a.reps), *map(str, a.tokens)], check=True,
                                     capture_output=True, text=True).stdout
                for line in out.splitlines():
                    n, us, _ = line.split()
                    runs[b][int(n)].append(float(us))
    rows = []
    for n in a.tokens:
        with_b, without = statistics.median(runs[True][n]), statistics.median(runs[False][n])
        rows.append(dict(tokens=n, off_with_bound_us=with_b, off_without_bound_us=without,
                         ratio=with_b / without))
    lines = ["| N | off, with the bound (µs) | off, without (µs) | with / without |",
             "|---:|---:|---:|---:|"]
    lines += [f"| {r['tokens']} | {r['off_with_bound_us']:.2f} | {r['off_without_bound_us']:.2f} | "
              f"{r['ratio']:.3f} |" for r in rows]
    print("\n".join(lines))
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = dict(machine=platform.processor() or platform.machine(), rounds=a.rounds,
                    reps=a.reps, command="python bench/off_bound.py " + " ".join(
                        f"--{k} {' '.join(map(str, v)) if isinstance(v, list) else v}"
                        for k, v in (("rounds", a.rounds), ("reps", a.reps), ("tokens", a.tokens))))
        (a.out / "off_bound.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
        (a.out / "off_bound.md").write_text(
            "# cpu backend, check='off': the bound past the pool\n\n" + meta["command"] + "\n\n"
            + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
