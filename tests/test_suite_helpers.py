"""The suites' own helpers where they take a shortcut: the shortcut must answer as the
plain computation does."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pytest_qconform.suites._cases import has_distinct_at_least


@settings(max_examples=200, deadline=None)
@given(
    distinct=st.integers(1, 40),
    length=st.integers(1, 3000),
    count=st.integers(1, 60),
    seed=st.integers(0, 2**16),
)
def test_distinct_count_by_prefixes_agrees_with_unique(distinct, length, count, seed):
    """Prefixes first, the whole where they fall short: the same answer as ``torch.unique``
    of the whole, whether the distinct values come early, late or not at all."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(0, distinct, (length,), generator=gen).double() * 0.25
    if seed % 3 == 0:  # the new values only at the end: the prefixes hold one value
        values = torch.cat([torch.zeros(length), torch.arange(distinct).double()])
    assert has_distinct_at_least(values.reshape(-1, 1), count) == (torch.unique(values).numel() >= count)


@pytest.mark.parametrize(
    ("shape", "seed", "blocksize", "dtype", "rows"),
    [((64, 128), 2507, 128, torch.bfloat16, 128)],
    ids=["bf16-b128"],
)
def test_a_bf16_product_of_shared_scale_roundings_is_not_voted(shape, seed, blocksize, dtype, rows):
    """Issue 53's thorough-only verdicts, in numbers: the exact product of bitsandbytes' own
    weights, dequantized from a double-quantized absmax of an outliers weight, errs one way in
    more than 80% of 64 output columns (each distinct absmax is rounded once and shared by its
    blocks; an outlier is its block's absmax), so the matmul check votes a case only where the
    weight rounded once to the compute dtype gives balanced votes; that weight's product is
    biased here as bitsandbytes' is, and without double quantization neither is."""
    pytest.importorskip("bitsandbytes")
    from pytest_qconform.reference import bounds, faithful
    from pytest_qconform.suites.test_matmul import _rounded_weights_biased

    from pytest_qconform.backends import registry
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.strategies import WeightCase

    backend = registry.create("bitsandbytes")
    weight = WeightCase(shape, "outliers", seed).make()
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    x = x.to(dtype).double()
    for double_quant in (True, False):
        quantized = backend.quantize(weight, QuantSpec("nf4", blocksize, double_quant))
        w = faithful.decode(backend.export_packed(quantized), torch.device("cpu"))
        exact = x @ w.T
        own = x @ backend.dequantize(quantized, dtype).double().T  # no rounding but the weight's
        biased = bounds.rounding_direction_biased(own, exact, torch.arange(shape[0])) is not None
        assert biased == double_quant
        assert _rounded_weights_biased(x, w, None, dtype, exact, torch.arange(shape[0])) == double_quant


def test_a_product_whose_weight_roundings_lean_is_not_voted():
    """HQQ's CPU bf16 gemv on an ax0 zero_blocks weight (a default run's instance once the
    covering arrays became covertable's, 2026-11-28): the exact product of its weight rounded
    once to bf16 errs toward zero in 77% of 64 columns (under the vote's 80% limit, but 4.3
    standard deviations of a fair vote), and its correct result's last rounding takes that to
    81%. A baseline leaning more than three deviations is no set of independent units."""
    pytest.importorskip("hqq")
    from pytest_qconform.reference import faithful, linear
    from pytest_qconform.suites.test_matmul import _rounded_weights_biased

    from pytest_qconform.backends import registry
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.strategies import ActivationCase, WeightCase

    backend = registry.create("hqq")
    quantized = backend.quantize(WeightCase((64, 128), "zero_blocks", 0).make(), QuantSpec("hqq4", 128, False, axis=0))
    x = ActivationCase((1, 1), "transposed", 0).make(128, torch.bfloat16, torch.device("cpu"))
    w = faithful.decode(backend.export_packed(quantized), torch.device("cpu"))
    exact = linear.linear(x.double(), w, None)
    assert _rounded_weights_biased(x, w, None, torch.bfloat16, exact, torch.arange(64))


