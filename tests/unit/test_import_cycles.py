"""No import cycles between the modules of ``consumer`` and ``topology``, and ``topology`` never
imports ``consumer``: a module can be read (and tested) after the ones it names, never before.

Imports made only for type checking are left out (they never run). A function-level import that
loads an optional extra late (``tracing`` loads ``otel`` only when tracing is on) is left out too:
it is how an optional dependency stays optional, not a dependency of the module."""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("consumer", "topology")


def _modules() -> dict[str, Path]:
    modules: dict[str, Path] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            modules[name] = path
    return modules


def _imported_at_module_level(tree: ast.Module) -> set[str]:
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                continue
            if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                continue
            if isinstance(child, ast.ImportFrom) and child.module and not child.level:
                names.add(child.module)
                names.update(f"{child.module}.{alias.name}" for alias in child.names)
            elif isinstance(child, ast.Import):
                names.update(alias.name for alias in child.names)
            visit(child)

    visit(tree)
    return names


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {
        name: {
            imported
            for imported in _imported_at_module_level(ast.parse(path.read_text()))
            if imported in modules and imported != name
        }
        for name, path in modules.items()
    }


def test_no_module_imports_itself_back_through_others() -> None:
    # Given the module-level imports of every module of both packages
    graph = _graph()

    # When they are put in an order where each module comes after what it imports
    order = list(graphlib.TopologicalSorter(graph).static_order())

    # Then there is one (a cycle raises graphlib.CycleError naming its modules)
    assert set(order) == set(graph)


def test_topology_never_imports_consumer() -> None:
    # Given the module-level imports of the topology package
    graph = _graph()

    # When the imports that cross into consumer are picked out
    crossing = sorted(
        f"{module} -> {imported}"
        for module, imports in graph.items()
        if module.startswith("topology")
        for imported in imports
        if imported.startswith("consumer")
    )

    # Then there are none: consumer builds on topology, not the other way round
    assert crossing == []
