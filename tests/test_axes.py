"""Declared axes: covering arrays from a backend's claims, the one cell of a check whose
backend claims nothing it needs, and the coverage the run report records."""

from __future__ import annotations

import json
import textwrap
from itertools import combinations, product

import pytest
import torch
from fake_backend import FAKE_BACKEND

from pytest_qconform.backends.base import Capabilities
from pytest_qconform.cases import axes

BNB_AND_HQQ = Capabilities(
    ("nf4", "fp4", "hqq4"),
    (64, 128, 256),
    True,
    (torch.bfloat16, torch.float16),
    ("cpu",),
    axes=(0, 1),
    quant_storages=(torch.uint8, torch.float16),
)


def _pairs(rows, names):
    return {(a, row[a], b, row[b]) for row in rows for a, b in combinations(names, 2)}


def test_every_valid_pair_of_claimed_values_is_covered() -> None:
    check = axes.CheckAxes(("format", "blocksize", "double_quant", "hqq_axis", "quant_storage", "dtype"), {})
    values = check.values(BNB_AND_HQQ, bf16=True)
    rows = axes.covering_rows(values, strength=2)
    names = list(values)
    full = [dict(zip(names, combo)) for combo in product(*values.values())]
    valid = [row for row in full if axes._valid(names, list(row.values()))]
    assert all(row in valid for row in rows), "a row breaks the axis constraints"
    assert _pairs(valid, names) <= _pairs(rows, names)
    assert len(rows) < len(valid) / 3, (len(rows), len(valid))


def test_constraints_keep_bitsandbytes_options_off_hqq() -> None:
    check = axes.CheckAxes(("format", "double_quant", "quant_storage", "hqq_axis"), {})
    for row in axes.covering_rows(check.values(BNB_AND_HQQ, bf16=True), strength=2):
        spec = axes.spec_of(row)
        if spec.format == "hqq4":
            assert not spec.double_quant and spec.quant_storage is torch.uint8
        else:
            assert spec.axis == 1


def test_rows_are_every_route_change_and_its_neighbours() -> None:
    caps = Capabilities(("nf4",), (64,), False, (torch.float32,), ("cpu",), max_gemv_rows=16, dispatch_rows=(4,))
    assert axes.AXES["rows"].claimed(caps, True) == (1, 3, 4, 5, 16, 17, 18, 128, 300)


def test_bf16_is_not_drawn_on_an_arch_without_it() -> None:
    assert axes.AXES["dtype"].claimed(BNB_AND_HQQ, False) == (torch.float16,)


def test_unknown_axis_is_a_usage_error() -> None:
    with pytest.raises(pytest.UsageError, match="unknown axes"):
        axes.CheckAxes.from_marker(pytest.mark.qconform_axes("format", "colour").mark)


CONFTEST = FAKE_BACKEND + textwrap.dedent("""
    class Claims(FakeBackend):
        name = "claims"

        def capabilities(self, device):
            return Capabilities(("nf4",), (64, 128), True, (torch.float32, torch.float16), ("cpu",))

    def pytest_qconform_backends(config):
        return {"claims": Claims}
""")

SUITE = textwrap.dedent("""
    import pytest

    @pytest.mark.qconform_operation("toy")
    @pytest.mark.qconform_axes("format", "blocksize", "double_quant", "dtype")
    def test_toy(qtarget, qbackend, spec, dtype):
        pass

    @pytest.mark.qconform_operation("toy-hqq")
    @pytest.mark.qconform_axes("format", "blocksize", format=("hqq4",))
    def test_hqq_only(qtarget, qbackend, spec):
        pass
""")


def test_instances_come_from_claims_and_the_report_records_coverage(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_toy=SUITE)
    result = pytester.runpytest(
        "--qconform", "test_toy.py", "--qconform-backend=claims", "--qconform-report-dir=out", "-rs"
    )
    result.stdout.fnmatch_lines(["*claims nothing this check needs: claims claims no value of format in ('hqq4',)*"])
    report = json.loads(next((pytester.path / "out").glob("*.json")).read_text())
    toy = next(e for e in report["coverage"] if e["operation"] == "toy")
    assert toy["values"] == {
        "blocksize": ["128", "64"],
        "double_quant": ["dq", "plain"],
        "dtype": ["fp16", "fp32"],
        "format": ["nf4"],
    }
    assert toy["unchecked"] == {}
    assert ["blocksize", "128", "dtype", "fp16"] in toy["pairs"]
    hqq_cells = [c for c in report["cells"] if c["operation"] == "toy-hqq"]
    assert [c["verdict"] for c in hqq_cells] == ["not-claimed"], "the check whose claims are empty has one cell"