def test_distinct_scales_counts_block_ids_units():
    """bitsandbytes' count without expanding absmax to every element: the same as
    ``block_ids``' units, with and without double quantization."""
    pytest.importorskip("bitsandbytes")
    from pytest_qconform.suites._cases import block_ids, distinct_scales

    from pytest_qconform.backends import registry
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.strategies import WeightCase

    backend = registry.create("bitsandbytes")
    for double_quant in (False, True):
        packed = backend.export_packed(
            backend.quantize(WeightCase((64, 128), "outliers", 0).make(), QuantSpec("nf4", 64, double_quant))
        )
        assert distinct_scales(packed) == int(block_ids(packed).max()) + 1


def test_shared_scale_roundings_bias_the_columns_of_a_correct_product():
    """Issue 53's thorough-only verdict, in numbers: the exact product of bitsandbytes' own
    fp32 weights, dequantized from a double-quantized absmax, errs toward zero in 80% of 64
    output columns (its 48 distinct absmax values are each rounded once and shared by their
    blocks), so the columns are not independent units and the matmul check votes them only
    when the weight has at least as many distinct scales as columns; without double
    quantization (128 distinct fp32 absmax, stored exactly) the votes are balanced."""
    pytest.importorskip("bitsandbytes")
    from pytest_qconform.reference import bounds, faithful
    from pytest_qconform.suites._cases import distinct_scales

    from pytest_qconform.backends import registry
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.strategies import WeightCase

    backend = registry.create("bitsandbytes")
    weight = WeightCase((64, 128), "outliers", 0).make()
    x = torch.randn(300, 128, generator=torch.Generator().manual_seed(0), dtype=torch.float64).float().double()
    toward = {}
    for double_quant in (False, True):
        quantized = backend.quantize(weight, QuantSpec("nf4", 64, double_quant))
        packed = backend.export_packed(quantized)
        exact = x @ faithful.decode(packed, torch.device("cpu")).T
        product = x @ backend.dequantize(quantized, torch.float32).double().T  # no rounding but the weight's
        toward[double_quant] = (bounds.rounding_direction(product, exact, torch.arange(64))[0], distinct_scales(packed))
    assert toward[True][0] > bounds.ROUNDING_DIRECTION_LIMIT - 0.05 and toward[True][1] < 64
    assert abs(toward[False][0] - 0.5) < 0.15 and toward[False][1] >= 64


def test_columns_of_equal_weight_rows_are_one_rounding_unit():
    """An H200's thorough run (2026-11-29): HQQ's fp32 gemv on an ax0 zero_blocks weight voted
    81% of 64 columns toward zero, within its bound. Its first 32 rows decode to one row (each
    ax0 group spans both halves of the weight, and its zeros decode to the group's offset), so
    those 32 columns are one computation and err one way together. Counted as one unit, a
    result whose equal rows all err toward zero and whose other rows err both ways is
    balanced; counted by column, the same result is judged biased."""
    pytest.importorskip("hqq")
    from pytest_qconform.reference import bounds, faithful
    from pytest_qconform.suites._cases import weight_row_units

    from pytest_qconform.backends import registry
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.strategies import WeightCase

    backend = registry.create("hqq")
    quantized = backend.quantize(WeightCase((64, 128), "zero_blocks", 109522).make(), QuantSpec("hqq4", 128, axis=0))
    w = faithful.decode(backend.export_packed(quantized), torch.device("cpu"))
    units = weight_row_units(w)
    assert int(units.max()) + 1 == 33 and bool((units[:32] == units[0]).all())
    exact = torch.linspace(1.0, 2.0, 64, dtype=torch.float64)
    # The shared rows err toward zero, and 20 of the other 32: 52 of 64 columns (81%), 21 of 33 units (64%).
    toward = torch.tensor([-1.0] * 52 + [1.0] * 12, dtype=torch.float64)
    result = exact + toward * 1e-6
    assert bounds.rounding_direction_biased(result, exact, torch.arange(64)) is not None
    assert bounds.rounding_direction_biased(result, exact, units) is None


