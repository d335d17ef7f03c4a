"""The example downstream packages register through the entry point machinery, in process.

Fast stand-ins for ``nox -s downstream`` (which installs them into a fresh virtualenv
and runs the suites): the entry points declared in their ``pyproject.toml`` are turned
into ``importlib.metadata.EntryPoint`` objects and handed to the registry as if the
packages were installed; the planted bug of the broken twin is checked to be the one
it claims; and the report check the session relies on is checked to tell pass from fail.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import tomllib
from pathlib import Path

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bnb4

from pytest_qconform.backends import registry
from pytest_qconform.backends.base import Backend, QuantSpec

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "downstream"
BROKEN = EXAMPLE / "broken"


def declared_entry_points(project: Path) -> list[importlib.metadata.EntryPoint]:
    """The ``pytest_qconform.backends`` entry points a package's pyproject.toml declares."""
    data = tomllib.loads((project / "pyproject.toml").read_text())
    group = data["project"]["entry-points"][registry.ENTRY_POINT_GROUP]
    return [importlib.metadata.EntryPoint(name, value, registry.ENTRY_POINT_GROUP) for name, value in group.items()]


@pytest.fixture
def installed_examples(monkeypatch: pytest.MonkeyPatch) -> list[importlib.metadata.EntryPoint]:
    """Both example packages' entry points, as ``importlib.metadata`` would list them installed."""
    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    monkeypatch.syspath_prepend(str(BROKEN / "src"))
    points = declared_entry_points(EXAMPLE) + declared_entry_points(BROKEN)
    real = importlib.metadata.entry_points

    def entry_points(**selection):
        if selection.get("group") == registry.ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints(points)
        return real(**selection)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    return points


def test_examples_declare_one_backend_each() -> None:
    assert [(p.name, p.value) for p in declared_entry_points(EXAMPLE)] == [
        ("torch-nf4", "qconform_example_nf4.backend:TorchNF4Backend")
    ]
    assert [(p.name, p.value) for p in declared_entry_points(BROKEN)] == [
        ("torch-nf4-broken", "qconform_example_nf4_broken.backend:SwappedNibblesNF4Backend")
    ]


def test_registry_builds_the_example_backends_from_entry_points(installed_examples) -> None:
    factories = registry.discover()
    assert set(registry.BUILTIN_BACKENDS) | {"torch-nf4", "torch-nf4-broken"} <= set(factories)
    for point in installed_examples:
        backend = factories[point.name]()
        assert isinstance(backend, Backend) and not isinstance(backend, registry.UnavailableBackend), (
            backend.availability().reason
        )
        # The backend's own name is the one it registers under: it is what Quantized records carry.
        assert backend.name == point.name
        assert backend.availability().available


def test_example_backend_runs_under_pytest_through_its_entry_point(
    installed_examples, pytester: pytest.Pytester
) -> None:
    pytester.makepyfile(
        test_suite="""
        import pytest

        @pytest.mark.qconform_operation("dequantize")
        def test_registered(qtarget, qbackend):
            assert type(qbackend.unchecked).__module__ == "qconform_example_nf4.backend"
    """
    )
    result = pytester.runpytest(
        str(pytester.path),
        "--qconform",
        "--qconform-backend=torch-nf4",
        "--qconform-no-report",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=1)
    result.stdout.fnmatch_lines(["*backend torch-nf4: 0.1.0*"])


def _quantized_pair(installed_examples):
    factories = registry.discover()
    good, broken = factories["torch-nf4"](), factories["torch-nf4-broken"]()
    weight = torch.randn(7, 33, generator=torch.Generator().manual_seed(0))  # odd numel: a padding nibble
    spec = QuantSpec("nf4", 64)
    return good, broken, good.quantize(weight, spec), broken.quantize(weight, spec)


def test_broken_example_has_exactly_its_planted_bug(installed_examples) -> None:
    good, broken, q_good, q_broken = _quantized_pair(installed_examples)
    packed_good, packed_broken = good.export_packed(q_good), broken.export_packed(q_broken)
    # Same bytes (quantize and packing are untouched) ...
    np.testing.assert_array_equal(packed_broken.packed, packed_good.packed)
    np.testing.assert_array_equal(packed_broken.absmax, packed_good.absmax)
    exact = bnb4.decode(packed_good)
    torch.testing.assert_close(good.dequantize(q_good, torch.float32).double(), exact)
    # ... but its dequantize reads each byte's nibbles in the wrong order.
    bytes_ = packed_good.packed
    swapped = bnb4.decode(dataclasses.replace(packed_good, packed=((bytes_ & 0xF) << 4) | (bytes_ >> 4)))
    torch.testing.assert_close(broken.dequantize(q_broken, torch.float32).double(), swapped)
    assert not torch.equal(broken.dequantize(q_broken, torch.float32).double(), exact)


MINE_ONLY_CONFTEST = """
from qconform_example_nf4.backend import TorchNF4Backend

class Mine(TorchNF4Backend):
    name = "mine"

def pytest_qconform_backends(config):
    return {"mine": Mine}
"""


def test_a_backend_tested_alone_reads_bitsandbytes_bytes_without_bitsandbytes_cells(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bitsandbytes, installed but not selected, is the byte source of the interop check:
    the downstream backend gets its interop cells, bitsandbytes gets none."""
    pytest.importorskip("bitsandbytes.functional")  # before pytester: it cannot be imported twice in a process
    from pytest_qconform.report.run_report import read_report

    monkeypatch.syspath_prepend(str(EXAMPLE / "src"))
    pytester.makeconftest(MINE_ONLY_CONFTEST)
    result = pytester.runpytest(
        "--qconform",
        "--qconform-backend=mine",
        "--qconform-report-dir=out",
        "-k",
        "test_bitsandbytes_bytes_decode_identically",
        "-p",
        "no:cacheprovider",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2 and not outcomes.get("failed"), outcomes
    (path,) = (pytester.path / "out").glob("*.json")
    cells = read_report(path).cells
    assert {(c.backend, c.operation, c.verdict) for c in cells} == {("mine", "interop", "pass")}


def documented_skeleton() -> str:
    """The adapter skeleton of docs/downstream.md, between its markers."""
    text = (EXAMPLE.parent.parent / "docs" / "downstream.md").read_text(encoding="utf-8")
    block = text.split("<!-- skeleton:start -->", 1)[1].split("<!-- skeleton:end -->", 1)[0].strip()
    assert block.startswith("```python\n") and block.endswith("\n```"), "the skeleton is one python code block"
    return block[len("```python\n") : -len("\n```")]


def test_the_documented_adapter_skeleton_passes_the_suites(pytester: pytest.Pytester) -> None:
    """Saved as conftest.py and run as the docs say, every cell it claims passes."""
    from pytest_qconform.report.gate import problems
    from pytest_qconform.report.run_report import read_report

    pytester.makeconftest(documented_skeleton())
    result = pytester.runpytest_subprocess(
        "--qconform", "--qconform-backend=my-nf4", "--qconform-report-dir=out", "-p", "no:cacheprovider"
    )
    outcomes = result.parseoutcomes()
    assert result.ret == pytest.ExitCode.OK and "failed" not in outcomes and outcomes["passed"] >= 7, outcomes
    (path,) = (pytester.path / "out").glob("*.json")
    report = read_report(path)
    assert problems(report, ["my-nf4"], "pass") == []
    assert {c.operation for c in report.cells} >= {"quantize", "dequantize", "matmul", "backward"}
