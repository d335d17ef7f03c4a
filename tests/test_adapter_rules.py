"""The adapter rules of docs/downstream.md are enforced when the session starts."""

from __future__ import annotations

import textwrap

import pytest
import torch
from fake_backend import FAKE_BACKEND

from pytest_qconform.backends.adapter_rules import capability_problems, violations
from pytest_qconform.backends.base import Availability, Backend, Capabilities

SUITE = """
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_cell(qtarget, qbackend):
    pass
"""


def caps(**overrides) -> Capabilities:
    fields = dict(formats=("nf4",), blocksizes=(64,), double_quant=False, dtypes=(torch.float32,), devices=("cpu",))
    return Capabilities(**{**fields, **overrides})


def test_consistent_capabilities_have_no_problems() -> None:
    assert capability_problems(caps(), "cpu") == []
    assert capability_problems(caps(formats=("nf4", "fp4", "hqq4"), double_quant=True, max_gemv_rows=4), "cpu") == []
    paths = ("dequantize", "matmul", "layer-forward")
    assert capability_problems(caps(compiled=paths, captured=paths[1:]), "cpu") == []


@pytest.mark.parametrize(
    "overrides, problem",
    [
        (dict(formats=("NF4",)), "format 'NF4' is not one of nf4, fp4, hqq4 (lower case)"),
        (dict(formats="nf4"), "Capabilities.formats is 'nf4'; make it a tuple, e.g. formats=('nf4',)"),
        (dict(blocksizes=(0, 64.0)), "blocksize 0 is not a positive whole number"),
        (dict(dtypes=("bf16",)), "dtype 'bf16' is not one of torch.bfloat16, torch.float16, torch.float32"),
        (dict(devices=("rocm",)), "device 'rocm' is not one of cpu, cuda (ROCm devices are 'cuda' in torch)"),
        (dict(blocksizes=()), "claims formats nf4 but no blocksize"),
        (dict(formats=("hqq4",), double_quant=True), "double_quant=True needs an nf4 or fp4 format"),
        (dict(max_gemv_rows=0), "max_gemv_rows=0; use None or a whole number >= 1"),
        (dict(compiled="matmul"), "Capabilities.compiled is 'matmul'; make it a tuple, e.g. compiled=('matmul',)"),
        (dict(captured=("forward",)), "captured names 'forward', not one of dequantize, matmul, layer-forward"),
    ],
)
def test_inconsistent_capabilities_are_named(overrides: dict, problem: str) -> None:
    found = capability_problems(caps(**overrides), "cpu")
    assert any(problem in line for line in found), found
    assert all(line.startswith("capabilities('cpu')") for line in found)


class Named(Backend):
    name = "other"

    def availability(self):
        return Availability(True, "1")

    def capabilities(self, device):
        return [("nf4",)]

    quantize = dequantize = matmul = export_packed = None


def test_name_and_return_types_are_checked() -> None:
    found = violations("mine", Named(), ("cpu",))
    assert found[0].startswith(
        "its class attribute name is 'other' but it is registered as 'mine'; set "
        "name = 'mine' in test_adapter_rules.Named"
    )
    assert found[1] == "capabilities('cpu') returned list, not pytest_qconform.backends.base.Capabilities"


BROKEN_CONFTEST = FAKE_BACKEND + textwrap.dedent("""
    class Misnamed(FakeBackend):
        name = "fake"

    class Unreadable(FakeBackend):
        name = "unreadable"

        def capabilities(self, device):
            return Capabilities(("NF4",), (64,), False, (torch.float32,), ("rocm",))

    class Unavailable(Misnamed):
        name = "unavailable"

        def availability(self):
            return Availability(False, None, "mylib: import failed")

    def pytest_qconform_backends(config):
        return {"mine": Misnamed, "unreadable": Unreadable, "fake": FakeBackend, "unavailable": Unavailable}
""")


@pytest.mark.parametrize("workers", [(), ("-n", "2")], ids=["one-process", "xdist"])
def test_a_backend_breaking_the_rules_stops_the_session_saying_what_to_fix(
    pytester: pytest.Pytester, workers: tuple[str, ...]
) -> None:
    """Also under pytest-xdist, whose controller checks its backends after starting its workers."""
    pytester.makeconftest(BROKEN_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest(
        str(pytester.path),
        "--qconform",
        "--qconform-no-report",
        "-p",
        "no:cacheprovider",
        *workers,
        *(f"--qconform-backend={name}" for name in ("mine", "unreadable", "fake", "unavailable")),
    )
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(
        [
            "*backend 'mine' breaks the adapter rules (docs/downstream.md, section 2):",
            "*  - its class attribute name is 'fake' but it is registered as 'mine'; set name = 'mine' in conftest.Misnamed*",
            "*backend 'unreadable' breaks the adapter rules*",
            "*  - capabilities('cpu'): format 'NF4' is not one of nf4, fp4, hqq4 (lower case)",
            "*  - capabilities('cpu'): device 'rocm' is not one of cpu, cuda (ROCm devices are 'cuda' in torch)",
            "*Fix the adapter, or leave the backend out (--qconform-backend=NAME selects the others).",
        ]
    )
    assert "'fake' breaks" not in result.stderr.str()
    assert "'unavailable' breaks" not in result.stderr.str()  # its name is its registered one; no claims asked


def test_the_good_backends_run_when_the_broken_ones_are_left_out(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(BROKEN_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest(
        str(pytester.path),
        "--qconform",
        "--qconform-no-report",
        "-p",
        "no:cacheprovider",
        "--qconform-backend=fake",
        "--qconform-backend=unavailable",
    )
    result.assert_outcomes(passed=1, skipped=1)
