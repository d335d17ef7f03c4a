"""Dequantize: the backend's output against the float64 decoding of its own bytes.

Output dtype and shape are part of the contract. Inputs cover NF4 and FP4, blocksizes
32 to 4096 (64 and 128 always), double quantization on and off, bf16/fp16/fp32 outputs,
element counts that are not a multiple of the blocksize, odd counts and single blocks.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.cases.strategies import WeightCase, fewer_examples, listed_weight, weight_cases, with_examples

from ._cases import (
    SIZES_LARGE_ON,
    claimed_real_sizes,
    dequantize_rounding_units,
    packed_dequantize_bound,
    reference_decode,
    require_claim,
)
from ._quantizer import check_source_quantization

pytestmark = pytest.mark.qconform_operation("dequantize")
# The weight's shape and distribution are axes: every pair of them with the spec and the
# dtype is an instance, and the draws vary only the seed, so an instance draws a third as
# often as the profile says (bitsandbytes compiles its CPU dequantize for each new pair of
# shape and blocksize, which every instance now meets by construction).
SEED_DRAW_DIVISOR = 3


def check_dequantize(
    qbackend, qdevice, qcheck, spec: QuantSpec, dtype: torch.dtype, case, source_truth: bool = False
) -> None:
    """Dequantize against the float64 decoding of the backend's own bytes; with ``source_truth``
    the bytes are also checked to be the weight's quantization (``check_source_quantization``):
    a quantizer wrong at some size decodes its own bytes consistently."""
    qcheck.describe(**case.describe())
    weight = case.make(qdevice)
    quantized = qbackend.quantize(weight, spec)
    if source_truth:
        check_source_quantization(qbackend, qcheck, spec, weight, qdevice, quantized)
    out = qbackend.dequantize(quantized, dtype)
    qcheck.equal(out.dtype, dtype, "dequantize output dtype")
    qcheck.equal(tuple(out.shape), tuple(case.shape), "dequantize output shape")
    packed = qbackend.export_packed(quantized)
    exact = reference_decode(packed, qdevice)
    qcheck.within(
        out,
        exact,
        packed_dequantize_bound(packed, exact, dtype),
        "dequantize vs reference decoding",
        rounding_units=dequantize_rounding_units(packed, dtype),
    )


@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "hqq_axis", "dtype", "weight_shape", "distribution")
def test_dequantize_matches_reference_bytes(
    qtarget, qbackend, qdevice, qcheck, spec, dtype, weight_shape, distribution
):
    """The instance's weight shape and value distribution (zero and constant blocks,
    subnormals, values near fp16's maximum take their own paths; whole, partial and single
    blocks theirs): listed with a fixed seed, then hypothesis' draws of other seeds."""
    require_claim(qbackend, qtarget, spec, dtype, dequantize=True)

    @with_examples([{"case": listed_weight(weight_shape, distribution)}])
    @fewer_examples(SEED_DRAW_DIVISOR)
    @given(case=weight_cases((weight_shape,), (distribution,)))
    def check(case):
        check_dequantize(qbackend, qdevice, qcheck, spec, dtype, case)

    check()


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", format=("nf4", "fp4"))
def test_dequantize_blocksize_range(qtarget, qbackend, qdevice, qcheck, spec):
    """Every claimed blocksize into fp32, on rows of 4096, which hold a whole number of
    blocks of every blocksize up to 4096: this checks the blocksize alone; rows that
    straddle blocks are ``test_dequantize_rows_straddle_blocks``."""
    require_claim(qbackend, qtarget, spec, torch.float32, dequantize=True)

    @fewer_examples()
    @given(case=weight_cases(((4, 4096),), ("normal", "outliers")))
    def check(case):
        check_dequantize(qbackend, qdevice, qcheck, spec, torch.float32, case)

    check()


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", format=("nf4", "fp4"))
def test_dequantize_rows_straddle_blocks(qtarget, qbackend, qdevice, qcheck, spec):
    """bitsandbytes blocks run over the flattened tensor, so with rows of 1.5 blocks
    (4 x 96 at blocksize 64) every other block starts mid-row. A kernel that indexes
    absmax per row instead reads the wrong scale for half the elements."""
    require_claim(qbackend, qtarget, spec, torch.float32, dequantize=True)
    row = spec.blocksize * 3 // 2

    @fewer_examples()
    @given(case=weight_cases(((4, row),), ("normal",)))
    def check(case):
        check_dequantize(qbackend, qdevice, qcheck, spec, torch.float32, case)

    check()


@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")
def test_dequantize_real_sizes(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """The widths real calls reach (``_cases.LONG_K_SHAPE``: K = 14336; ``WIDE_N_SHAPE``: N =
    151936, 9.7 M elements), each where claimed: a row-wise kernel's K loop, a grid over
    blocks or rows, an element index past 2^17 or 2^23. In the default run on a GPU; ``large``
    on a CPU (HQQ's quantizer takes 4-7 s at the wide weight there, Triton's interpreter claims
    no weight that wide)."""
    caps = require_claim(qbackend, qtarget, spec, dtype, dequantize=True)
    for shape in claimed_real_sizes(caps, spec):
        case = WeightCase(shape, "normal", seed=shape[0] + shape[1])
        check_dequantize(qbackend, qdevice, qcheck, spec, dtype, case, source_truth=True)