def test_the_round_trip_allows_what_the_code_check_calls_a_tie():
    """An H200's thorough run (2026-11-29): bitsandbytes' CUDA FP4 quantizer stored code 0 for
    a weight just past the midpoint between its codes 0 and 0.0052083 (its threshold literal
    0.00260417f lies 1.2e-6 relative above that midpoint). The code check calls such an
    element a tie; the round trip now allows it too, and still refuses the second-nearest code."""
    from pytest_qconform.reference import bnb4
    from pytest_qconform.suites._quantizer import _tie_mask, round_trip_bound

    table = torch.tensor(bnb4.code_table("fp4"), dtype=torch.float64)
    smallest = float(table[table > 0].min())
    absmax = torch.tensor([84.0], dtype=torch.float64)
    scaled = torch.tensor([-(smallest / 2) * (1 + 1e-6)], dtype=torch.float64)
    flat = scaled * absmax
    assert bool(_tie_mask(table, scaled).all())
    bound = round_trip_bound(table, flat, scaled, absmax, absmax)
    assert float((flat - 0.0).abs()) <= float(bound)  # the far code of the tie: 0
    assert float((flat - (-smallest) * absmax).abs()) <= float(bound)  # the near one
    second = float(table[(table > smallest) & (table < 0.2)].min())  # the next code out: 0.1667
    assert float((flat - (-second) * absmax).abs()) > float(bound)


def test_a_double_quantized_dequantize_into_fp32_has_no_independent_rounding_units():
    """Issue 53's last thorough-only verdict: triton-nf4's fp4-b128-dq dequantize into fp32,
    bit-identical to ``fp32(code * fp32 absmax)`` (the nested absmax decoded with fp32
    roundings, as bitsandbytes does), voted 82% of its blocks toward zero, and by decoded
    value bitsandbytes' own fp4-b1024-dq voted 86% away: in fp32 a block's errors share its
    absmax's roundings, so neither partition is independent and the check does not vote
    there. Into bf16 the blocks vote: rounding to nearest passes, truncation is refused."""
    import numpy as np
    from pytest_qconform.reference import bnb4, bounds, faithful
    from pytest_qconform.suites._cases import block_ids, dequantize_rounding_units

    from pytest_qconform.backends import registry
    from pytest_qconform.backends.spec import QuantSpec
    from pytest_qconform.cases.strategies import WeightCase

    backend = registry.create("triton-nf4")
    quantized = backend.quantize(WeightCase((4, 4096), "normal", 11087).make(), QuantSpec("fp4", 128, True))
    packed = backend.export_packed(quantized)
    out = backend.dequantize(quantized, torch.float32)
    exact = faithful.decode(packed, torch.device("cpu"))
    table = torch.tensor(np.asarray(packed.code, np.float32)).reshape(-1)
    codes = torch.tensor(bnb4.unpack_codes(packed.packed, exact.numel()).astype(np.int64))
    nested_codes = torch.tensor(np.asarray(packed.absmax).reshape(-1).astype(np.int64))
    assert nested_codes.numel() == 128 and packed.nested_blocksize == 256  # one nested group
    nested = torch.tensor(np.asarray(packed.nested_code, np.float32))[nested_codes]
    absmax = nested * float(np.asarray(packed.nested_absmax, np.float32).reshape(-1)[0]) + np.float32(packed.offset)
    assert torch.equal(out.reshape(-1), table[codes] * absmax.repeat_interleave(128))  # correct fp32 arithmetic
    assert bounds.rounding_direction_biased(out, exact, block_ids(packed)) is not None
    assert dequantize_rounding_units(packed, torch.float32) is None
    units = dequantize_rounding_units(packed, torch.bfloat16)
    assert torch.equal(units, block_ids(packed))
    nearest = exact.to(torch.bfloat16)
    toward_zero = exact.float().view(torch.int32).bitwise_and(~0xFFFF).view(torch.float32)  # bf16, truncated
    assert bounds.rounding_direction_biased(nearest, exact, units) is None
    assert bounds.rounding_direction_biased(toward_zero, exact, units) is not None
