"""The code's layers as DESIGN.md draws them: no import cycles, and no layer importing one above it.

The import graph is read from the source (every `import` / `from ... import`, at any depth, except
those under `if TYPE_CHECKING:`), so a cycle hidden behind an import inside a function counts too.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent / "infinity"

# Lower first. A module may import its own layer and those before it. The command layer (cli, tuning) is
# one; config, the native loader, the profiler, data and models are services any layer may use.
LAYERS = ["storage", "comm", "partition", "shards", "scheduler", "optim", "engine", "command"]
COMMAND = {"cli", "tuning"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_lines(tree: ast.AST) -> set[int]:
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.body:
                lines.update(range(child.lineno, (child.end_lineno or child.lineno) + 1))
    return lines


def import_graph() -> dict[str, set[str]]:
    modules = {_module_name(p): p for p in ROOT.rglob("*.py")}
    extensions = {f"infinity.{p.name.split('.')[0]}" for p in ROOT.glob("*.so")}  # the native build: a leaf
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip = _type_checking_lines(tree)
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skip:
                continue
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base]).strip(".")
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules.keys() | extensions else base
                    for a in node.names
                ]
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def _layer(module: str) -> str | None:
    parts = module.split(".")
    layer = parts[1] if len(parts) > 1 else None
    return "command" if layer in COMMAND else layer


def test_there_are_no_import_cycles_between_modules() -> None:
    assert _cycles(import_graph()) == []


def test_no_layer_imports_a_layer_above_it() -> None:
    wrong = []
    for module, targets in import_graph().items():
        mine = _layer(module)
        if mine not in LAYERS:
            continue
        for target in targets:
            theirs = _layer(target)
            if theirs in LAYERS and LAYERS.index(theirs) > LAYERS.index(mine):
                wrong.append(f"{module} imports {target}")
    assert wrong == []


def test_storage_comm_and_native_use_nothing_above_them() -> None:
    allowed = {"storage": {"storage", "config", "_native_loader"}, "comm": {"comm", "config"}}
    wrong = [
        f"{module} imports {target}"
        for module, targets in import_graph().items()
        for target in targets
        if _layer(module) in allowed and _layer(target) not in allowed[_layer(module)]
    ]
    assert wrong == []


def test_the_graph_reader_sees_a_cycle_and_a_lazy_import() -> None:
    """The checks above would pass vacuously if the reader missed edges: it must find these."""
    graph = import_graph()
    assert "infinity.storage.tier_store" in graph["infinity.storage"]
    assert "infinity.engine.checkpoint" in graph["infinity.engine.state_api"]  # imported inside a method
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == [["a", "b", "c"]]
