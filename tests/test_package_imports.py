"""The plugin's modules, the reference and the suites import each other one way: no import circle.

A circle (module A imports B, which imports A, even only for type checking) means a
record sits in the wrong module, and it makes import order matter. A package's
``__init__`` counts as a module: ``reference/__init__.py`` imports ``bounds`` for the
public API, so ``bounds`` imports its siblings by their own names, not through the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest_qconform.reference
import pytest_qconform.suites

import pytest_qconform
import qconform_triton_nf4

# Each package root with its dotted name: reference/ and suites/ sit at the top of the
# checkout but are installed as pytest_qconform.reference and pytest_qconform.suites; our Triton
# wing is its own distribution (triton-nf4/).
ROOTS = {
    "pytest_qconform": Path(pytest_qconform.__file__).parent,
    "pytest_qconform.reference": Path(pytest_qconform.reference.__file__).parent,
    "pytest_qconform.suites": Path(pytest_qconform.suites.__file__).parent,
    "qconform_triton_nf4": Path(qconform_triton_nf4.__file__).parent,
}


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = (package,) + path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(path: Path, modules: set[str]) -> set[str]:
    """The package's modules ``path`` imports anywhere (functions and TYPE_CHECKING too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names & modules


def import_graph() -> dict[str, set[str]]:
    paths = {_module_name(package, root, path): path for package, root in ROOTS.items() for path in root.rglob("*.py")}
    modules = set(paths)
    return {name: _imported(path, modules) - {name} for name, path in paths.items()}


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle as a path ``[a, b, ..., a]``, or None."""
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        for nxt in sorted(graph[node]):
            if nxt in path:
                return path[path.index(nxt) :] + [nxt]
            if nxt not in done:
                found = visit(nxt, path + [nxt])
                if found:
                    return found
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            found = visit(start, [start])
            if found:
                return found
    return None


def test_find_circle_finds_one():
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_circle({"a": {"b"}, "b": set()}) is None


def test_no_import_circle_in_the_plugin_the_reference_or_the_suites():
    graph = import_graph()
    assert {"pytest_qconform.reference.bounds", "pytest_qconform.suites._cases"} <= set(graph)
    circle = find_circle(graph)
    assert circle is None, f"import circle: {' -> '.join(circle or [])}"
