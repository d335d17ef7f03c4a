"""The hqq-gemlite backend where gemlite cannot run: every cell says why, nothing crashes.

gemlite is CUDA only (its import asks torch for CUDA), so a CPU machine shows the backend
as unavailable, "not installed" or with gemlite's import error, and the shipped suites
skip its cells with that reason; on a GPU, what it does not claim is "not claimed".
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys

import pytest
import torch

from pytest_qconform.backends import registry
from pytest_qconform.backends.hqq_gemlite import HqqGemliteBackend
from pytest_qconform.hardware.targets import Target


def _hide(monkeypatch: pytest.MonkeyPatch, module: str) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == module else real(name, *a))


def test_registered_as_a_builtin_backend():
    assert isinstance(registry.create("hqq-gemlite"), HqqGemliteBackend)


def test_without_gemlite_it_is_unavailable_saying_not_installed(monkeypatch):
    _hide(monkeypatch, "gemlite")
    status = HqqGemliteBackend().availability()
    assert (status.available, status.version) == (False, None)
    assert status.reason.startswith("gemlite is not installed (pip install 'pytest-qconform[gemlite]'")


def test_gemlite_failing_to_import_on_a_cpu_is_unavailable_with_its_error(monkeypatch):
    class _NoCuda(importlib.abc.MetaPathFinder):
        def find_spec(self, fullname, path=None, target=None):
            if fullname == "gemlite" or fullname.startswith("gemlite."):
                raise AssertionError("Torch not compiled with CUDA enabled\nmore")
            return None

    for loaded in [m for m in sys.modules if m == "gemlite" or m.startswith("gemlite.")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setattr(sys, "meta_path", [_NoCuda(), *sys.meta_path])
    status = HqqGemliteBackend().availability()
    assert (status.available, status.reason) == (
        False,
        "hqq-gemlite: import failed: AssertionError: Torch not compiled with CUDA enabled",
    )


def test_claims_cuda_only_and_no_dequantize():
    caps = HqqGemliteBackend().capabilities(torch.device("cpu"))
    assert caps.devices == ("cuda",)
    assert (caps.dequantize, caps.backward, caps.serialize, caps.axes) == (False, False, False, (1,))
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.claims import unclaimed

    cpu = Target(kind="cpu", arch="x86_64", family=None, torch_device="cpu", bf16=True, default_blocksize=64)
    assert unclaimed(caps, cpu, QuantSpec("hqq4", 64, axis=1), torch.float16, dequantize=True) == [
        "device cpu",
        "dequantize (the library offers none)",
    ]


def test_on_a_cpu_its_suite_cells_skip_as_unavailable_with_the_reason(pytester: pytest.Pytester) -> None:
    if importlib.util.find_spec("gemlite") is not None:
        pytest.skip("gemlite is installed here: this checks a machine without it")
    result = pytester.runpytest(
        "--qconform",
        "--qconform-backend=hqq-gemlite",
        "--qconform-no-report",
        "-p",
        "no:cacheprovider",
        "-k",
        "test_matmul_matches_reference",
        "-rs",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("skipped", 0) >= 1 and "failed" not in outcomes and "error" not in outcomes, outcomes
    result.stdout.fnmatch_lines(["*unavailable: hqq-gemlite: gemlite is not installed*"])
