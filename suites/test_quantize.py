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

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.strategies import fewer_examples, weight_cases

from ._cases import DTYPES, EXTRA_BLOCKSIZES, SPECS, dtype_id, require_claim, shapes_for, spec_id
from ._quantizer import check_codes_and_absmax, check_hqq_nearest_levels

pytestmark = pytest.mark.qconform_operation("quantize")

BNB_SPECS = tuple(s for s in SPECS if s.format in ("nf4", "fp4"))
EVERY_BLOCKSIZE_SPECS = tuple(QuantSpec(fmt, bs, dq) for fmt in ("nf4", "fp4") for bs in EXTRA_BLOCKSIZES
                              for dq in (False, True))
HQQ_SPECS = tuple(QuantSpec("hqq4", group, axis=axis) for group in (32, 64, 128) for axis in (1, 0))


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.parametrize("spec", BNB_SPECS, ids=spec_id)
def test_quantize_codes_and_absmax_match_reference(qtarget, qbackend, qdevice, qcheck, spec):
    require_claim(qbackend, qtarget, spec)

    @given(case=weight_cases(shapes_for(spec)))
    def check(case):
        qcheck.describe(**case.describe())
        check_codes_and_absmax(qbackend, qcheck, spec, case.make(qdevice))

    check()


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.parametrize("spec", EVERY_BLOCKSIZE_SPECS, ids=spec_id)
def test_quantize_every_claimed_blocksize(qtarget, qbackend, qdevice, qcheck, qprofile, spec):
    """The blocksizes beyond 64/128, both formats, with and without double quantization,
    against the reference quantizer: a quantizer wrong only at large blocksizes decodes
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


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", HQQ_SPECS, ids=spec_id)
def test_hqq_codes_are_the_nearest_levels(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """HQQ optimizes its zero point, so there is no reference for scale and zero; but
    given the stored ones, every code must be the nearest level, ``clamp(round(w / scale
    + zero), 0, 15)``, outside a band around the rounding ties as wide as the stored
    scale's and zero's rounding to the compute dtype (and to fp16, in which HQQ optimizes
    on a GPU) can move a level. Every group size and axis."""
    require_claim(qbackend, qtarget, spec, dtype)

    @fewer_examples()
    @given(case=weight_cases(shapes_for(spec), ("normal", "outliers", "heavy_tailed")))
    def check(case):
        qcheck.describe(**case.describe())
        check_hqq_nearest_levels(qbackend, qcheck, spec, case.make(qdevice).to(dtype), qdevice)

    check()
