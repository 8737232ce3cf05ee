"""The manual runs: every python block of README.md and docs/*.md is executed (one namespace per
page, in order), every `kvwrite ...` line of a sh block is run as a command (exit status 0); the
generated parts (op tables, command reference, performance figures) equal their generators'
output; the README stays a manual (<= 250 lines, no figure bench/results lacks) and no project
issue numbers appear in headings or code comments.

A block whose first line is `# skip: <reason>` is not run (the reason is shown); `# needs: gpu`
runs only where torch sees a CUDA device, `# needs: network` never here.
"""
import contextlib
import importlib.util
import io
import os
import re
import shlex
from pathlib import Path

import pytest
import torch

from kvwrite import cli
from kvwrite.bench import summary

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _generator():
    spec = importlib.util.spec_from_file_location("docs_generate", ROOT / "docs" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def blocks(page: Path) -> list[tuple[str, str, int]]:
    """(language, body, line number) of every fenced block of a page."""
    text = page.read_text()
    return [(m.group(1), m.group(2), text[:m.start()].count("\n") + 1) for m in FENCE.finditer(text)]


def skip_reason(body: str) -> str | None:
    first = body.lstrip().splitlines()[0] if body.strip() else ""
    if first.startswith("# skip:"):
        return first[len("# skip:"):].strip()
    if first.startswith("# needs: gpu") and not torch.cuda.is_available():
        return "needs a GPU"
    if first.startswith("# needs: network"):
        return "needs the network"
    return None


def test_every_block_is_python_sh_or_text():
    for page in PAGES:
        for lang, body, line in blocks(page):
            assert lang in ("python", "sh", "text"), f"{page.name}:{line}: block language {lang!r}"


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_python_blocks_run(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": f"docs_{page.stem}"}
    ran = 0
    for lang, body, line in blocks(page):
        if lang != "python" or skip_reason(body):
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            exec(compile(body, f"{page.name}:{line}", "exec"), namespace)
        ran += 1
    if ran == 0 and not any(lang == "python" for lang, _, _ in blocks(page)):
        pytest.skip(f"{page.name} has no python block")


def _commands():
    for page in PAGES:
        for lang, body, line in blocks(page):
            if lang != "sh":
                continue
            reason = skip_reason(body)
            for i, text in enumerate(body.splitlines()):
                cmd = text.split(" #", 1)[0].strip()
                if cmd.startswith("kvwrite "):
                    yield pytest.param(cmd, id=f"{page.name}:{line + 1 + i}: {cmd[:60]}",
                                       marks=[pytest.mark.skip(reason=reason)] if reason else [])


@pytest.mark.parametrize("command", list(_commands()))
def test_kvwrite_commands_run(command, tmp_path, monkeypatch):
    argv = shlex.split(command)[1:]
    assert not (argv[0] == "bench" and "--out" not in argv), \
        "a documented bench command that runs must name --out (else it writes bench/results)"
    monkeypatch.chdir(tmp_path)
    with contextlib.redirect_stdout(io.StringIO()) as out:
        rc = cli.main(argv)
    assert rc == 0, out.getvalue()[-2000:]


def test_performance_blocks_equal_the_summary_of_bench_results():
    for part, page in summary.PAGES.items():
        assert summary.readme_block(page.read_text()) == summary.block(part=part), \
            f"{page.name} is stale: run python -m kvwrite.bench.summary --write"


def test_generated_docs_equal_the_generator():
    gen = _generator()
    for page, (name, make) in gen.BLOCKS.items():
        text = (ROOT / "docs" / page).read_text()
        assert gen.page_block(text, name) == make(), f"docs/{page} is stale: run python docs/generate.py --write"


def _numbers(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w.])\d+(?:\.\d+)?(?![\w.])", text))


def test_readme_is_a_manual():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 250
    # Every decimal figure outside the generated block and code must be in bench/results (none is
    # expected: figures live in the generated block).
    prose = FENCE.sub("", text.replace(summary.readme_block(text), ""))
    decimals = {n for n in _numbers(prose) if "." in n}
    assert not decimals - {"2.14.1", "3.1"}, sorted(decimals)


ISSUE_REF = re.compile(r"\b[Ii]ssues? ?\d+|\(issue\b|[Ii]tem \d+ of issue|\bper issue\b|the issue'?s? targets?")
BARE_NUMBER = re.compile(r"(?<![\w/])#\d{2,}")  # "#33348" without the project it belongs to
UPSTREAM = re.compile(r"(SGLang|vLLM|FlashInfer|triton|pytorch|PR) #\d+")


def test_no_issue_numbers_in_headings():
    for page in PAGES + [ROOT / "CHANGELOG.md"]:
        for line in page.read_text().splitlines():
            if line.startswith("#") and not page.name == "CHANGELOG.md":
                assert not ISSUE_REF.search(line) and not BARE_NUMBER.search(line), f"{page.name}: {line}"
    for page in PAGES:
        assert not ISSUE_REF.search(FENCE.sub("", page.read_text())), page.name


def _comments(path: Path):
    text = path.read_text(errors="replace")
    if path.suffix in (".py", ".sh", ".md"):
        for i, line in enumerate(text.splitlines(), 1):
            yield i, line  # comments, docstrings, step labels: the whole line is judged
    else:
        for i, line in enumerate(text.splitlines(), 1):
            if "//" in line or "/*" in line or line.lstrip().startswith(("*", "#")):
                yield i, line


def test_no_issue_numbers_in_code():
    bad = []
    for top in ("python", "kernels", "csrc", "bench", "tests", "examples"):
        for path in (ROOT / top).rglob("*"):
            if path.suffix not in (".py", ".h", ".cu", ".cpp", ".sh", ".md") or "results" in path.parts:
                continue
            if path == Path(__file__).resolve():
                continue
            for i, line in _comments(path):
                if ISSUE_REF.search(line) or BARE_NUMBER.search(UPSTREAM.sub("", line)):
                    bad.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)


def test_local_links_resolve():
    """Every relative link of the manual points at a file of the repository (anchors: a heading)."""
    for page in PAGES + [ROOT / "CHANGELOG.md"]:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if "://" in target:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            assert dest.exists(), f"{page.name}: link to missing {target}"
            if anchor and dest.suffix == ".md":
                slugs = {re.sub(r"[^\w\- ]", "", h.strip("# ").lower()).replace(" ", "-")
                         for h in dest.read_text().splitlines() if h.startswith("#")}
                assert anchor in slugs, f"{page.name}: no heading for #{anchor} in {dest.name}"
