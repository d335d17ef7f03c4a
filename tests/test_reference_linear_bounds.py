"""The float64 linear layer and the error bounds.

Each bound is checked two ways: real low-precision arithmetic (torch's own rounding and
matmuls on CPU) stays within it, and it is not vacuous (a result off by a little more
than the arithmetic allows fails it).
"""

from __future__ import annotations

import math

import pytest
import torch
from pytest_qconform.reference import bounds, linear
from pytest_qconform.reference.packed import PackedHqq4

LOW = (torch.float32, torch.bfloat16, torch.float16)


# --- linear ------------------------------------------------------------------------


def test_linear_by_hand_with_bias_and_leading_dims():
    x = torch.tensor([[[1.0, 2.0]], [[3.0, -1.0]]])  # (2, 1, 2)
    w = torch.tensor([[1.0, 0.0], [0.5, 0.25], [-1.0, 1.0]])  # (3, 2)
    y = linear.linear(x, w, torch.tensor([0.0, 1.0, -2.0]))
    assert y.dtype == torch.float64 and y.shape == (2, 1, 3)
    assert y.tolist() == [[[1.0, 2.0, -1.0]], [[3.0, 2.25, -6.0]]]


def test_linear_nonfinite_follows_ieee_even_where_blas_skips_zeros():
    x = torch.tensor([[math.inf, 1.0], [1.0, 2.0]], dtype=torch.float64)
    w = torch.tensor([[0.0, 1.0], [2.0, 1.0]], dtype=torch.float64)
    y = linear.linear(x, w)
    assert math.isnan(y[0, 0]) and y[0, 1].item() == math.inf  # inf * 0 is NaN
    assert y[1].tolist() == [2.0, 4.0]
    w_nan = w.clone()
    w_nan[1, 0] = math.nan
    y = linear.linear(torch.tensor([[0.0, 1.0]]), w_nan)
    assert y[0, 0].item() == 1.0 and math.isnan(y[0, 1])


