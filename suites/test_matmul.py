"""Matmul forward, the "silent wrong matmul": ``y = x W^T + b`` against float64.

The weight is the float64 decoding of the backend's own bytes, so only the matmul is
judged. Activations: every row count at which the backend changes route and its
neighbours (the gemv path, fused small-batch kernels, dequantize + GEMM), 2-D and 3-D
(batch and sequence), contiguous, transposed, sliced and offset views, with and without
bias, in every claimed dtype; and fp32 activations into a low-precision layer, as PEFT's
k-bit preparation produces them. Each of those, the weight's shape and its distribution
select a path in some backend, and so do the settings users pass (the packed storage dtype,
double quantization, the call's argument form: ``out=``, another orientation of the packed
weight), so each is an axis of the checks' covering arrays (``cases.axes``): every pair of
them is reached on every arch (the settings' in the route check). Hypothesis draws seeds.
A crash is a failed cell with its message. Sizes real runs reach (issue 51): whatever the
backend declares, every power of two of rows up to 65536 and its neighbours (the rows
ladder, on a narrow weight), K = 14336 at every route, and the widths of real lm_heads.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pytest_qconform.reference import bounds, comparative, linear

from pytest_qconform.cases.axes import OUT_CALL, PLAIN_CALL
from pytest_qconform.cases.strategies import (
    ActivationCase,
    WeightCase,
    activation_cases,
    activation_leading,
    fewer_examples,
    listed_weight,
    weight_cases,
    with_examples,
)

from ._cases import (
    LADDER_LOW,
    LADDER_SHAPE,
    LADDER_TOP,
    LONG_K_SHAPE,
    PREFILL_JUDGED_ROWS,
    SIZES_LARGE_ON,
    SMALL_BATCH_SHAPES,
    distinct_scales,
    dtype_id,
    has_distinct_at_least,
    prefill_at_long_k_rows,
    reference_decode,
    require_claim,
    row_slices,
    weight_error,
    weight_row_units,
)

MATMUL_DISTRIBUTIONS = ("normal", "outliers", "zero_blocks")  # the distribution axis' values here
# The axes of the activation and the bias, which select a matmul's route and its kernel's
# specialization: every pair of their values (and with the spec's and the dtype) is an instance.
ACTIVATION_AXES = ("rows", "x_rank", "x_layout", "bias")
# The settings a user passes besides the spec's (whose storage dtype and double quantization
# are spec axes): the call's argument form. In the route check, where every pair of a form
# with a route, a layout and a dtype is an instance.
SETTING_AXES = ("call_form",)
# The path axes multiply the instances of the checks that draw (2.5 to 3 times): each
# instance draws a third as often, so the checks' draws stay about as many in all.
DRAW_DIVISOR = 3
# Besides its own path, every instance of the matmul check runs this case in its layout:
# 5 rows on a normal 64 x 128 weight with a bias, enough output columns for the rounding-
# direction test to see a systematic error of the documented size (docs/sensitivity.md) in
# every cell, whatever the instance's rows and weight (one row of a one-row weight has one
# output). Fixed, so the same on every arch.
SENSITIVITY_LEADING, SENSITIVITY_SHAPE = (5,), (64, 128)


def check_matmul(
    qbackend,
    qdevice,
    qcheck,
    spec,
    compute_dtype,
    x_dtype,
    case,
    act,
    with_bias,
    call_form=PLAIN_CALL,
    judged_rows: int | None = None,
    calls: int = 1,
) -> None:
    """The weight ``case`` quantized with ``spec``, multiplied by ``act`` and judged
    (``check_product``); with ``calls`` > 1, multiplied again by activations of the same
    layout and new values (the seed plus the call's number), each call judged: what a backend
    keeps per weight and layout between calls (plans, bound launches, encoded descriptors,
    staging buffers) must read each call's x."""
    qcheck.describe(**case.describe())
    quantized = qbackend.quantize(case.make(qdevice), spec)
    for call in range(calls):
        again = dataclasses.replace(act, seed=act.seed + call)
        if calls > 1:
            qcheck.describe(call=call + 1)
        check_product(
            qbackend, qdevice, qcheck, compute_dtype, x_dtype, quantized, again, with_bias, call_form, judged_rows
        )


def form_claim(call_form: str) -> dict[str, str]:
    """What ``require_claim`` is asked for a call form (``axes.call_form``)."""
    if call_form == PLAIN_CALL:
        return {}
    return {"out": "matmul"} if call_form == OUT_CALL else {"orientation": call_form}


def matmul_in_form(qbackend, qcheck, x, quantized, bias, compute_dtype, call_form: str):
    """``x W^T + b`` in one of the argument forms the API documents (``axes.call_form``): the
    plain ``matmul``; into an ``out=`` buffer of the compute dtype, NaN before the call (a value
    never written shows), which the call must return; or the packed weight handed over in
    another documented orientation (``Backend.matmul_with``)."""
    if call_form == PLAIN_CALL:
        return qbackend.matmul(x, quantized, bias, compute_dtype)
    if call_form == OUT_CALL:
        out = torch.full((*x.shape[:-1], quantized.shape[0]), float("nan"), dtype=compute_dtype, device=x.device)
        with torch.no_grad():  # out= is for inference
            y = qbackend.matmul_with(x, quantized, bias, compute_dtype, out=out)
        qcheck.equal(y.data_ptr() == out.data_ptr(), True, "matmul returned the out= buffer")
        return out
    return qbackend.matmul_with(x, quantized, bias, compute_dtype, orientation=call_form)


def _rounded_weights_biased(x, w_exact, b_exact, compute_dtype, y_exact, units) -> bool:
    """Whether the weight's own roundings, shared between columns, already point one way: the
    exact product of the weight rounded once to the compute dtype (as torch's dense op has it)
    voted as the result is. Then the columns are no independent units for this case."""
    rounded = linear.linear(x.double(), w_exact.to(compute_dtype).double(), b_exact)
    toward, away, n = bounds.rounding_direction(rounded, y_exact, units)
    # Leaning more than three standard deviations of a fair vote (0.5 / sqrt(n)) already: the
    # vote's own limit (80% of 64, 4.8 deviations) would leave a weight whose roundings lean
    # 77% free to be pushed past it by a correct product's last rounding (HQQ's CPU bf16 gemv
    # on an ax0 zero_blocks weight: 77% from its weight, 81% in its result; tests/test_suite_helpers.py).
    return n > 0 and max(toward, away) > 0.5 + 1.5 / math.sqrt(n)


def check_product(
    qbackend,
    qdevice,
    qcheck,
    compute_dtype,
    x_dtype,
    quantized,
    act,
    with_bias,
    call_form=PLAIN_CALL,
    judged_rows: int | None = None,
) -> None:
    """One matmul of a quantized weight against float64 ``x W^T + b`` (``judged_rows``: the
    one call judged that many rows at a time, its float64 reference and bound a slice each).

    Its rounding direction is voted by output columns (round to nearest errs both ways over
    independent units; columns of equal weight rows are one unit, ``weight_row_units``) only where the weight's own roundings are not shared between them: a
    weight of fewer distinct magnitudes than columns (FP4 at blocksize 4096: 8 codes x 2
    scales) rounds the same few values in every column, and a double-quantized absmax is
    decoded (code * nested absmax + offset) and rounded once per distinct value, shared by
    every block of that value, which moves their columns' outputs the same way wherever those
    elements dominate a column (an fp32 product; outliers, which are their blocks' absmax).
    So an fp32 product of a weight with fewer distinct scales than columns is not voted, and
    otherwise the exact product of the weight rounded once to the compute dtype is voted first,
    and the result only where that product's votes are balanced. Thorough runs found both: an
    H200's nf4-b64-dq fp32 on a W64x128 outliers weight voted 88% of 64 columns toward zero
    (the exact product of bitsandbytes' own fp32 weights: 80%, 48 distinct scales), and this
    CPU's nf4-b128-dq bf16 on another voted 83% away (its own bf16 weights' product: 81%, 38
    scales; issue 53, tests/test_suite_helpers.py). The anchor case of every instance (a normal
    64 x 128 weight) keeps its vote: the truncating mutant (``TruncatingBf16Matmul``) and the
    documented threshold (tests/test_mutant_zoo.py) are still caught."""
    qcheck.describe(**act.describe(), bias=with_bias, x_dtype=dtype_id(x_dtype))
    n, k = quantized.shape
    x = act.make(k, x_dtype, qdevice)
    bias = (
        torch.randn(n, generator=torch.Generator().manual_seed(act.seed)).to(compute_dtype).to(qdevice)
        if with_bias
        else None
    )
    y = matmul_in_form(qbackend, qcheck, x, quantized, bias, compute_dtype, call_form)
    qcheck.equal(y.dtype, x_dtype, "matmul output dtype (the activation's dtype)")
    packed = qbackend.export_packed(quantized)
    w_exact = reference_decode(packed, qdevice)
    rows = x.numel() // k
    slices = row_slices(rows, judged_rows)
    if len(slices) == 1:  # x and y as the call had them (their rank and layout)
        judge_product(qcheck, packed, w_exact, x, y, bias, compute_dtype, rows)
        return
    x2, y2 = x.reshape(rows, k), y.reshape(rows, n)
    for first, stop, where in slices:
        judge_product(qcheck, packed, w_exact, x2[first:stop], y2[first:stop], bias, compute_dtype, rows, where)


def judge_product(qcheck, packed, w_exact, x, y, bias, compute_dtype, rows: int, where: str = "") -> None:
    """``y`` (the backend's product of ``x`` and the weight ``packed``, decoded exactly as
    ``w_exact``) against float64 ``x W^T + b``: the bound, the rounding direction where the
    columns are independent units, and torch's own ``F.linear`` (``check_product``'s
    docstring). ``rows``: the call's rows, which choose bitsandbytes' weight model; x and y
    may be a slice of them (``where`` names it)."""
    b_exact = bias.double() if bias is not None else None
    y_exact = linear.linear(x.double(), w_exact, b_exact)
    w_error = weight_error(packed, w_exact, compute_dtype, rows=rows)
    bound = bounds.matmul_bound(x.double(), w_exact, b_exact, compute_dtype, y.dtype, w_error=w_error, exact=y_exact)
    # Columns are independent rounding units where no weight rounding is shared (the docstring).
    shared_scales = compute_dtype == torch.float32 and distinct_scales(packed) < y.shape[-1]
    units = weight_row_units(w_exact)
    independent = (
        has_distinct_at_least(w_exact.abs(), y.shape[-1])
        and not shared_scales
        and not _rounded_weights_biased(x, w_exact, b_exact, compute_dtype, y_exact, units)
    )
    what = f"matmul vs float64 x W^T + b{where}"
    qcheck.within(y, y_exact, bound, what, rounding_units=units if independent else None)
    # Beside the worst-case bound: no less accurate than torch's own F.linear on the same decoded
    # weights in the same dtypes (reference.comparative: a reduced-precision accumulator passes the
    # bound), allowing the format's own decode roundings (the dequantize model of E, not the wider
    # one of bitsandbytes' fused kernels).
    decode_error = weight_error(packed, w_exact, compute_dtype)
    found = comparative.comparative_linear(y, x, w_exact, b_exact, y_exact, compute_dtype, w_error=decode_error)
    qcheck.comparative(found, what)


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_axes(
    "format",
    "blocksize",
    "double_quant",
    "hqq_axis",
    "dtype",
    "weight_shape",
    "distribution",
    *ACTIVATION_AXES,
    distribution=MATMUL_DISTRIBUTIONS,
)
def test_matmul_matches_reference(
    qtarget, qbackend, qdevice, qcheck, spec, dtype, weight_shape, distribution, rows, x_rank, x_layout, bias
):
    """The instance's weight (shape and distribution) and activation (rows, rank, memory
    layout) with or without bias: listed with fixed seeds, then the sensitivity case in the
    instance's layout (``SENSITIVITY_SHAPE``), then hypothesis' draws of seeds."""
    require_claim(qbackend, qtarget, spec, dtype)
    listed = listed_weight(weight_shape, distribution)
    leading = activation_leading(rows, x_rank)
    anchor = listed_weight(SENSITIVITY_SHAPE, "normal")

    @with_examples(
        [
            {"case": listed, "act": ActivationCase(leading, x_layout, listed.seed), "with_bias": bias},
            {"case": anchor, "act": ActivationCase(SENSITIVITY_LEADING, x_layout, anchor.seed), "with_bias": True},
        ]
    )
    @fewer_examples(DRAW_DIVISOR)
    @given(
        case=weight_cases((weight_shape,), (distribution,)),
        act=activation_cases(leading, x_layout),
        with_bias=st.just(bias),
    )
    def check(case, act, with_bias):
        check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, act, with_bias)

    check()


