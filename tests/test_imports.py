"""The import graph of pods has no cycle: errors and configuration sit at the bottom, the loop and the
command line at the top. Imports inside functions count too (they are deferred, not absent)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "pods"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def pods_imports(path: Path, modules: set[str]) -> set[str]:
    """The pods modules ``path`` imports anywhere in its body (``from pods.x import y`` counts as pods.x.y
    when that is a module, else pods.x)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" for alias in node.names]
            found |= {name for name in names if name in modules} or {node.module}
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
    return {name for name in found if name in modules}


def import_graph() -> dict[str, set[str]]:
    paths = {module_name(path): path for path in PACKAGE.rglob("*.py")}
    return {name: pods_imports(path, set(paths)) - {name} for name, path in paths.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for child in sorted(graph[node]):
            if state.get(child) == 1:
                return [*path[path.index(child) :], child]
            if child not in state and (cycle := visit(child)):
                return cycle
        state[node] = 2
        path.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set(), "c": {"a", "b"}}) is None


def test_pods_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "pods.trainer" in graph and "pods.config" in graph["pods.trainer"]  # the graph is read at all
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


@pytest.mark.parametrize("bottom", ["pods.errors", "pods.config"])
def test_errors_and_configuration_import_no_registry(bottom: str) -> None:
    reachable, todo = set(), [bottom]
    graph = import_graph()
    while todo:
        for child in graph[todo.pop()] - reachable:
            reachable.add(child)
            todo.append(child)
    assert not reachable & {"pods.data", "pods.rewards", "pods.selection", "pods.trainer"}, reachable