def test_linear_backward_matches_float64_autograd():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(2, 3, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(4, generator=gen, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(2, 3, 4, generator=gen, dtype=torch.float64)
    torch.nn.functional.linear(x, w, b).backward(dy)
    dx, dw, db = linear.linear_backward(x, w, dy)
    assert dx.shape == x.shape and dw.shape == w.shape and db.shape == b.shape
    torch.testing.assert_close(dx, x.grad, rtol=1e-13, atol=0)
    torch.testing.assert_close(dw, w.grad, rtol=1e-13, atol=1e-15)
    torch.testing.assert_close(db, b.grad, rtol=1e-13, atol=1e-15)


def test_linear_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match=r"x \(2, 3\) and W \(4, 5\) do not chain"):
        linear.linear(torch.zeros(2, 3), torch.zeros(4, 5))


# --- unit roundoff and rounding -------------------------------------------------------


def test_unit_roundoff_per_dtype():
    assert bounds.unit_roundoff(torch.float32) == 2.0**-24
    assert bounds.unit_roundoff(torch.float16) == 2.0**-11
    assert bounds.unit_roundoff(torch.bfloat16) == 2.0**-8
    assert bounds.unit_roundoff(torch.float64) == 2.0**-53
    with pytest.raises(ValueError, match="floating-point dtype"):
        bounds.unit_roundoff(torch.int32)


def test_rounding_bound_by_hand():
    f32 = torch.tensor([1.0, 1.5, 3.0, 0.0, 2.0**-130], dtype=torch.float64)
    assert bounds.rounding_bound(f32, torch.float32).tolist() == [2.0**-24, 2.0**-24, 2.0**-23, 2.0**-150, 2.0**-150]
    f16 = torch.tensor([65519.0, 65520.0, -1e6, 2.0**-20, math.nan], dtype=torch.float64)
    got = bounds.rounding_bound(f16, torch.float16).tolist()
    assert got[:4] == [16.0, math.inf, math.inf, 2.0**-25] and math.isnan(got[4])


def test_bf16_subnormals_may_flush_to_zero():
    # x86's bf16 conversions flush subnormals (VCVTNEPS2BF16): below the smallest normal
    # the bf16 bound is the smallest normal itself, so a flushed 0 passes; fp16 and fp32
    # keep gradual underflow (half the subnormal spacing).
    tiny = float(torch.finfo(torch.bfloat16).tiny)
    below = torch.tensor([tiny * 0.99, tiny / 8, 0.0], dtype=torch.float64)
    assert bounds.rounding_bound(below, torch.bfloat16).tolist() == [tiny] * 3
    assert bounds.rounding_bound(torch.tensor([tiny], dtype=torch.float64), torch.bfloat16).item() == tiny * 2.0**-8
    assert bounds.underflow_error(torch.bfloat16) == tiny
    assert bounds.underflow_error(torch.float16) == 2.0**-25
    assert bounds.rounding_bound(torch.tensor([2.0**-20]), torch.float16).item() == 2.0**-25


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_rounding_bound_holds_and_is_attained(dtype):
    gen = torch.Generator().manual_seed(2)
    fi = torch.finfo(dtype)
    exponent = torch.empty(20000, dtype=torch.float64).uniform_(
        math.log2(fi.tiny) - 12, math.log2(fi.max) - 1, generator=gen
    )
    x = torch.exp2(exponent) * torch.where(torch.rand(20000, generator=gen) < 0.5, -1.0, 1.0).double()
    err = (x.to(dtype).double() - x).abs()
    bound = bounds.rounding_bound(x, dtype)
    assert bool((err <= bound).all())
    assert (err / bound).max().item() > 0.99  # tight: some value rounds by nearly half an ulp
    tie = torch.tensor([1.0 + 2.0 * bounds.unit_roundoff(dtype) / 2], dtype=torch.float64)  # 1 + u: a tie
    assert (tie.to(dtype).double() - tie).abs().item() == bounds.rounding_bound(tie, dtype).item()


def test_dequantize_bound_counts_the_chain_and_the_output_rounding():
    v = torch.tensor([1.0, -3.0, 0.0], dtype=torch.float64)
    assert torch.equal(bounds.dequantize_bound(v, torch.bfloat16, ops=0), bounds.rounding_bound(v, torch.bfloat16))
    # Same intermediate and output: the last op's rounding is the output rounding.
    u = bounds.unit_roundoff(torch.float32)
    one = bounds.dequantize_bound(torch.tensor([1.0], dtype=torch.float64), torch.float32, torch.float32, ops=1)
    assert one.item() == pytest.approx(u, rel=1e-6)
    two = bounds.dequantize_bound(torch.tensor([1.0], dtype=torch.float64), torch.bfloat16, torch.float32, ops=2)
    assert two.item() == pytest.approx(bounds.gamma(2, u) + 2.0**-8, rel=1e-6)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=str)
def test_dequantize_bound_holds_for_a_two_op_chain(dtype):
    gen = torch.Generator().manual_seed(4)
    q = torch.randint(0, 16, (4096,), generator=gen).to(dtype)
    zero = (torch.rand(4096, generator=gen) * 15).to(dtype)
    scale = (torch.rand(4096, generator=gen) * 0.1).to(dtype)
    actual = (q - zero) * scale
    exact = (q.double() - zero.double()) * scale.double()
    bound = bounds.dequantize_bound(exact, dtype, intermediate=dtype, ops=2)
    multiple = bounds.error_multiple(actual, exact, bound)
    assert 0.25 < multiple <= bounds.BOUND_MULTIPLE


# --- matmul and gradient ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_matmul_bound_holds_for_torch_matmul_in_each_dtype(dtype):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 8, 256, generator=gen, dtype=torch.float64)
    w = torch.randn(32, 256, generator=gen, dtype=torch.float64)
    b = torch.randn(32, generator=gen, dtype=torch.float64)
    actual = torch.nn.functional.linear(x.to(dtype), w.to(dtype), b.to(dtype))
    exact = linear.linear(x, w, b)
    bound = bounds.matmul_bound(x, w, b, dtype, dtype)
    assert bound.shape == exact.shape
    assert bounds.error_multiple(actual, exact, bound) <= bounds.BOUND_MULTIPLE
    # Not vacuous: an error of 1% of the magnitudes fails in every dtype.
    magnitude = x.abs() @ w.abs().T + b.abs()
    assert bounds.error_multiple(exact + 0.01 * magnitude, exact, bound) > 1


