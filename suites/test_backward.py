"""Backward and NaN gradients.

Gradients of the activation and bias through the 4-bit layer, and of LoRA adapters
feeding it, must be finite and within bound of float64 autograd on the decoded weight.
Inputs are also chosen to provoke fp16 overflow inside a kernel while the exact result
stays representable (paired rows and columns whose products cancel exactly), and NaN
or Inf in an input must show up where the reference puts it and nowhere else. Sizes real
runs reach (issue 51): the gradients at every rung of the rows ladder (up to 65537 rows,
whatever the backend declares) and at K = 14336 and N = 151936.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from pytest_qconform.reference import bounds, linear

from pytest_qconform.cases.axes import ALWAYS_ROWS
from pytest_qconform.cases.strategies import (
    ActivationCase,
    WeightCase,
    activation_cases,
    activation_leading,
    fewer_examples,
    weight_cases,
)

from ._cases import (
    LADDER_LOW,
    LADDER_SHAPE,
    LADDER_TOP,
    LONG_K_SHAPE,
    PREFILL_JUDGED_ROWS,
    SIZES_LARGE_ON,
    claimed_real_sizes,
    prefill_at_long_k_rows,
    reference_decode,
    require_claim,
    row_slices,
    weight_error,
)

pytestmark = pytest.mark.qconform_operation("backward")
LORA_RANK = 4
# The gradients' path: the weight's shape and distribution select the dequantize kernel
# under ``dy W``, and the activation's rows and rank the shapes of that product and of the
# forward before it: axes, so that each pair is an instance. The rows are the decode row,
# a batch and a prefill (``axes.ALWAYS_ROWS``): no backend's backward changes route by rows
# (each dequantizes and multiplies), and the forward's routes, which this check does not
# judge, are the matmul checks' (each declared route there, with every layout). x's memory
# layout is no axis: the backend is handed h = x + (x A^T) B^T, a fresh contiguous tensor.
# The packed storage dtype is a setting users pass (FSDP-QLoRA trains on bf16-stored bytes):
# an axis here too, so each storage meets every row count, rank and dtype of the backward.
# The axes double the instances; each instance draws a third as often.
GRADIENT_DISTRIBUTIONS = ("normal", "outliers")
DRAW_DIVISOR = 3


def _mm_bound(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bound of fl(a @ b) computed in ``dtype`` (a, b exact float64 2-D)."""
    return bounds.matmul_bound(a, b.T, None, dtype, dtype)