@pytest.mark.qconform_operation("matmul-fp32-input")
@pytest.mark.qconform_axes(
    "format",
    "blocksize",
    "double_quant",
    "hqq_axis",
    "dtype",
    "weight_shape",
    *ACTIVATION_AXES,
    dtype=(torch.bfloat16, torch.float16),
)
def test_matmul_fp32_activation_into_low_precision_layer(
    qtarget, qbackend, qdevice, qcheck, spec, dtype, weight_shape, rows, x_rank, x_layout, bias
):
    """PEFT's prepare_model_for_kbit_training upcasts activations to fp32 ahead of a
    bf16/fp16-compute 4-bit layer; the layer must compute, and return fp32. The instance's
    weight shape and activation, a normal weight of a fixed seed (no draws: the route is the
    instance's, and the matmul check draws values)."""
    require_claim(qbackend, qtarget, spec, dtype)
    case = listed_weight(weight_shape, "normal")
    act = ActivationCase(activation_leading(rows, x_rank), x_layout, case.seed)
    check_matmul(qbackend, qdevice, qcheck, spec, dtype, torch.float32, case, act, bias)


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_axes(
    "format", "double_quant", "hqq_axis", "quant_storage", "dtype", *ACTIVATION_AXES, *SETTING_AXES
)
def test_matmul_every_route(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows, x_rank, x_layout, bias, call_form):
    """Every row count at which the backend declares a change of route
    (``Capabilities.dispatch_rows``, ``max_gemv_rows``), its neighbours, one row, 128 rows
    and a prefill, on a weight whose rows the fused kernels take (``SMALL_BATCH_SHAPES``),
    each row count in every activation layout and rank, with and without bias (a fused
    kernel reads x through its strides and alignment, and may take another kernel when it
    cannot), and with the settings users set: the packed storage dtype (the spec's
    ``quant_storage``: FSDP-QLoRA stores the bytes as bf16), double quantization, the compute
    dtype, and the call's argument form (``call_form``: plain, ``out=``, another orientation of
    the packed weight); every pair of all these is an instance. Each weight is called twice,
    the second time with a new activation of the same layout, as a layer is (a route's state
    kept from the first call must not answer the second). Fixed seeds."""
    require_claim(qbackend, qtarget, spec, dtype, **form_claim(call_form))
    case = WeightCase(SMALL_BATCH_SHAPES.get(qdevice.type, SMALL_BATCH_SHAPES["cpu"]), "normal", seed=17)
    act = ActivationCase(activation_leading(rows, x_rank), x_layout, rows)
    qcheck.describe(call_form=call_form, quant_storage=str(spec.quant_storage))
    check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, act, bias, call_form, calls=2)


