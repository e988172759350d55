"""The packages' import graph, read from the sources (deferred imports included): dependencies point one
way and no module imports itself back through others."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"cosyvoice_graphs": "graphs", "cosyvoice_runtime": "runtime", "cosyvoice_export": "export",
            "cosyvoice_serve": "serve", "cosyvoice_golden": "golden", "cosyvoice_bench": "bench"}
MAY_IMPORT = {
    "cosyvoice_graphs": set(),
    "cosyvoice_runtime": {"cosyvoice_graphs"},
    "cosyvoice_export": {"cosyvoice_graphs", "cosyvoice_runtime"},
    "cosyvoice_serve": {"cosyvoice_graphs", "cosyvoice_runtime"},
    "cosyvoice_golden": {"cosyvoice_graphs", "cosyvoice_runtime", "cosyvoice_export"},
    "cosyvoice_bench": {"cosyvoice_graphs", "cosyvoice_runtime", "cosyvoice_export"},
}
"""Which of our packages each package may import (anywhere in it, deferred imports included)."""
NEVER = {"cosyvoice_export": ("cosyvoice_runtime.cli",)}
"""Modules (and their submodules) a package must not import even where it may import their package: the
runtime's command, not the option types every command shares (`cosyvoice_runtime.cli_options`)."""


def _modules() -> dict[str, Path]:
    """Every first-party module's dotted name -> its file."""
    found = {}
    for package, folder in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((package, *parts))] = path
    return found


MODULES = _modules()


def _imports(name: str, path: Path) -> Iterator[str]:
    """The first-party modules `name` imports, wherever the import statement is."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from a import b` imports module a.b when b is one, else takes a name from module a
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:  # `import a.b.c` of a name: its module
                target = target.rpartition(".")[0]
            if target and target != name:
                yield target


GRAPH = {name: sorted(set(_imports(name, path))) for name, path in MODULES.items()}


def test_the_graph_is_read() -> None:
    assert {"cosyvoice_runtime.cosyvoice3", "cosyvoice_serve.engine", "cosyvoice_export.cli"} <= set(GRAPH)
    assert "cosyvoice_runtime" in GRAPH["cosyvoice_serve.engine"]  # from cosyvoice_runtime import CosyVoice3
    assert "cosyvoice_runtime.synthesis" in GRAPH["cosyvoice_runtime.cosyvoice3"]
    assert "cosyvoice_export.onnx.bundle_assembly" in GRAPH["cosyvoice_export.cli"]  # deferred, in a command


@pytest.mark.parametrize("package", sorted(PACKAGES))
def test_dependencies_point_one_way(package: str) -> None:
    wrong = [f"{name} imports {target}" for name, targets in GRAPH.items() if name.split(".")[0] == package
             for target in targets
             if target.split(".")[0] not in MAY_IMPORT[package] | {package}
             or any(target == never or target.startswith(f"{never}.") for never in NEVER.get(package, ()))]
    assert not wrong, "\n".join(wrong)


def _cycles(edges: dict[str, list[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in edges[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in edges:
        if node not in index:
            visit(node)
    return cycles


def test_a_cycle_is_found() -> None:
    assert _cycles({"a": ["b"], "b": ["c"], "c": ["a"], "d": ["a"]}) == [["a", "b", "c"]]
    assert _cycles({"a": ["b"], "b": [], "c": ["a", "b"]}) == []


def test_no_module_imports_itself_back() -> None:
    cycles = _cycles(GRAPH)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)
