"""`kvwrite.config` has no import cycle (module-level or function-level
imports alike), ModelSpec imports no reader or planner, and the command line is one package."""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import kvwrite
import kvwrite.config

CONFIG = Path(kvwrite.config.__file__).parent


def _imports(path: Path, package: str) -> set[str]:
    """Every kvwrite.config module `path` imports, anywhere in the file (lazy imports count)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).rstrip(".")
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for n in names:
            if n == "kvwrite.config" or n.startswith("kvwrite.config."):
                out.add(n if (CONFIG / f"{n.rsplit('.', 1)[-1]}.py").exists() or n == "kvwrite.config" else
                        n.rsplit(".", 1)[0])
    return out


def _graph() -> dict[str, set[str]]:
    graph = {}
    for path in sorted(CONFIG.glob("*.py")):
        mod = "kvwrite.config" if path.name == "__init__.py" else f"kvwrite.config.{path.stem}"
        graph[mod] = _imports(path, "kvwrite.config") - {mod}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for m in sorted(graph.get(n, ())):
            if state.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in state and (found := visit(m)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in graph:
        if n not in state and (found := visit(n)):
            return found
    return None


def test_config_package_has_no_import_cycle():
    graph = _graph()
    assert len(graph) >= 10 and "kvwrite.config.model" in graph
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_cycle_finder_finds_one():
    # The check itself can fail: the old structure (model -> hf -> model) is a cycle.
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) is None


def test_model_spec_depends_on_no_reader_or_planner():
    deps = _graph()
    assert deps["kvwrite.config.model"] <= {"kvwrite.config.errors", "kvwrite.config.registry"}
    assert deps["kvwrite.config.registry"] <= {"kvwrite.config.errors"}
    for reader in ("hf", "presets", "variants"):
        assert "kvwrite.config.model" in deps[f"kvwrite.config.{reader}"]
    assert not any(m == "kvwrite.config" for d in deps.values() for m in d)   # no module imports the package


def test_config_never_imports_the_cli():
    for path in CONFIG.glob("*.py"):
        assert "kvwrite.cli" not in path.read_text(), path.name


def test_readers_back_the_model_spec_classmethods():
    from kvwrite.config.presets import PRESETS

    spec = kvwrite.ModelSpec.from_preset("llama-3.1-8b")
    assert spec == kvwrite.ModelSpec.from_hf_config(PRESETS["llama-3.1-8b"][1])


def test_cli_is_one_package():
    cli = importlib.import_module("kvwrite.cli")
    assert Path(cli.__file__).name == "__init__.py"
    for path in cli.COMMANDS:
        assert path.startswith("kvwrite.cli.")
        module = importlib.import_module(path)
        assert module.NAME and callable(module.run) and callable(module.add_arguments)
    for gone in ("kvwrite.plan_cli", "kvwrite.presets_cli", "kvwrite.demo", "kvwrite.bench.cli"):
        assert importlib.util.find_spec(gone) is None, gone