LM_HEAD_K = 64  # a small K keeps a 151936-wide weight cheap; a block spans rows once the blocksize passes it
LM_HEAD_MAX_ROWS = 128  # the rows axis up to here (a filter: the values are the backend's)


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_axes(
    "format",
    "double_quant",
    "hqq_axis",
    "dtype",
    "out_features",
    "rows",
    # Every route the backend declares (each threshold and its neighbours) and 128 rows
    # (axes.ALWAYS_ROWS): a grid or tile that breaks at a wide N breaks on one route. The
    # prefill of 300 rows is left out: at 151936 columns its float64 reference and bound are
    # 45 M elements each, seconds an instance on a CPU, and its route is the 128 rows' one.
    rows=tuple(range(1, LM_HEAD_MAX_ROWS + 1)),
)
def test_matmul_lm_head_widths(qtarget, qbackend, qdevice, qcheck, spec, dtype, out_features, rows):
    """The output widths of real lm_heads (``axes.LM_HEAD_WIDTHS``), at the instance's row
    count: grids, index arithmetic and a last partial tile at N that no drawn shape reaches.
    x is 2-D and contiguous, with a bias, in every instance (the same on every arch): an
    instance at these widths costs seconds on a CPU, and layouts, ranks and the bias meet
    every route in ``test_matmul_every_route``."""
    require_claim(qbackend, qtarget, spec, dtype)
    case = WeightCase((out_features, LM_HEAD_K), "normal", seed=out_features)
    check_matmul(
        qbackend, qdevice, qcheck, spec, dtype, dtype, case, ActivationCase((rows,), "contiguous", rows), with_bias=True
    )


