"""Quantize: the backend's codes and absmax against the reference quantizer's.

bitsandbytes-layout formats quantize each element to the nearest code after scaling by
its block's absmax. Elements that sit on a tie (within fp32 rounding of the midpoint of
two codes) may go either way and are excluded from the code comparison; everything else
must match exactly. The round trip ``|w - decode(quantize(w))|`` must stay within half
the code gap the element fell into, times its block's absmax. Checked at every claimed
blocksize, both formats, with and without double quantization; HQQ at every group size
and axis, against the nearest levels of its own scale and zero (``_quantizer``).
"""

from __future__ import annotations

import pytest
from hypothesis import given

from pytest_qconform.cases.strategies import fewer_examples, listed_weight, weight_cases, with_examples

from ._cases import require_claim
from ._quantizer import check_codes_and_absmax, check_hqq_nearest_levels

pytestmark = pytest.mark.qconform_operation("quantize")

BNB_LAYOUT = ("nf4", "fp4")
# The weight's shape and distribution are axes (each pair with the spec is an instance) and
# the draws vary only the seed: an instance draws a third as often as the profile says.
SEED_DRAW_DIVISOR = 3


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "weight_shape", "distribution", format=BNB_LAYOUT)
def test_quantize_codes_and_absmax_match_reference(
    qtarget, qbackend, qdevice, qcheck, spec, weight_shape, distribution
):
    """The instance's weight shape and value distribution (all-zero and constant blocks
    scale by their own rules, a partial last block has its own absmax): listed with a fixed
    seed, then hypothesis' draws of seeds."""
    require_claim(qbackend, qtarget, spec)

    @with_examples([{"case": listed_weight(weight_shape, distribution)}])
    @fewer_examples(SEED_DRAW_DIVISOR)
    @given(case=weight_cases((weight_shape,), (distribution,)))
    def check(case):
        qcheck.describe(**case.describe())
        check_codes_and_absmax(qbackend, qcheck, spec, case.make(qdevice))

    check()


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", format=BNB_LAYOUT)
def test_quantize_every_claimed_blocksize(qtarget, qbackend, qdevice, qcheck, qprofile, spec):
    """Every claimed blocksize, both formats, with and without double quantization, on
    rows longer than a block, against the reference quantizer: a quantizer wrong only at large blocksizes decodes
    its own bytes consistently, so only this comparison sees it. Rows are two elements
    longer than a block (blocks start mid-row), and with double quantization there are
    more blocks than one nested group of 256 holds (257 rows) up to blocksize 512 (above
    it that takes a million elements: ``thorough`` only)."""
    require_claim(qbackend, qtarget, spec)
    many_groups = spec.double_quant and (spec.blocksize <= 512 or qprofile == "thorough")
    shape = (257 if many_groups else 3, spec.blocksize + 2)

    @fewer_examples()
    @given(case=weight_cases((shape,), ("normal", "outliers")))
    def check(case):
        qcheck.describe(**case.describe())
        check_codes_and_absmax(qbackend, qcheck, spec, case.make(qdevice))

    check()


@pytest.mark.qconform_axes(
    "format",
    "blocksize",
    "hqq_axis",
    "dtype",
    "weight_shape",
    "distribution",
    format=("hqq4",),
    distribution=("normal", "outliers", "heavy_tailed"),
)
def test_hqq_codes_are_the_nearest_levels(qtarget, qbackend, qdevice, qcheck, spec, dtype, weight_shape, distribution):
    """HQQ optimizes its zero point, so there is no reference for scale and zero; but
    given the stored ones, every code must be the nearest level, ``clamp(round(w / scale
    + zero), 0, 15)``, outside a band around the rounding ties as wide as the stored
    scale's and zero's rounding to the compute dtype (and to fp16, in which HQQ optimizes
    on a GPU) can move a level. Every group size and axis, each weight shape and
    distribution; hypothesis draws the seeds."""
    require_claim(qbackend, qtarget, spec, dtype)

    @fewer_examples()
    @given(case=weight_cases((weight_shape,), (distribution,)))
    def check(case):
        qcheck.describe(**case.describe())
        check_hqq_nearest_levels(qbackend, qcheck, spec, case.make(qdevice).to(dtype), qdevice)

    check()
