"""The core's folders import only folders below them, in the order pyproject.toml writes down.

``[tool.qconform.folder-order]`` lists the folders lowest first; a module may import its own
folder and any folder on a lower line, never one beside it or above. An upward import means
a name sits in the wrong room (a record of the report kept among the cases, say); moving the
name down is the fix, not a function-level import (this test reads those too, and
``TYPE_CHECKING`` blocks). ``test_package_imports.py`` checks circles between files; this
checks the direction between folders.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest_qconform.reference
import pytest_qconform.suites

import pytest_qconform

CHECKOUT = Path(__file__).resolve().parent.parent
PACKAGE = "pytest_qconform"
# Each package root with its dotted name: reference/ and suites/ sit at the top of the
# checkout but are installed as pytest_qconform.reference and pytest_qconform.suites.
ROOTS = {
    PACKAGE: Path(pytest_qconform.__file__).parent,
    f"{PACKAGE}.reference": Path(pytest_qconform.reference.__file__).parent,
    f"{PACKAGE}.suites": Path(pytest_qconform.suites.__file__).parent,
}


def folder_order(pyproject: Path = CHECKOUT / "pyproject.toml") -> list[list[str]]:
    with pyproject.open("rb") as f:
        return tomllib.load(f)["tool"]["qconform"]["folder-order"]["levels"]


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = (package, *path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _room(module: str, rooms: set[str]) -> str | None:
    """The folder (or top-level module) of the package that ``module`` lies in; ``__init__``
    for the package itself and the names it defines (``pytest_qconform.__version__``)."""
    parts = module.split(".")
    if parts[0] != PACKAGE:
        return None
    return parts[1] if len(parts) > 1 and parts[1] in rooms else "__init__"


def _imported(path: Path, module: str) -> list[tuple[str, int]]:
    """Every module name ``path`` imports (absolute, or relative resolved), with its line."""
    found: list[tuple[str, int]] = []
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            name = ".".join(base + (node.module.split(".") if node.module else []))
            found += [(f"{name}.{alias.name}", node.lineno) for alias in node.names]
    return found


def upward_imports(roots: dict[str, Path], levels: list[list[str]], skip: tuple[str, ...] = ()) -> list[str]:
    """``where: room -> room (module)`` for every import that does not look down, and
    ``room: not in the folder order`` for a folder the order does not list."""
    level = {room: i for i, rooms in enumerate(levels) for room in rooms}
    top = roots[PACKAGE]
    rooms = {
        p.stem if p.suffix == ".py" else p.name
        for p in top.iterdir()
        if p.suffix == ".py" or (p / "__init__.py").exists()
    }
    rooms |= {name.split(".")[1] for name in roots if name != PACKAGE}
    wrong = [f"{room}: not in the folder order" for room in sorted(rooms - set(level) - set(skip))]
    for package, root in roots.items():
        for path in sorted(root.rglob("*.py")):
            module = _module_name(package, root, path)
            source = _room(module, rooms)
            if source is None or source in skip:
                continue
            for name, line in _imported(path, module):
                target = _room(name, rooms)
                if target is None or target == source or target in skip:
                    continue
                if source not in level or target not in level or level[target] >= level[source]:
                    wrong.append(f"{path.relative_to(root.parent)}:{line}: {source} -> {target} ({name})")
    return wrong


def test_every_import_of_the_core_looks_down():
    assert upward_imports(ROOTS, folder_order()) == []


def test_the_reference_imports_nothing_of_ours():
    """reference/ reads like the spec: its only neighbour on the lowest line is the package's version."""
    assert folder_order()[0] == ["__init__", "reference"]


def _plant(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    root = tmp_path / PACKAGE
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    return {PACKAGE: root}


LEVELS = [["__init__"], ["low"], ["mid_a", "mid_b"], ["high"]]
TREE = {
    "__init__.py": "__version__ = '0'\n",
    "low/__init__.py": "",
    "low/words.py": "from pytest_qconform import __version__\n",
    "mid_a/__init__.py": "",
    "mid_a/one.py": "from pytest_qconform.low import words\nfrom . import two\n",
    "mid_a/two.py": "",
    "mid_b/__init__.py": "",
    "high/__init__.py": "import pytest_qconform.mid_a.one\nfrom pytest_qconform.mid_b import x\n",
}


def test_a_tree_that_looks_down_passes(tmp_path):
    assert upward_imports(_plant(tmp_path, TREE), LEVELS) == []


def test_a_planted_upward_import_fails(tmp_path):
    """Even inside a function, even only for type checking: the direction is what counts."""
    planted = TREE | {"low/words.py": "def f():\n    from pytest_qconform.high import thing\n"}
    assert upward_imports(_plant(tmp_path, planted), LEVELS) == [
        "pytest_qconform/low/words.py:2: low -> high (pytest_qconform.high.thing)"
    ]


def test_an_import_beside_and_a_relative_one_upward_fail(tmp_path):
    planted = TREE | {"mid_b/__init__.py": "from ..mid_a import one\n", "mid_b/new.py": "from ..high import y\n"}
    assert upward_imports(_plant(tmp_path, planted), LEVELS) == [
        "pytest_qconform/mid_b/__init__.py:1: mid_b -> mid_a (pytest_qconform.mid_a.one)",
        "pytest_qconform/mid_b/new.py:1: mid_b -> high (pytest_qconform.high.y)",
    ]


def test_a_folder_the_order_does_not_list_fails(tmp_path):
    planted = TREE | {"stray/__init__.py": ""}
    assert upward_imports(_plant(tmp_path, planted), LEVELS) == ["stray: not in the folder order"]
