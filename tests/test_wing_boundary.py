"""Our Triton wing is a guest of the core, as a downstream backend is: the core (the plugin, the
reference, the suites) imports nothing of it, and it imports only the core's public names.

Public is what ``pytest_qconform/__init__.py`` lists; the checks below hold the two rules a
reader can see in an import line: no module or name that starts with an underscore, and none of
the modules the core names internal. Installed alone, the core runs the suites on bitsandbytes
and HQQ; the wing plugs in by its entry points only (a test hides it and runs them). And the
wing's own tests run alone from the repository root, without tests/ and its conftest.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import pytest_qconform.reference
import pytest_qconform.suites

import pytest_qconform
import qconform_triton_nf4

WING = "qconform_triton_nf4"
CORE_ROOTS = (
    Path(pytest_qconform.__file__).parent,
    Path(pytest_qconform.reference.__file__).parent,
    Path(pytest_qconform.suites.__file__).parent,
)
WING_ROOT = Path(qconform_triton_nf4.__file__).parent
# The core's internal modules (pytest_qconform/__init__.py): a guest that reads them breaks when they change.
INTERNAL_MODULES = {"plugin", "fixtures", "recorder", "setup", "state", "targets", "known_failures", "strategies"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted name) of every absolute import in ``path``: modules and the names taken from them."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names]
    return found


def core_imports_of_the_wing(roots: tuple[Path, ...]) -> list[str]:
    return [
        f"{path}:{line}: {name}"
        for root in roots
        for path in sorted(root.rglob("*.py"))
        for line, name in _imports(path)
        if name == WING or name.startswith(WING + ".")
    ]


def private_core_imports(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for line, name in _imports(path):
            parts = name.split(".")
            if parts[0] != "pytest_qconform":
                continue
            private = [p for p in parts[1:] if p.startswith("_") and p != "__version__"]
            internal = [p for p in parts[1:] if p in INTERNAL_MODULES]
            if private or internal:
                found.append(f"{path}:{line}: {name}")
    return found


def test_the_core_imports_nothing_of_the_wing():
    from pytest_qconform.backends import registry

    assert core_imports_of_the_wing(CORE_ROOTS) == []
    assert "triton-nf4" not in registry.BUILTIN_BACKENDS
    assert "triton-nf4" in registry.discover(), "installed: its entry point (pip install -e ./triton-nf4)"


def test_the_wing_imports_only_public_names_of_the_core():
    assert private_core_imports(WING_ROOT) == []


def test_the_checks_find_a_planted_import(tmp_path: Path):
    """Both checks can fail: each finds the import planted for it, and only that one."""
    core, wing = tmp_path / "core", tmp_path / "wing"
    core.mkdir()
    wing.mkdir()
    (core / "matrix.py").write_text("import json\nfrom qconform_triton_nf4.compile import report\n")
    (core / "fine.py").write_text("from pytest_qconform.report import sections\n")
    (wing / "backend.py").write_text(
        "from pytest_qconform.backends._torch_util import to_numpy\n"
        "from pytest_qconform.session import state\n"
        "from pytest_qconform.backends.adapter_helpers import _hidden\n"
        "from pytest_qconform.backends.adapter_helpers import to_numpy as public\n"
        "from pytest_qconform import __version__\n"
        "from . import kernels\n"
    )
    assert core_imports_of_the_wing((core,)) == [f"{core / 'matrix.py'}:2: qconform_triton_nf4.compile.report"]
    assert private_core_imports(wing) == [
        f"{wing / 'backend.py'}:1: pytest_qconform.backends._torch_util.to_numpy",
        f"{wing / 'backend.py'}:2: pytest_qconform.session.state",
        f"{wing / 'backend.py'}:3: pytest_qconform.backends.adapter_helpers._hidden",
    ]


# Hides the wing from a Python process: its distribution (so neither pytest nor the backend
# registry sees its entry points) and its package (an import of it fails, as without it installed).
HIDE_THE_WING = textwrap.dedent("""
    import importlib.metadata as metadata
    import sys

    _distributions = metadata.distributions

    def _without_the_wing(**kwargs):
        return (d for d in _distributions(**kwargs) if (d.metadata["Name"] or "").lower() != "qconform-triton-nf4")

    metadata.distributions = _without_the_wing
    sys.modules["qconform_triton_nf4"] = None
""")


def test_the_core_alone_runs_the_suites_on_bitsandbytes_and_hqq(tmp_path: Path):
    """Installed alone (the wing's distribution hidden), the core has no triton-nf4 and runs the
    suites on bitsandbytes and HQQ; nothing imports the wing."""
    (tmp_path / "site").mkdir()
    (tmp_path / "site" / "sitecustomize.py").write_text(HIDE_THE_WING)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path / "site"), os.environ.get("PYTHONPATH")])),
    }
    env.pop("PYTEST_ADDOPTS", None)

    def python(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *args], capture_output=True, text=True, env=env, cwd=tmp_path)

    listed = python("-c", "from pytest_qconform.backends import registry; print(sorted(registry.discover()))")
    assert listed.returncode == 0, listed.stderr[-2000:]
    assert "triton-nf4" not in listed.stdout and "'bitsandbytes'" in listed.stdout and "'hqq'" in listed.stdout
    suites = ("-m", "pytest", "--qconform", "-q", "-p", "no:cacheprovider", "--qconform-no-report")
    run = python(
        *suites,
        "--qconform-backend=bitsandbytes",
        "--qconform-backend=hqq",
        "-k",
        "test_dequantize_matches_reference_bytes",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert " passed" in run.stdout and "qconform-triton-nf4" not in run.stdout + run.stderr
    refused = python(*suites, "--qconform-backend=triton-nf4", "--collect-only")
    assert refused.returncode != 0 and "triton-nf4" in refused.stderr, refused.stdout[-2000:] + refused.stderr[-2000:]


def test_the_wings_tests_run_alone_from_the_repository_root():
    """``pytest triton-nf4/tests`` without tests/: the root conftest turns Triton's interpreter
    on for a run without a GPU, as tests/conftest.py does when tests/ is collected. Without it
    the first of the wing's test files to import triton imported it compiled, and every
    interpreted kernel after it failed ("Cannot call @triton.jit'd outside of the scope of a
    kernel": 69 of the folder's tests). The census file imports triton first, the quantize
    kernel's test then runs interpreted kernels."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernels compile")
    root = Path(__file__).resolve().parent.parent
    env = {name: value for name, value in os.environ.items() if name not in ("TRITON_INTERPRET", "PYTEST_ADDOPTS")}
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "triton-nf4/tests/test_compile_census.py",
            "triton-nf4/tests/test_quantize_kernel.py",
            "-k",
            "test_ties_go_to_the_lower_value",
        ],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0 and "2 passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]