def test_matmul_bound_by_hand_with_exact_cancellation():
    # y = x W^T is exactly 0 while each product is 3: the bound is all arithmetic, no |y|.
    x = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    w = torch.tensor([[3.0, 3.0]], dtype=torch.float64)
    u16, u32 = bounds.unit_roundoff(torch.float16), bounds.unit_roundoff(torch.float32)
    magnitude = 6.0 * (1 + u16)  # |x| (|W| + u |W|)^T
    eta = {torch.float16: 2.0**-25, torch.float32: 2.0**-150}  # half the subnormal spacing
    for accumulate, u_acc in ((None, u32), (torch.float16, u16)):
        underflow = eta[torch.float16] * magnitude + 2 * eta[accumulate or torch.float32]
        e_c = 6.0 * u16 + (u16 + (1 + u16) * bounds.gamma(2, u_acc)) * magnitude + underflow
        bound = bounds.matmul_bound(x, w, None, torch.float16, torch.float16, accumulate_dtype=accumulate)
        expected = e_c + bounds.rounding_bound(torch.tensor(e_c), torch.float16).item()
        assert bound.item() == pytest.approx(expected, rel=1e-12)
    # Accumulating in the compute dtype is the textbook gamma_{K+2} or less (plus underflow terms).
    textbook = bounds.gamma(4, u16) * 6.0 + 8 * eta[torch.float16] * (1 + u16)
    in_fp16 = bounds.matmul_bound(x, w, None, torch.float16, torch.float64, accumulate_dtype=torch.float16)
    assert in_fp16.item() <= textbook * (1 + 1e-9)
    default = bounds.matmul_bound(x, w, None, torch.float16, torch.float16)
    assert bounds.matmul_bound(x, w, None, torch.float16, torch.float16, k=1000).item() > default.item()


def test_matmul_bound_covers_underflowing_products():
    # Products of fp32 subnormal size: each may lose up to eta_32 absolutely, which no
    # relative term covers (the relative part is ~1e-45 here).
    x = torch.full((1, 64), 1e-20, dtype=torch.float64)
    w = torch.full((3, 64), 1e-25, dtype=torch.float64)
    bound = bounds.matmul_bound(x, w, None, torch.float32, torch.float32)
    assert (bound >= 64 * 2.0**-150).all()
    rounded_products = (x.float() * w.float()).double()  # each product rounded once, to a subnormal
    assert (rounded_products.sum(1) - linear.linear(x, w)).abs().max() <= bound.max()


def test_matmul_bound_in_bf16_accumulation_is_vacuous_from_k_256():
    x, w = torch.ones(1, 256, dtype=torch.float64), torch.ones(1, 256, dtype=torch.float64)
    assert math.isinf(
        bounds.matmul_bound(x, w, None, torch.bfloat16, torch.bfloat16, accumulate_dtype=torch.bfloat16).item()
    )
    assert bounds.matmul_bound(x, w, None, torch.bfloat16, torch.bfloat16).item() < 256 * 0.02  # about 2u |y| + an ulp


def test_matmul_bound_takes_a_weight_error():
    x = torch.ones(1, 4, dtype=torch.float64)
    w = torch.ones(2, 4, dtype=torch.float64)
    base = bounds.matmul_bound(x, w, None, torch.float32, torch.float32, w_error=torch.zeros_like(w))
    wider = bounds.matmul_bound(x, w, None, torch.float32, torch.float32, w_error=torch.full_like(w, 1e-3))
    assert torch.all(wider - base >= 4 * 1e-3)


@pytest.mark.parametrize("dtype", LOW, ids=str)
def test_grad_bound_holds_for_torch_matmul(dtype):
    gen = torch.Generator().manual_seed(6)
    dy = torch.randn(3, 5, 64, generator=gen, dtype=torch.float64)
    w = torch.randn(64, 48, generator=gen, dtype=torch.float64)
    actual = dy.to(dtype) @ w.to(dtype)
    exact, _, _ = linear.linear_backward(torch.zeros(3, 5, 48, dtype=torch.float64), w, dy)
    bound = bounds.grad_bound(dy, w, dtype, dtype)
    assert bound.shape == exact.shape == (3, 5, 48)
    assert bounds.error_multiple(actual, exact, bound) <= bounds.BOUND_MULTIPLE
    magnitude = dy.abs() @ w.abs()
    assert bounds.error_multiple(exact + 0.01 * magnitude, exact, bound) > 1