@pytest.mark.qconform_axes(
    "format",
    "blocksize",
    "double_quant",
    "hqq_axis",
    "quant_storage",
    "dtype",
    "weight_shape",
    "distribution",
    "rows",
    "x_rank",
    "orientation",
    distribution=GRADIENT_DISTRIBUTIONS,
    rows=ALWAYS_ROWS,
)
def test_gradients_match_reference(
    qtarget, qbackend, qdevice, qcheck, spec, dtype, weight_shape, distribution, rows, x_rank, orientation
):
    """LoRA adapters feed the 4-bit layer: ``h = x + (x A^T) B^T``, ``y = h W^T + b``, with
    the instance's weight (shape, distribution) and activation (rows, rank; always a bias,
    whose gradient is checked), the packed weight handed over in each orientation the
    backend documents (``orientation``: bitsandbytes' ``matmul_4bit`` takes the weight as
    ``quantize_4bit`` returned it too, and its backward must read it the same way);
    hypothesis draws the seeds.

    Every bound propagates the layer's own backward bound (``dh = dy W``) through the
    adapter's exact float64 gradient formulas, plus each adapter op's rounding.
    """
    require_claim(qbackend, qtarget, spec, dtype, backward=True, orientation=orientation)

    @fewer_examples(DRAW_DIVISOR)
    @given(
        case=weight_cases((weight_shape,), (distribution,)),
        act=activation_cases(activation_leading(rows, x_rank), "contiguous"),
    )
    def check(case, act):
        qcheck.describe(**case.describe(), **act.describe())
        n, k = case.shape
        quantized = qbackend.quantize(case.make(qdevice), spec)
        gen = torch.Generator().manual_seed(act.seed)
        x = act.make(k, dtype, qdevice).detach().requires_grad_(True)
        bias = torch.randn(n, generator=gen).to(dtype).to(qdevice).requires_grad_(True)
        a = (torch.randn(LORA_RANK, k, generator=gen) * 0.1).to(dtype).to(qdevice).requires_grad_(True)
        b = (torch.randn(k, LORA_RANK, generator=gen) * 0.1).to(dtype).to(qdevice).requires_grad_(True)
        h = x + (x @ a.T) @ b.T
        y = qbackend.matmul_with(h, quantized, bias, dtype, orientation=orientation)
        dy = torch.randn(y.shape, generator=gen).to(dtype).to(qdevice)
        y.backward(dy)
        for name, grad in (("x", x.grad), ("bias", bias.grad), ("lora_A", a.grad), ("lora_B", b.grad)):
            if grad is None or not torch.isfinite(grad).all():
                state = "missing" if grad is None else "not finite"
                qcheck.equal(state, "finite", f"gradient of {name}")
        packed = qbackend.export_packed(quantized)
        w = reference_decode(packed, qdevice)
        x2, dy2 = x.detach().double().reshape(-1, k), dy.double().reshape(-1, n)
        a64, b64 = a.detach().double(), b.detach().double()
        u = x2 @ a64.T
        dh = dy2 @ w
        du = dh @ b64
        dx_exact = dh + du @ a64
        e_dh = bounds.grad_bound(dy2, w, dtype, dtype, w_error=weight_error(packed, w, dtype))
        e_du = _mm_bound(dh, b64, dtype) + e_dh @ b64.abs()
        e_dx = e_dh + _mm_bound(du, a64, dtype) + e_du @ a64.abs() + bounds.rounding_bound(dx_exact, dtype)
        e_u = _mm_bound(x2, a64.T, dtype)
        db_exact = dy2.sum(0)
        e_db = _mm_bound(torch.ones(1, dy2.shape[0], dtype=torch.float64, device=dy2.device), dy2, dtype)[0]
        da_exact = du.T @ x2
        e_da = _mm_bound(du.T, x2, dtype) + e_du.T @ x2.abs()
        db_lora_exact = dh.T @ u
        e_db_lora = _mm_bound(dh.T, u, dtype) + e_dh.T @ u.abs() + dh.abs().T @ e_u
        qcheck.within(x.grad.reshape(-1, k), dx_exact, e_dx, "d x (through LoRA and the 4-bit layer)")
        qcheck.within(bias.grad, db_exact, e_db, "d bias")
        qcheck.within(a.grad, da_exact, e_da, "d lora_A")
        qcheck.within(b.grad, db_lora_exact, e_db_lora, "d lora_B")

    check()


def _paired_weight(dtype_max: float, device) -> torch.Tensor:
    """A (64, 128) weight whose row 2i+1 equals row 2i and column 2j+1 equals column 2j,
    so that alternating-sign inputs cancel exactly while each product is large."""
    base = WeightCase((32, 64), "normal", 1234).make("cpu").double()
    w = base.repeat_interleave(2, dim=0).repeat_interleave(2, dim=1)
    return (w / w.abs().max() * 8.0).float().to(device)


