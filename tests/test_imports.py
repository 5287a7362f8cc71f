"""Dependencies point down: the import graph of `gjax/` and `configs/` has no cycle.

Every import of a gjax or configs module counts as an edge, at module level or inside a
function alike: a function-local import hides a circle from Python, not from this test.
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("gjax", "configs", "experiments")


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, pathlib.Path]:
    return {_module_name(p): p for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def _resolve(name: str, modules) -> str | None:
    """The module of ours that `import name` loads last (a.b.c -> a.b if c is an attribute)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _targets(node: ast.AST, here: str, is_package: bool, modules) -> list[str]:
    if isinstance(node, ast.Import):
        return [_resolve(a.name, modules) for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    if node.level:  # relative: from .x import y
        base = here if is_package else here.rpartition(".")[0]
        for _ in range(node.level - 1):
            base = base.rpartition(".")[0]
        source = f"{base}.{node.module}" if node.module else base
    else:
        source = node.module or ""
    # `from pkg import mod` imports the submodule pkg.mod; `from mod import name` imports mod.
    return [_resolve(f"{source}.{a.name}", modules) for a in node.names]


def import_graph() -> dict[str, set[str]]:
    """module -> the modules of ours it imports (anywhere in its body)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        is_package = path.name == "__init__.py"
        edges = set()
        for node in ast.walk(tree):
            edges.update(_targets(node, name, is_package, modules))
        edges.discard(None)
        edges.discard(name)
        # Importing pkg.mod runs pkg/__init__ first: an edge a child always has to its
        # parents, which is not one the child chose; leave it out.
        graph[name] = {e for e in edges if not name.startswith(e + ".")}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _one_loop(component: list[str], graph) -> list[str]:
    """A shortest import loop through the component's first module, for the message."""
    members, start = set(component), component[0]
    paths, frontier = {start: [start]}, [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    return component


def test_graph_sees_function_level_imports(tmp_path):
    graph = import_graph()
    assert "gjax.errors" in graph, "the graph misses modules"
    assert "gjax.errors" in graph["gjax.cli"]


def test_cycle_detection_names_the_loop():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    (component,) = cycles(graph)
    assert component == ["a", "b", "c"]
    assert _one_loop(component, graph) == ["a", "b", "c", "a"]


def test_no_import_cycle():
    graph = import_graph()
    found = cycles(graph)
    if found:
        loops = "\n".join(
            f"  {len(c)} modules: {', '.join(c)}\n    e.g. {' -> '.join(_one_loop(c, graph))}"
            for c in found
        )
        pytest.fail(
            f"import cycles (every import counts, function-local ones too):\n{loops}\n"
            "Move what both sides need lower (gjax.errors, gjax.schema), or pass it in."
        )


def test_library_does_not_import_the_cli():
    graph = import_graph()
    entry_points = {
        "gjax.train",
        "gjax.eval",
        "gjax.serve",
        "gjax.export",
        "gjax.plot",
        "gjax.plan",
    }
    importers = sorted(m for m, deps in graph.items() if "gjax.cli" in deps)
    assert set(importers) <= entry_points, (
        f"library modules import gjax.cli: {sorted(set(importers) - entry_points)}; "
        "import errors from gjax.errors"
    )
