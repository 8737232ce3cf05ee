"""The package's import graph (module-level and function-level imports alike): no import circle,
and the layers below the ops (kernels/, reference/, the facts) never import `kvwrite.ops`."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import kvwrite
from test_config_structure import _cycle

PKG = Path(kvwrite.__file__).parent
ROOTS = {"kvwrite": PKG, "kvwrite.kernels": PKG.parent.parent / "kernels"}
BELOW_OPS = ("kvwrite.kernels", "kvwrite.reference", "kvwrite.facts", "kvwrite.errors",
             "kvwrite.validate", "kvwrite.geometry", "kvwrite.addressing", "kvwrite.backend",
             "kvwrite._ext")


def _modules() -> dict[str, Path]:
    out = {}
    for base, root in ROOTS.items():
        if not root.is_dir():   # an installed package keeps its kernels under kvwrite/
            continue
        for path in root.rglob("*.py"):
            if base == "kvwrite" and path.relative_to(root).parts[0] == "kernels":
                continue
            parts = path.relative_to(root).with_suffix("").parts
            name = ".".join((base, *parts))
            out[name.removesuffix(".__init__")] = path
    return out


def _graph() -> dict[str, set[str]]:
    """module -> the kvwrite modules it imports (a `from a import b` names a.b when b is one)."""
    mods = _modules()
    graph = {}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            deps |= {n for n in names if n in mods}
        graph[mod] = deps - {mod}
    return graph


def test_graph_reads_the_package():
    graph = _graph()
    assert {"kvwrite.facts", "kvwrite.ops.spec", "kvwrite.kernels.store_kv", "kvwrite.reference.mla"} <= set(graph)
    assert "kvwrite.facts" in graph["kvwrite.kernels.store_mla"]
    assert "kvwrite.ops.spec" in graph["kvwrite.ops.kv"]


def test_no_import_circle():
    # kvwrite/__init__ re-exports the ops (a package face): its arrows are the public API, not
    # layering, so the modules are checked without it.
    graph = {m: d - {"kvwrite"} for m, d in _graph().items() if m != "kvwrite"}
    assert _cycle(graph) is None, " -> ".join(_cycle(graph))


def test_layers_below_the_ops_do_not_import_them():
    graph = _graph()
    bad = {m: sorted(d for d in deps if d == "kvwrite.ops" or d.startswith("kvwrite.ops."))
           for m, deps in graph.items() if m.startswith(BELOW_OPS)}
    assert not {m: d for m, d in bad.items() if d}


def test_facts_import_only_the_bottom_layer():
    assert _graph()["kvwrite.facts"] <= {"kvwrite.validate", "kvwrite.geometry"}