@pytest.mark.qconform_dtype("fp16")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # accumulation, not layout
def test_fp16_overflow_inside_kernel_stays_finite(qtarget, qbackend, qdevice, qcheck, spec):
    """Each product x_k W_nk is ~2.4e5 (over fp16's 65504) but pairs cancel exactly, so
    y = b and dx = 0 are representable: an fp16 accumulator overflows, fp32 does not."""
    dtype = torch.float16
    require_claim(qbackend, qtarget, spec, dtype, backward=True)
    weight = _paired_weight(65504.0, qdevice)
    quantized = qbackend.quantize(weight, spec)
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    w_error = weight_error(packed, w, dtype, rows=2)
    qcheck.describe(shape=(64, 128), distribution="paired-cancelling", seed=1234)
    if not (torch.equal(w[0::2], w[1::2]) and torch.equal(w[:, 0::2], w[:, 1::2])):
        pytest.skip(f"not claimed: {spec.label()} did not quantize paired rows/columns identically")
    x = torch.full((2, 128), 30000.0, dtype=dtype, device=qdevice)
    x[:, 1::2] = -30000.0
    x.requires_grad_(True)
    bias = torch.linspace(-1, 1, 64, dtype=dtype, device=qdevice)
    y = qbackend.matmul(x, quantized, bias, dtype)
    y_exact = linear.linear(x.double(), w, bias.double())
    qcheck.within(
        y,
        y_exact,
        bounds.matmul_bound(x.double(), w, bias.double(), dtype, dtype, w_error=w_error),
        "forward with cancelling large products",
    )
    dy = torch.full_like(y, 30000.0)
    dy[:, 1::2] = -30000.0
    y.backward(dy)
    dx_exact = dy.double() @ w
    qcheck.within(
        x.grad,
        dx_exact,
        bounds.grad_bound(dy.double(), w, dtype, dtype, w_error=w_error),
        "backward with cancelling large products",
    )


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.parametrize("poison", (float("nan"), float("inf")), ids=("nan", "inf"))
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # propagation, not layout
def test_nonfinite_input_propagates_only_where_reference_does(qtarget, qbackend, qdevice, qcheck, spec, poison):
    dtype = torch.float32
    require_claim(qbackend, qtarget, spec, dtype)
    weight = WeightCase((64, 128), "normal", 7).make(qdevice)
    quantized = qbackend.quantize(weight, spec)
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    x = torch.randn(4, 128, generator=torch.Generator().manual_seed(7)).to(qdevice)
    x[1, 5] = poison
    qcheck.describe(shape=(64, 128), seed=7, poison=str(poison))
    y = qbackend.matmul(x, quantized, None, dtype)
    y_exact = linear.linear(x.double(), w, None)
    same_nan = torch.equal(torch.isnan(y).cpu(), torch.isnan(y_exact).cpu())
    same_inf = torch.equal(torch.isinf(y).cpu(), torch.isinf(y_exact).cpu())
    qcheck.equal((same_nan, same_inf), (True, True), "NaN/Inf pattern of y equals the reference's")
    finite = torch.isfinite(y_exact)
    bound = bounds.matmul_bound(
        x.double().nan_to_num(0, 0, 0), w, None, dtype, dtype, w_error=weight_error(packed, w, dtype, rows=4)
    )
    qcheck.within(
        torch.where(finite, y.double(), 0.0),
        torch.where(finite, y_exact, 0.0),
        bound,
        "finite entries around the poisoned row",
    )


def check_backward_rows(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows, x_rank) -> None:
    """The gradients at ``rows`` rows of the instance's rank, on ``LADDER_SHAPE`` (the matmul
    ladder's weight); fixed seeds."""
    require_claim(qbackend, qtarget, spec, dtype, backward=True)
    act = ActivationCase(activation_leading(rows, x_rank), "contiguous", rows)
    check_backward(qbackend, qdevice, qcheck, spec, dtype, WeightCase(LADDER_SHAPE, "normal", seed=19), act)


def check_backward(
    qbackend, qdevice, qcheck, spec, dtype, case: WeightCase, act: ActivationCase, judged_rows: int | None = None
) -> None:
    """``dx = dy W`` and ``db = sum(dy)`` through the backend's matmul against float64, for a
    contiguous activation ``act`` (a backward reads dy, not x's layout) and a bias.
    ``judged_rows``: dx judged that many rows at a time (its float64 reference and bound)."""
    n, k = case.shape
    qcheck.describe(**case.describe(), **act.describe())
    quantized = qbackend.quantize(case.make(qdevice), spec)
    gen = torch.Generator().manual_seed(act.seed)
    x = act.make(k, dtype, qdevice).requires_grad_(True)
    rows = x.numel() // k
    bias = torch.randn(n, generator=gen).to(dtype).to(qdevice).requires_grad_(True)
    y = qbackend.matmul(x, quantized, bias, dtype)
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(qdevice)
    y.backward(dy)
    for name, grad in (("x", x.grad), ("bias", bias.grad)):
        if grad is None or not torch.isfinite(grad).all():
            qcheck.equal("missing" if grad is None else "not finite", "finite", f"gradient of {name}")
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    dy2 = dy.double().reshape(-1, n)
    e_w = weight_error(packed, w, dtype)
    dx = x.grad.reshape(-1, k)
    for first, stop, where in row_slices(rows, judged_rows):
        part = dy2[first:stop]
        e_dx = bounds.grad_bound(part, w, dtype, dtype, w_error=e_w)
        qcheck.within(dx[first:stop], part @ w, e_dx, f"d x at {rows} rows{where}")
    ones = torch.ones(1, dy2.shape[0], dtype=torch.float64, device=dy2.device)
    qcheck.within(bias.grad, dy2.sum(0), _mm_bound(ones, dy2, dtype)[0], f"d bias, a sum over {rows} rows")