# --- error multiple ----------------------------------------------------------------


def test_error_multiple_ratio_and_dtypes():
    expected = torch.tensor([1.0, 2.0], dtype=torch.float64)
    bound = torch.tensor([0.5, 0.25], dtype=torch.float64)
    assert bounds.error_multiple(torch.tensor([1.25, 2.0], dtype=torch.bfloat16), expected, bound) == 0.5
    assert bounds.error_multiple(torch.tensor([1.0, 2.5]), expected, bound) == 2.0
    assert (
        bounds.error_multiple(torch.empty(0), torch.empty(0, dtype=torch.float64), torch.empty(0, dtype=torch.float64))
        == 0.0
    )


@pytest.mark.parametrize(
    "actual,expected,bound,multiple",
    [
        (0.0, 0.0, 0.0, 0.0),  # zero bound, exact match
        (1e-300, 0.0, 0.0, math.inf),  # zero bound, any mismatch
        (math.nan, 1.0, 1.0, math.inf),  # NaN where the reference is finite
        (1.0, math.nan, 1.0, math.inf),  # finite where the reference is NaN
        (math.nan, math.nan, 1.0, 0.0),  # NaN where the reference is NaN
        (math.inf, math.inf, 1.0, 0.0),  # the same infinity
        (-math.inf, math.inf, 1.0, math.inf),  # the other infinity
        (math.inf, 1e6, math.inf, 0.0),  # the exact value overflows the output dtype
        (math.nan, 1e6, math.inf, math.inf),  # ... but NaN is still wrong
    ],
)
def test_error_multiple_special_values(actual, expected, bound, multiple):
    as_t = lambda v: torch.tensor([v], dtype=torch.float64)  # noqa: E731
    assert bounds.error_multiple(as_t(actual), as_t(expected), as_t(bound)) == multiple


def test_bound_multiple_is_one():
    assert bounds.BOUND_MULTIPLE == 1.0


# --- HQQ dequantize with fp32-stored zero/scale evaluated in a 16-bit compute dtype ---------


def _hqq_state(seed: int) -> PackedHqq4:
    import numpy as np

    rng = np.random.default_rng(seed)
    q = rng.integers(0, 16, size=(8, 64), dtype=np.uint8)  # axis 1: 8 groups of 64
    packed = (q[:4] << 4) | q[4:]
    zero = rng.uniform(6.5, 8.5, size=(8, 1)).astype(np.float32)  # zero points near the middle
    scale = rng.uniform(0.5, 4.0, size=(8, 1)).astype(np.float32)  # outlier-sized scales
    return PackedHqq4(
        shape=(8, 64),
        group_size=64,
        axis=1,
        packed=packed,
        scale=scale,
        zero=zero,
        meta={"compute_dtype": "float32", "scale_dtype": "float32", "zero_dtype": "float32"},
    )


@pytest.mark.parametrize("compute", (torch.bfloat16, torch.float16))
def test_hqq4_bound_covers_meta_rounded_to_compute_dtype_and_is_needed(compute):
    from pytest_qconform.reference import hqq4

    worst_needed = 0.0
    for seed in range(5):
        p = _hqq_state(seed)
        q, zero, scale = hqq4.decode_parts(p)
        exact = hqq4.decode(p)
        # What HQQ does at a 16-bit compute dtype: meta cast, then (q - zero) * scale there.
        actual = (q.to(compute) - zero.to(compute)) * scale.to(compute)
        bound = bounds.hqq4_dequantize_bound(p, compute, compute)
        assert bounds.error_multiple(actual, exact, bound) <= 1.0
        # The relative two-rounding model, blind to the rounded zero point, is exceeded.
        relative = bounds.dequantize_bound(exact, compute, intermediate=compute, ops=2)
        worst_needed = max(worst_needed, bounds.error_multiple(actual, exact, relative))
    assert worst_needed > 1.0


