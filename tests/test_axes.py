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


def _triples(rows, names):
    return {tuple((a, row[a]) for a in combo) for row in rows for combo in combinations(names, 3)}


@pytest.mark.parametrize(
    ("strength", "names", "tuples"),
    [
        (2, ("format", "blocksize", "double_quant", "hqq_axis", "quant_storage", "dtype"), _pairs),
        (3, ("format", "double_quant", "quant_storage", "dtype", "rows", "x_layout", "bias"), _triples),
    ],
    ids=["pairs", "triples"],
)
def test_every_valid_tuple_of_claimed_values_is_covered(strength, names, tuples) -> None:
    """All pairs (``ci``) and all triples (``thorough``): every tuple of values that some valid
    instance holds is in one (allpairspy's ``n=3`` left a third of the triples out on the route
    check's axes), in far fewer rows than the valid instances."""
    values = axes.CheckAxes(names, {}).values(BNB_AND_HQQ, bf16=True)
    rows = axes.covering_rows(values, strength=strength)
    names = list(values)
    full = [dict(zip(names, combo)) for combo in product(*values.values())]
    valid = [row for row in full if axes._valid(names, list(row.values()))]
    assert all(row in valid for row in rows), "a row breaks the axis constraints"
    assert tuples(valid, names) <= tuples(rows, names)
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
    assert axes.AXES["weight_shape"].claimed(nf4_only, True) == axes.WEIGHT_SHAPES
    assert axes.AXES["weight_shape"].claimed(hqq_only, True) == axes.HQQ_WEIGHT_SHAPES
    rows = axes.covering_rows(axes.CheckAxes(("format", "weight_shape"), {}).values(BNB_AND_HQQ, True), 2)
    assert {(row["format"], row["weight_shape"]) for row in rows} == {
        *((fmt, shape) for fmt in ("nf4", "fp4") for shape in axes.WEIGHT_SHAPES),
        *(("hqq4", shape) for shape in axes.HQQ_WEIGHT_SHAPES),
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
        for fmt, shapes in (("nf4", axes.WEIGHT_SHAPES), ("hqq4", axes.HQQ_WEIGHT_SHAPES))
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


# -- issue 51, item 2: the settings users set are axes --------------------------------------------------------


def test_call_forms_are_the_plain_call_and_each_claimed_form() -> None:
    """``call_form``: the plain call, ``out=`` where matmul claims it (a dequantize buffer is
    no matmul form), and each documented orientation besides the default."""
    base = Capabilities(("nf4",), (64,), False, (torch.float32,), ("cpu",))
    assert axes.AXES["call_form"].claimed(base, True) == ("plain",)
    dequantize_only = Capabilities(("nf4",), (64,), False, (torch.float32,), ("cpu",), out_arguments=("dequantize",))
    assert axes.AXES["call_form"].claimed(dequantize_only, True) == ("plain",)
    every = Capabilities(
        ("nf4",),
        (64,),
        False,
        (torch.float32,),
        ("cpu",),
        out_arguments=("dequantize", "matmul"),
        weight_orientations=("default", "as-quantized"),
    )
    assert axes.AXES["call_form"].claimed(every, True) == ("plain", "out", "as-quantized")
    assert [axes.AXES["call_form"].label(v) for v in ("plain", "out")] == ["call-plain", "call-out"]


def test_constraints_keep_weight_orientations_and_storages_on_the_bitsandbytes_layout() -> None:
    caps = Capabilities(
        ("nf4", "hqq4"),
        (64,),
        False,
        (torch.float32,),
        ("cpu",),
        quant_storages=(torch.uint8, torch.bfloat16),
        out_arguments=("matmul",),
        weight_orientations=("default", "as-quantized"),
    )
    check = axes.CheckAxes(("format", "quant_storage", "call_form", "rows"), {})
    rows = axes.covering_rows(check.values(caps, bf16=True), strength=2)
    hqq = [row for row in rows if row["format"] == "hqq4"]
    assert hqq and all(row["quant_storage"] is torch.uint8 and row["call_form"] in ("plain", "out") for row in hqq)
    assert {(row["format"], row["call_form"]) for row in rows} == {
        ("nf4", "plain"),
        ("nf4", "out"),
        ("nf4", "as-quantized"),
        ("hqq4", "plain"),
        ("hqq4", "out"),
    }


# A backend claiming every setting: storage dtypes, out= and a second orientation, a declared
# route change; bitsandbytes' layout and HQQ's.
SETTINGS_CONFTEST = FAKE_BACKEND + textwrap.dedent("""
    import json

    from pytest_qconform.cases.instances import axis_labels

    class Settings(FakeBackend):
        name = "settings"

        def capabilities(self, device):
            return Capabilities(
                ("nf4", "hqq4"), (64,), True, (torch.float32, torch.float16), ("cpu",),
                axes=(0, 1), dispatch_rows=(4,), quant_storages=(torch.uint8, torch.float16, torch.float32),
                out_arguments=("dequantize", "matmul"), weight_orientations=("default", "as-quantized"),
            )

    def pytest_qconform_backends(config):
        return {"settings": Settings}

    def pytest_collection_modifyitems(config, items):
        found = [
            {"check": item.originalname, "file": item.path.name, **axis_labels(item)}
            for item in items
            if axis_labels(item)
        ]
        (config.rootpath / "instances.json").write_text(json.dumps(found))
""")
# The checks that take the settings, and the axes each must pair every setting with.
SETTING_CHECKS = {
    "test_matmul_every_route": (
        ("quant_storage", "call_form", "double_quant"),
        ("rows", "x_rank", "x_layout", "bias", "dtype", "quant_storage", "call_form", "double_quant"),
    ),
    "test_gradients_match_reference": (("quant_storage",), ("rows", "x_rank", "dtype", "double_quant")),
    "test_layer_forward_in_every_mode": (("quant_storage",), ("blocksize", "double_quant", "dtype")),
    "test_layer_quantized_by_moving_holds_the_reference_quantization": (("quant_storage",), ("dtype",)),
}


def test_every_setting_meets_every_route_layout_and_dtype(pytester: pytest.Pytester) -> None:
    """The real suites' covering arrays for a backend that claims every setting: each storage
    dtype and each call form is paired with every row count, layout, rank, bias and dtype in
    the route check, and each storage with the layer, backward and workload checks' axes; the
    QLoRA step runs every storage with every compute dtype (FSDP-QLoRA's bf16 storage with bf16
    compute in one process)."""
    pytester.makeconftest(SETTINGS_CONFTEST)
    checks = [*SETTING_CHECKS, "test_qlora_training_step", "test_generate"]
    result = pytester.runpytest_subprocess(
        "--qconform", "--collect-only", "-q", "--qconform-backend=settings", "-k", " or ".join(checks)
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    instances = json.loads((pytester.path / "instances.json").read_text())
    storages = ["u8", "fp16", "fp32"]
    forms = ["call-plain", "call-out", "call-as-quantized"]
    for check, (settings, others) in SETTING_CHECKS.items():
        rows = [row for row in instances if row["check"] == check]
        assert rows, f"{check}: no instance collected"
        assert {row["quant_storage"] for row in rows} == set(storages), check
        if "call_form" in settings:
            assert {row["call_form"] for row in rows} == set(forms), check
        for setting in settings:
            for other in others:
                if other == setting:
                    continue
                expected = {(row[setting], value) for value in {r[other] for r in rows} for row in rows}
                seen = {(row[setting], row[other]) for row in rows}
                assert seen == expected, f"{check}: ({setting}, {other}) pairs missing: {sorted(expected - seen)}"
    qlora = [
        row for row in instances if (row["file"], row["check"]) == ("test_workloads.py", "test_qlora_training_step")
    ]
    assert {(row["quant_storage"], row["dtype"]) for row in qlora} == set(product(storages, ["fp32", "fp16"]))
    generate = [row for row in instances if row["check"] == "test_generate"]
    assert {row["quant_storage"] for row in generate} == set(storages)
    hqq = [row for row in instances if row.get("format") == "hqq4"]
    assert hqq and all(row.get("quant_storage", "u8") == "u8" for row in hqq)
    assert all(row.get("call_form", "call-plain") != "call-as-quantized" for row in hqq)


# -- issue 51, item 3: the rows ladder, whatever a backend declares ------------------------------------------------


def test_the_rows_ladder_is_every_power_of_two_to_65536_with_its_neighbours() -> None:
    ladder = axes.AXES["rows_ladder"].claimed(BNB_AND_HQQ, True)
    expected = {r for k in range(17) for r in (2**k - 1, 2**k, 2**k + 1) if r >= 1}
    assert ladder == tuple(sorted(expected)) and len(ladder) == 47
    assert (ladder[0], ladder[-3:]) == (1, (65535, 65536, 65537))
    declared = Capabilities(("nf4",), (64,), False, (torch.float32,), ("cpu",), max_gemv_rows=16, dispatch_rows=(4,))
    assert axes.AXES["rows_ladder"].claimed(declared, True) == ladder, "the ladder does not follow declarations"


# The ladder's checks and the axes each must pair every rung with.
LADDER_CHECKS = {
    "test_matmul_rows_ladder": ("rows_ladder", "x_rank", "x_layout", "bias", "dtype", "format", "double_quant"),
    "test_backward_rows_ladder": ("rows_ladder", "x_rank", "dtype", "format", "double_quant"),
}


def test_every_rung_of_the_ladder_meets_every_layout_rank_bias_dtype_and_format(pytester: pytest.Pytester) -> None:
    """The real suites' ladder checks (each split in two: the rungs up to 2^12 + 1, and the top,
    large on a CPU) for a backend that declares its routes: every rung of ``ROWS_LADDER`` is
    paired with every value of every other path axis, whatever the declared rows (1, 3-5,
    16-18 here)."""
    pytester.makeconftest(ROUTES_CONFTEST)
    result = pytester.runpytest_subprocess(
        "--qconform", "--collect-only", "-q", "--qconform-backend=routes", "--qconform-large", "-k", "rows_ladder"
    )
    assert result.ret == pytest.ExitCode.OK, result.stdout.str()[-3000:]
    instances = json.loads((pytester.path / "instances.json").read_text())
    rungs = [axes.AXES["rows_ladder"].label(r) for r in axes.ROWS_LADDER]
    for check, ladder_axes in LADDER_CHECKS.items():
        rows = [row for row in instances if row["check"] in (check, f"{check}_top")]
        assert {row["rows_ladder"] for row in rows} == set(rungs), f"{check}: a rung is missing"
        seen = {(a, row[a], b, row[b]) for row in rows for a, b in combinations(ladder_axes, 2)}
        for b in ladder_axes[1:]:
            values = sorted({row[b] for row in rows})
            missing = [(r, v) for r, v in product(rungs, values) if ("rows_ladder", r, b, v) not in seen]
            assert not missing, f"{check}: no instance has (rows_ladder, {b}) = {missing[:5]}"


STRENGTHS = textwrap.dedent("""
    import pytest

    @pytest.mark.qconform_operation("toy")
    @pytest.mark.qconform_axes("blocksize", "double_quant", "dtype", "bias")
    def test_every_triple(qtarget, qbackend, spec, dtype, bias):
        pass

    @pytest.mark.qconform_operation("toy")
    @pytest.mark.qconform_thorough_strength(2)
    @pytest.mark.qconform_ci_strength(1)
    @pytest.mark.qconform_axes("blocksize", "double_quant", "dtype", "bias")
    def test_capped(qtarget, qbackend, spec, dtype, bias):
        pass
""")


def _instance_values(lines: list[str], test: str) -> list[tuple[str, ...]]:
    """The axis labels of each collected instance of ``test`` (its id without target and backend)."""
    ids = [line.split("[", 1)[1].rstrip("]") for line in lines if f"::{test}[" in line]
    return [tuple(i.split("-")[3:]) for i in ids]  # x86_64-claims-nf4-<blocksize>-[dq-]<dtype>-<bias>


def _covers(rows: list[tuple[str, ...]], t: int) -> bool:
    values = [sorted({row[a] for row in rows}) for a in range(len(rows[0]))]
    return all(
        any(all(row[a] == v for a, v in zip(combo, choice)) for row in rows)
        for combo in combinations(range(len(values)), t)
        for choice in product(*(values[a] for a in combo))
    )


@pytest.mark.parametrize("profile", ["ci", "thorough"])
def test_strength_markers_set_each_profiles_covering_strength(pytester: pytest.Pytester, profile: str) -> None:
    """Four two-valued axes (the double quantization label is ``dq`` or absent: read as ``plain``):
    ``ci`` covers all pairs, or each value once where ``qconform_ci_strength(1)`` says so;
    ``thorough`` every triple, or all pairs where ``qconform_thorough_strength(2)`` caps it
    (the rows ladder's and the loops' checks)."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_toy=STRENGTHS)
    result = pytester.runpytest(
        "--qconform",
        "test_toy.py",
        "--qconform-backend=claims",
        f"--qconform-profile={profile}",
        "--collect-only",
        "-q",
    )

    def rows(test: str) -> list[tuple[str, ...]]:
        return [r if len(r) == 4 else (r[0], "plain", *r[1:]) for r in _instance_values(result.stdout.lines, test)]

    every, capped = rows("test_every_triple"), rows("test_capped")
    if profile == "ci":
        assert _covers(every, 2) and not _covers(every, 3)
        assert _covers(capped, 1) and len(capped) == 2
    else:
        assert _covers(every, 3)
        assert _covers(capped, 2) and not _covers(capped, 3)
