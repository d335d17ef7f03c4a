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
from pytest_qconform.cases import axes, strategies

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


def test_each_value_once_also_holds_every_combination_of_the_joint_axes() -> None:
    """Strength 1 with ``jointly`` (the multi-device checks' format x dtype): each value of
    each axis, and every valid combination of the joint axes, though the longest axis has
    fewer values than there are combinations (5 rows, 3 formats x 2 dtypes)."""
    caps = Capabilities(("nf4", "fp4", "hqq4"), (64,), False, (torch.bfloat16, torch.float16), ("cpu",))
    values = {
        **axes.CheckAxes(("format", "hqq_axis", "dtype"), {}).values(caps, bf16=True),
        "rows": (1, 2, 3, 128, 300),
    }
    plain = axes.covering_rows(values, strength=1)
    joint = axes.covering_rows(values, strength=1, jointly=("format", "dtype"))
    cells = {(fmt, dtype) for fmt, dtype in product(values["format"], values["dtype"])}
    assert {(row["format"], row["dtype"]) for row in plain} < cells  # what the option is for
    assert {(row["format"], row["dtype"]) for row in joint} == cells
    for name, found in values.items():
        assert {row[name] for row in joint} == set(found), name
    assert len(joint) == len(cells)


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


def test_weight_shapes_follow_the_claimed_layouts() -> None:
    nf4_only = Capabilities(("nf4", "fp4"), (64,), False, (torch.float32,), ("cpu",))
    hqq_only = Capabilities(("hqq4",), (64,), False, (torch.float32,), ("cpu",), axes=(0, 1))
    assert axes.AXES["weight_shape"].claimed(nf4_only, True) == strategies.WEIGHT_SHAPES
    assert axes.AXES["weight_shape"].claimed(hqq_only, True) == strategies.HQQ_WEIGHT_SHAPES
    rows = axes.covering_rows(axes.CheckAxes(("format", "weight_shape"), {}).values(BNB_AND_HQQ, True), 2)
    assert {(row["format"], row["weight_shape"]) for row in rows} == {
        *((fmt, shape) for fmt in ("nf4", "fp4") for shape in strategies.WEIGHT_SHAPES),
        *(("hqq4", shape) for shape in strategies.HQQ_WEIGHT_SHAPES),
    }


@pytest.mark.parametrize(
    ("rows", "rank", "leading"),
    [(1, 2, (1,)), (1, 3, (1, 1)), (17, 3, (1, 17)), (18, 3, (3, 6)), (128, 3, (8, 16)), (300, 3, (15, 20))],
)
def test_activation_leading_dims_hold_the_rows(rows: int, rank: int, leading: tuple[int, ...]) -> None:
    assert strategies.activation_leading(rows, rank) == leading


# A backend with a fused gemv up to 16 rows and a route change at 4 (rows 1, 3, 4, 5, 16, 17,
# 18, 128, 300), bitsandbytes' layout and HQQ's (whose weight shapes differ), no bf16.
ROUTES_CONFTEST = FAKE_BACKEND + textwrap.dedent("""
    import json

    from pytest_qconform.cases.instances import axis_labels

    class Routes(FakeBackend):
        name = "routes"

        def capabilities(self, device):
            return Capabilities(
                ("nf4", "hqq4"), (64, 128), True, (torch.float32, torch.float16), ("cpu",),
                axes=(0, 1), max_gemv_rows=16, dispatch_rows=(4,),
            )

    def pytest_qconform_backends(config):
        return {"routes": Routes}

    def pytest_collection_modifyitems(config, items):
        found = [{"check": item.originalname, **axis_labels(item)} for item in items if axis_labels(item)]
        (config.rootpath / "instances.json").write_text(json.dumps(found))
""")

# The values that select a code path, per check that takes them from its covering array (they
# were hypothesis draws or a module's constants before issue 36).
PATH_AXES = {
    "test_matmul_matches_reference": ("weight_shape", "distribution", "rows", "x_rank", "x_layout", "bias"),
    "test_matmul_fp32_activation_into_low_precision_layer": ("weight_shape", "rows", "x_rank", "x_layout", "bias"),
    "test_matmul_every_route": ("rows", "x_rank", "x_layout", "bias"),
    "test_gradients_match_reference": ("weight_shape", "distribution", "rows", "x_rank"),
    "test_dequantize_matches_reference_bytes": ("weight_shape", "distribution"),
}
# A check that restricts a path axis (``only``): the gradients' rows are the decode row, a batch
# and a prefill (no backward changes route by rows; the matmul checks pair each route).
RESTRICTED = {"test_gradients_match_reference": {"rows": ["M1", "M128", "M300"]}}


def test_every_pair_of_path_values_is_an_instance_of_the_checks_that_take_them(pytester: pytest.Pytester) -> None:
    """The real suites' covering arrays, for a backend that declares its routes: every
    (rows, x_layout) pair, and every pair of any two values that select a path, is an
    instance of each check that depends on them, so no draw decides whether a route meets a
    layout; the values are those claimed (no bf16, the declared rows), and each weight shape
    is its format's."""
    pytester.makeconftest(ROUTES_CONFTEST)
    result = pytester.runpytest_subprocess(
        "--qconform", "--collect-only", "-q", "--qconform-backend=routes", "-k", " or ".join(PATH_AXES)
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    instances = json.loads((pytester.path / "instances.json").read_text())
    caps = Capabilities(("nf4", "hqq4"), (64, 128), True, (torch.float32, torch.float16), ("cpu",), axes=(0, 1))
    claimed = {
        "rows": ["M1", "M3", "M4", "M5", "M16", "M17", "M18", "M128", "M300"],
        "x_layout": list(axes.X_LAYOUTS),
        "x_rank": ["x2d", "x3d"],
        "bias": ["bias", "nobias"],
        "weight_shape": [axes.AXES["weight_shape"].label(s) for s in axes.AXES["weight_shape"].claimed(caps, False)],
    }
    layout_shapes = {
        fmt: {axes.AXES["weight_shape"].label(shape) for shape in shapes}
        for fmt, shapes in (("nf4", strategies.WEIGHT_SHAPES), ("hqq4", strategies.HQQ_WEIGHT_SHAPES))
    }
    for check, path_axes in PATH_AXES.items():
        rows = [row for row in instances if row["check"] == check]
        assert rows, f"{check}: no instance collected"
        assert {row["dtype"] for row in rows if "dtype" in row} <= {"fp32", "fp16"}, f"{check}: an unclaimed dtype"
        stray = [row for row in rows if row.get("weight_shape", "W64x128") not in layout_shapes[row["format"]]]
        assert not stray, f"{check}: weight shapes of another format's layout: {stray}"
        seen = {(a, row[a], b, row[b]) for row in rows for a, b in combinations(path_axes, 2)}
        expected = {**claimed, **RESTRICTED.get(check, {})}
        for a, b in combinations(path_axes, 2):
            values_a = expected.get(a) or sorted({row[a] for row in rows})
            values_b = expected.get(b) or sorted({row[b] for row in rows})
            missing = [(va, vb) for va, vb in product(values_a, values_b) if (a, va, b, vb) not in seen]
            assert not missing, f"{check}: no instance has ({a}, {b}) = {missing}"
    matmul = [row for row in instances if row["check"] == "test_matmul_matches_reference"]
    assert {(row["rows"], row["x_layout"]) for row in matmul} == set(product(claimed["rows"], claimed["x_layout"]))