def test_hqq4_bound_without_meta_rounding_is_the_two_op_chain():
    p = _hqq_state(0)
    from pytest_qconform.reference import hqq4

    exact = hqq4.decode(p)
    bound = bounds.hqq4_dequantize_bound(p, torch.float32)  # stored fp32, computed fp32: no meta rounding
    assert torch.all(bound <= bounds.gamma(2, bounds.unit_roundoff(torch.float32)) * exact.abs() * 1.0001 + 1e-40)
    planted = exact + 4 * bound  # a result off by more than the arithmetic allows
    assert bounds.error_multiple(planted, exact, bound) > 1.0


# --- bitsandbytes-format weight as a 16-bit gemv computes it -----------------------------


@pytest.mark.parametrize("compute", (torch.bfloat16, torch.float16))
def test_bnb4_matmul_weight_bound_covers_code_times_absmax_in_compute_dtype(compute):
    """bitsandbytes' CUDA gemv multiplies a compute-dtype code table by a compute-dtype
    absmax; the weight bound must hold for that, and a single rounding must not."""
    import numpy as np
    from pytest_qconform.reference import bnb4
    from pytest_qconform.reference.packed import PackedBnb4

    needed = 0.0
    for seed in range(5):
        gen = torch.Generator().manual_seed(seed)
        weight = torch.randn(64, 128, generator=gen) * 3
        packed, absmax = bnb4.quantize(weight, "nf4", 64)
        p = PackedBnb4(
            "nf4", 64, (64, 128), packed, absmax.float().numpy(), np.asarray(bnb4.code_table("nf4"), dtype=np.float32)
        )
        exact = bnb4.decode(p)
        codes = torch.as_tensor(bnb4.unpack_codes(packed, exact.numel()).astype(np.int64))
        table = torch.as_tensor(p.code).to(compute)
        blocks = torch.as_tensor(p.absmax).to(compute).repeat_interleave(64)
        gemv_weight = (table[codes] * blocks).reshape(64, 128)  # in the compute dtype
        bound = bounds.bnb4_matmul_weight_bound(p, compute)
        assert bounds.error_multiple(gemv_weight, exact, bound) <= 1.0
        single = bounds.rounding_bound(exact, compute)
        needed = max(needed, bounds.error_multiple(gemv_weight, exact, single))
    assert needed > 1.0


def test_weight_error_takes_the_fused_kernels_model_where_bitsandbytes_may_run_them():
    """bitsandbytes' gemv (one row, any device) and its GPU gemm_4bit kernel (up to 1536
    rows in 0.50.2) round the code table and absmax to the compute dtype; elsewhere it
    dequantizes in fp32 and rounds once. An H200's gemm_4bit at 2-32 rows erred up to 1.11 x
    the dequantize model's bound (issue 53), so a GPU's few-row calls take the fused model."""
    import numpy as np
    from pytest_qconform.reference import bnb4
    from pytest_qconform.reference.packed import PackedBnb4

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bounds.bnb_fused_kernel_may_run(1, cpu) and bounds.bnb_fused_kernel_may_run(1, cuda)
    assert not bounds.bnb_fused_kernel_may_run(2, cpu)
    assert bounds.bnb_fused_kernel_may_run(2, cuda) and bounds.bnb_fused_kernel_may_run(1536, cuda)
    assert not bounds.bnb_fused_kernel_may_run(1537, cuda) and not bounds.bnb_fused_kernel_may_run(None, cuda)
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0))
    packed, absmax = bnb4.quantize(weight, "nf4", 64)
    p = PackedBnb4("nf4", 64, (64, 128), packed, absmax.float().numpy(), np.asarray(bnb4.code_table("nf4"), np.float32))
    exact = bnb4.decode(p)
    fused = bounds.bnb4_matmul_weight_bound(p, torch.float16)
    assert torch.equal(bounds.weight_error(p, exact, torch.float16, rows=1), fused)
    assert torch.equal(
        bounds.weight_error(p, exact, torch.float16, rows=2), bounds.bnb4_dequantize_bound(p, torch.float16)
    )
    assert torch.all(fused >= bounds.weight_error(p, exact, torch.float16, rows=2))