def check_rows_ladder(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows, x_rank, x_layout, bias) -> None:
    """One rung of the rows ladder: ``rows`` rows of the instance's rank and layout, with or
    without bias, on ``LADDER_SHAPE``; fixed seeds."""
    require_claim(qbackend, qtarget, spec, dtype)
    case = WeightCase(LADDER_SHAPE, "normal", seed=19)
    act = ActivationCase(activation_leading(rows, x_rank), x_layout, rows)
    check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, act, bias)


# The axes of the rows ladder's checks: the rung, paired with every format, dtype and activation axis.
LADDER_AXES = ("format", "double_quant", "hqq_axis", "dtype", "rows_ladder", "x_rank", "x_layout", "bias")


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_thorough_strength(2)  # 47 rungs x every pair of the others
@pytest.mark.qconform_axes(*LADDER_AXES, rows_ladder=LADDER_LOW)
def test_matmul_rows_ladder(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank, x_layout, bias):
    """Every power of two of rows and its neighbours (``axes.ROWS_LADDER``) up to 2^12 + 1,
    whatever the backend declares: a kernel that a library switches to at a row count its
    adapter does not declare (a batch tier, a GEMM path) is reached, each rung paired with
    every dtype, format, layout, rank and bias. The declared routes are
    ``test_matmul_every_route``'s; this check makes no use of them. A narrow weight
    (``LADDER_SHAPE``)."""
    check_rows_ladder(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank, x_layout, bias)


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_thorough_strength(2)  # 47 rungs x every pair of the others
@pytest.mark.qconform_axes(*LADDER_AXES, rows_ladder=LADDER_TOP)
def test_matmul_rows_ladder_top(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank, x_layout, bias):
    """The ladder's rungs from 2^13 - 1 to 2^16 + 1: a QLoRA batch of 8 x 8192 tokens in one
    call, and a kernel whose grid puts rows on a dimension capped at 65535. In the default
    run on a GPU; ``large`` on a CPU, where these rungs are most of the ladder's time
    (``_cases.LADDER_SPLIT``)."""
    check_rows_ladder(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank, x_layout, bias)


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype", "rows")
def test_matmul_long_k(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows):
    """K = 14336 (``LONG_K_SHAPE``) at every route the backend declares, its neighbours, 1,
    128 and 300 rows: a K-loop, a split-K's partial sums or an accumulator that breaks past
    the K of the drawn and listed weights (at most 4104 on a GPU). x 2-D and contiguous with
    a bias (layouts meet every route in ``test_matmul_every_route``). In the default run on a
    GPU; ``large`` on a CPU (Triton's interpreter runs the rows kernels at about 1 s per
    10^5 weights, and bitsandbytes compiles a kernel per new shape)."""
    require_claim(qbackend, qtarget, spec, dtype)
    case = WeightCase(LONG_K_SHAPE, "normal", seed=14336)
    check_matmul(
        qbackend, qdevice, qcheck, spec, dtype, dtype, case, ActivationCase((rows,), "contiguous", rows), with_bias=True
    )


@pytest.mark.qconform_operation("matmul")
@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_heavy
@pytest.mark.qconform_ci_strength(1)  # each value once: 5-10 s an instance on an H200
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")
def test_matmul_prefill_at_long_k(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """65536 rows at K = 14336 in one call (``_cases.PREFILL_ROWS``, ``LONG_K_SHAPE``): a QLoRA
    batch of 8 x 8192 tokens through an MLP's down projection, where the rows' grid dimension
    and the K loop meet; each alone is reached by the rows ladder and ``test_matmul_long_k``.
    ``large`` on a GPU; not claimed on a CPU."""
    require_claim(qbackend, qtarget, spec, dtype)
    rows = prefill_at_long_k_rows(qdevice)
    case = WeightCase(LONG_K_SHAPE, "normal", seed=14336)
    act = ActivationCase((rows,), "contiguous", rows)
    check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, act, True, judged_rows=PREFILL_JUDGED_ROWS)
