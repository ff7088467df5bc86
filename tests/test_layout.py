"""The package's import layout: read from the source with `ast`, nothing is imported.

Every `import` statement counts, at module level or inside a function (a lazy import is still
a dependency, and a lazy import that closes a circle only hides it); modules loaded by name
through importlib (the cli's STAGES, the engine registries) are not import statements and do
not count. Checked:
- no import cycle among draftflow modules;
- evaluation and export never import the trainer (`draftflow.drafters.train`): drafter files
  live in `draftflow.drafters.checkpoint`, batching in `draftflow.drafters.batching`;
- nothing in the package imports the fake servers (they live in tests/).

`DRAFTFLOW_LAYOUT_ROOT` points the test at another checkout's `draftflow/` (to see it fail).
"""

from __future__ import annotations

import ast
import os
from pathlib import Path

PACKAGE = Path(os.environ.get("DRAFTFLOW_LAYOUT_ROOT", Path(__file__).resolve().parents[1])) / "draftflow"
TRAINER = "draftflow.drafters.train"
NO_TRAINER = ("draftflow.evaluation", "draftflow.export")
FAKE_SERVERS = "fake_engines"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def package_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def imported_names(path: Path, name: str) -> set[str]:
    """Every module name an import statement in the file names, absolute (relative resolved)."""
    is_package = path.name == "__init__.py"
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_package else name.split(".")[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            names.add(source)
            names.update(f"{source}.{alias.name}" for alias in node.names)  # `from pkg import module`
    return names


def import_graph() -> dict[str, set[str]]:
    """module -> the draftflow modules it imports (a name that is not a module, e.g. a class
    in `from m import C`, is dropped; `m` itself stays)."""
    modules = package_modules()
    return {
        name: {target for target in imported_names(path, name) if target in modules and target != name}
        for name, path in modules.items()
    }


def find_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (as a path a -> … -> a) per strongly connected component of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []

    def connect(node: str) -> None:  # Tarjan; the package is small enough for recursion
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                connect(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                components.append(component)

    for node in sorted(graph):
        if node not in index:
            connect(node)
    cycles = []
    for component in components:
        start = min(component)
        # breadth-first inside the component: the shortest way back to `start`
        paths = {start: [start]}
        frontier = [start]
        cycle = None
        while frontier and cycle is None:
            nxt = []
            for node in frontier:
                for other in sorted(graph[node] & component):
                    if other == start:
                        cycle = paths[node] + [start]
                        break
                    if other not in paths:
                        paths[other] = paths[node] + [other]
                        nxt.append(other)
                if cycle:
                    break
            frontier = nxt
        cycles.append(cycle)
    return sorted(cycles)


def test_graph_sees_the_package():
    graph = import_graph()
    assert "draftflow.cli" in graph and "draftflow.drafters.train" in graph
    assert "draftflow.errors" in graph["draftflow.cli"]


def test_no_import_cycles():
    cycles = find_cycles(import_graph())
    assert not cycles, "import cycles among draftflow modules:\n" + "\n".join(" -> ".join(c) for c in cycles)


def test_evaluation_and_export_do_not_import_the_trainer():
    graph = import_graph()
    offenders = sorted(
        name for name, targets in graph.items() if name.startswith(NO_TRAINER) and TRAINER in targets
    )
    assert not offenders, f"import {TRAINER} (use draftflow.drafters.checkpoint / batching): {offenders}"
    assert any(name.startswith("draftflow.export.") for name in graph), "no draftflow.export package"


def test_package_does_not_import_the_fake_servers():
    assert not list(PACKAGE.rglob(f"{FAKE_SERVERS}.py")), "the fake servers belong in tests/"
    offenders = sorted(
        name
        for name, path in package_modules().items()
        if any(FAKE_SERVERS in target.split(".") for target in imported_names(path, name))
        or f"draftflow.engines.{FAKE_SERVERS}" in path.read_text()
    )
    assert not offenders, f"import the fake servers: {offenders}"


def test_cycle_finder_reports_a_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert find_cycles(graph) == [["a", "b", "c", "a"]]
    assert find_cycles({"a": {"b"}, "b": set()}) == []