# The gradients at every rung of the matmul checks' rows ladder (``axes.ROWS_LADDER``), whatever
# the backend declares: no backend declares a backward route by rows, and a library may still
# switch its backward GEMM, or its bias gradient's reduction, at a row count. Paired with every
# format, dtype and rank; x contiguous (a backward reads dy, not x's layout). Split as the forward
# ladder is: the rungs above 2^12 + 1 are large on a CPU (``_cases.LADDER_SPLIT``).
LADDER_AXES = ("format", "double_quant", "hqq_axis", "dtype", "rows_ladder", "x_rank")


@pytest.mark.qconform_thorough_strength(2)  # 47 rungs x every pair of the others
@pytest.mark.qconform_axes(*LADDER_AXES, rows_ladder=LADDER_LOW)
def test_backward_rows_ladder(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank):
    """Gradients of x and the bias at every rung of the rows ladder up to 2^12 + 1 rows."""
    check_backward_rows(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank)


@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_thorough_strength(2)  # 47 rungs x every pair of the others
@pytest.mark.qconform_axes(*LADDER_AXES, rows_ladder=LADDER_TOP)
def test_backward_rows_ladder_top(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank):
    """Gradients of x and the bias from 2^13 - 1 to 2^16 + 1 rows (a QLoRA batch of 8 x 8192
    tokens); in the default run on a GPU, ``large`` on a CPU."""
    check_backward_rows(qtarget, qbackend, qdevice, qcheck, spec, dtype, rows_ladder, x_rank)


@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")
def test_backward_real_sizes(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """The gradients at the widths real calls reach (``_cases.LONG_K_SHAPE``: K = 14336, dx
    14336 wide; ``WIDE_N_SHAPE``: N = 151936, dx a reduction over 151936 outputs), each where
    claimed, at 5 rows. In the default run on a GPU; ``large`` on a CPU."""
    caps = require_claim(qbackend, qtarget, spec, dtype, backward=True)
    for shape in claimed_real_sizes(caps, spec):
        act = ActivationCase((5,), "contiguous", seed=shape[0])
        check_backward(
            qbackend, qdevice, qcheck, spec, dtype, WeightCase(shape, "normal", seed=shape[0] + shape[1]), act
        )


@pytest.mark.qconform_large_on(*SIZES_LARGE_ON)
@pytest.mark.qconform_heavy
@pytest.mark.qconform_ci_strength(1)  # each value once: 5-10 s an instance on an H200
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")
def test_backward_prefill_at_long_k(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """The gradients of 65536 rows at K = 14336 in one call (``_cases.PREFILL_ROWS``): dx is
    65536 x 14336, the bias' gradient a sum over 65536 rows. ``large`` on a GPU; not claimed
    on a CPU."""
    require_claim(qbackend, qtarget, spec, dtype, backward=True)
    rows = prefill_at_long_k_rows(qdevice)
    act = ActivationCase((rows,), "contiguous", seed=rows)
    case = WeightCase(LONG_K_SHAPE, "normal", seed=14336)
    check_backward(qbackend, qdevice, qcheck, spec, dtype, case, act, judged_rows=PREFILL_JUDGED_ROWS)
