"""Matmul forward, the "silent wrong matmul": ``y = x W^T + b`` against float64.

The weight is the float64 decoding of the backend's own bytes, so only the matmul is
judged. Activations: every row count at which the backend changes route and its
neighbours (the gemv path, fused small-batch kernels, dequantize + GEMM), 2-D and 3-D
(batch and sequence), contiguous, transposed, sliced and offset views, with and without
bias, in every claimed dtype; and fp32 activations into a low-precision layer, as PEFT's
k-bit preparation produces them. Each of those, the weight's shape and its distribution
select a path in some backend, so each is an axis of the checks' covering arrays
(``cases.axes``): every pair of them is reached on every arch. Hypothesis draws seeds.
A crash is a failed cell with its message.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from pytest_qconform.reference import bounds, comparative, linear

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
    SMALL_BATCH_SHAPES,
    distinct_scales,
    dtype_id,
    has_distinct_at_least,
    output_columns,
    reference_decode,
    require_claim,
    weight_error,
)

MATMUL_DISTRIBUTIONS = ("normal", "outliers", "zero_blocks")  # the distribution axis' values here
# The axes of the activation and the bias, which select a matmul's route and its kernel's
# specialization: every pair of their values (and with the spec's and the dtype) is an instance.
ACTIVATION_AXES = ("rows", "x_rank", "x_layout", "bias")
# The path axes multiply the instances of the checks that draw (2.5 to 3 times): each
# instance draws a third as often, so the checks' draws stay about as many in all.
DRAW_DIVISOR = 3
# Besides its own path, every instance of the matmul check runs this case in its layout:
# 5 rows on a normal 64 x 128 weight with a bias, enough output columns for the rounding-
# direction test to see a systematic error of the documented size (docs/sensitivity.md) in
# every cell, whatever the instance's rows and weight (one row of a one-row weight has one
# output). Fixed, so the same on every arch.
SENSITIVITY_LEADING, SENSITIVITY_SHAPE = (5,), (64, 128)


def check_matmul(qbackend, qdevice, qcheck, spec, compute_dtype, x_dtype, case, act, with_bias) -> None:
    qcheck.describe(**case.describe())
    quantized = qbackend.quantize(case.make(qdevice), spec)
    check_product(qbackend, qdevice, qcheck, compute_dtype, x_dtype, quantized, act, with_bias)


def _rounded_weights_biased(x, w_exact, b_exact, compute_dtype, y_exact, units) -> bool:
    """Whether the weight's own roundings, shared between columns, already point one way: the
    exact product of the weight rounded once to the compute dtype (as torch's dense op has it)
    voted as the result is. Then the columns are no independent units for this case."""
    rounded = linear.linear(x.double(), w_exact.to(compute_dtype).double(), b_exact)
    return bounds.rounding_direction_biased(rounded, y_exact, units) is not None


def check_product(qbackend, qdevice, qcheck, compute_dtype, x_dtype, quantized, act, with_bias) -> None:
    """One matmul of a quantized weight against float64 ``x W^T + b``.

    Its rounding direction is voted by output columns (round to nearest errs both ways over
    independent units) only where the weight's own roundings are not shared between them: a
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
    y = qbackend.matmul(x, quantized, bias, compute_dtype)
    qcheck.equal(y.dtype, x_dtype, "matmul output dtype (the activation's dtype)")
    packed = qbackend.export_packed(quantized)
    w_exact = reference_decode(packed, qdevice)
    b_exact = bias.double() if bias is not None else None
    y_exact = linear.linear(x.double(), w_exact, b_exact)
    rows = x.numel() // k
    w_error = weight_error(packed, w_exact, compute_dtype, rows=rows)
    bound = bounds.matmul_bound(x.double(), w_exact, b_exact, compute_dtype, y.dtype, w_error=w_error, exact=y_exact)
    # Columns are independent rounding units where no weight rounding is shared (the docstring).
    shared_scales = compute_dtype == torch.float32 and distinct_scales(packed) < y.shape[-1]
    independent = (
        has_distinct_at_least(w_exact.abs(), y.shape[-1])
        and not shared_scales
        and not _rounded_weights_biased(x, w_exact, b_exact, compute_dtype, y_exact, output_columns(y))
    )
    qcheck.within(
        y,
        y_exact,
        bound,
        "matmul vs float64 x W^T + b",
        rounding_units=output_columns(y) if independent else None,
    )
    # Beside the worst-case bound: no less accurate than torch's own F.linear on the same decoded
    # weights in the same dtypes (reference.comparative: a reduced-precision accumulator passes the
    # bound), allowing the format's own decode roundings (the dequantize model of E, not the gemv's).
    decode_error = w_error if rows != 1 else weight_error(packed, w_exact, compute_dtype)  # not the gemv's model
    found = comparative.comparative_linear(y, x, w_exact, b_exact, y_exact, compute_dtype, w_error=decode_error)
    qcheck.comparative(found, "matmul vs float64 x W^T + b")


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
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype", *ACTIVATION_AXES)
def test_matmul_every_route(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows, x_rank, x_layout, bias):
    """Every row count at which the backend declares a change of route
    (``Capabilities.dispatch_rows``, ``max_gemv_rows``), its neighbours, one row, 128 rows
    and a prefill, on a weight whose rows the fused kernels take (``SMALL_BATCH_SHAPES``),
    each row count in every activation layout and rank, with and without bias (a fused
    kernel reads x through its strides and alignment, and may take another kernel when it
    cannot); fixed seeds."""
    require_claim(qbackend, qtarget, spec, dtype)
    case = WeightCase(SMALL_BATCH_SHAPES.get(qdevice.type, SMALL_BATCH_SHAPES["cpu"]), "normal", seed=17)
    act = ActivationCase(activation_leading(rows, x_rank), x_layout, rows)
    check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, act, bias)


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
