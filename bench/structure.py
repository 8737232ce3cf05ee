"""The structure figures: glue lines, places a store touches, duplicate pairs.

- glue: non-blank lines of python/kvwrite/**.py outside reference/, config/, cli/, bench/,
  compat/, plus csrc/* code files outside csrc/kvwrite/ (README excluded).
- places: for a store, every block of code lines (runs no more than 3 lines apart) that name it
  (`store_indexer_k`, `StoreIndexerK`, `STORE_INDEXER_K`, and the derived C++ / Triton names
  `store_indexer_k_params`, `StoreIndexerKParams`, `dispatch_store_indexer_k`, `..._kernel`,
  `...Token`; a C++ `#include` is a line of code) in python/kvwrite, kernels/ and csrc/,
  plus each file named after it or its family (e.g. ops/indexer_k.py) as one place. Its users
  (compat/, config/, integrations/, cli/, bench/), generated docs and tests are left out (tests
  are one place by the issue's count, added by hand).
- duplicates: the pair count `duplicates` prints for the whole tree.

Run: `python bench/structure.py [op ...]` from the repository root.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "python" / "kvwrite"
NOT_GLUE = {"reference", "config", "cli", "bench", "compat"}
USERS = {"compat", "config", "integrations", "cli", "bench"}
CODE = {".py", ".h", ".cpp", ".cu", ".cuh"}
STORES = ("store_kv", "store_mla", "store_indexer_k", "store_kv_nvfp4", "store_dsv4_kv", "rope_store_kv",
          "copy_pages")


def _lines(path: Path) -> int:
    return sum(1 for line in path.read_text().splitlines() if line.strip())


def glue() -> dict[str, int]:
    """Non-blank glue lines: python (outside the excluded packages) and csrc (outside kvwrite/)."""
    py = sum(_lines(p) for p in PKG.rglob("*.py") if p.relative_to(PKG).parts[0] not in NOT_GLUE)
    cpp = sum(_lines(p) for p in (ROOT / "csrc").iterdir() if p.is_file() and p.suffix in CODE)
    return {"python": py, "csrc": cpp, "total": py + cpp}


def _names(op: str) -> re.Pattern:
    """The op's names and the C++ / Triton names derived from them (`store_indexer_k_params`,
    `StoreIndexerKParams`, `dispatch_store_indexer_k`, `store_indexer_k_kernel`, `...Token`)."""
    camel = "".join(w.capitalize() if w.islower() else w for w in op.split("_"))
    camel = camel.replace("Kv", "KV").replace("Mla", "MLA").replace("Dsv4", "DSV4").replace("Nvfp4", "NVFP4")
    return re.compile(rf"(?<![A-Za-z0-9_])(?:dispatch_)?({op}|{camel}|{op.upper()})"
                      rf"(?:_params|Params|Token|_kernel)?(?![A-Za-z0-9_])")


def _comment(line: str, suffix: str) -> bool:
    """A comment line (C++ preprocessor lines such as #include are code)."""
    s = line.lstrip()
    return s.startswith(("//", "*")) or (s.startswith("#") and suffix == ".py")


def _family(op: str) -> str:
    return op.removeprefix("store_").removeprefix("rope_")


def _files() -> list[Path]:
    return sorted(p for base in (PKG, ROOT / "kernels", ROOT / "csrc") for p in base.rglob("*")
                  if p.is_file() and p.suffix in CODE and not USERS & set(p.relative_to(ROOT).parts))


def places(op: str) -> dict[str, int]:
    """Where `op` is written: {file: blocks of lines that name it (or 1: the file is named after it)}."""
    pat, family = _names(op), _family(op)
    out = {}
    for p in _files():
        hits = [i for i, line in enumerate(p.read_text().splitlines())
                if pat.search(line) and not _comment(line, p.suffix)]
        blocks = sum(1 for j, i in enumerate(hits) if j == 0 or i - hits[j - 1] > 3)
        if p.stem in (op, family) or p.stem.endswith("_" + family):
            blocks = max(blocks, 1)
        if blocks:
            out[str(p.relative_to(ROOT))] = blocks
    return out


def duplicate_pairs() -> int | None:
    try:
        text = subprocess.run(["duplicates", "--repo", str(ROOT), "--seconds", "60"], capture_output=True,
                              text=True, check=False).stdout
    except FileNotFoundError:
        return None
    m = re.match(r"(\d+) pairs", text)
    return int(m.group(1)) if m else 0


def main(argv: list[str]) -> None:
    g = glue()
    print(f"glue lines: {g['total']} (python {g['python']}, csrc {g['csrc']})")
    for op in argv or STORES:
        p = places(op)
        print(f"places {op}: {sum(p.values())} in {len(p)} files (+ its tests)")
        for f, n in p.items():
            print(f"    {n:3d}  {f}")
    d = duplicate_pairs()
    print(f"duplicate pairs: {'duplicates not on the PATH' if d is None else d}")


if __name__ == "__main__":
    main(sys.argv[1:])
