"""Value ranges of every dtype: near its largest finite value, near its smallest normal,
subnormal, and results beyond a narrower dtype's range.

The other suites draw values well inside fp16's range whatever the dtype. Here the
weights (for dequantize), and the weights, activations and upstream gradients (for
matmul and backward) are scaled into each range of the dtype under test, always so that
the exact float64 result and every partial sum of magnitudes stay finite in that dtype
(``sum |x| |W|`` at most a quarter of its largest value). An inf, NaN or crash where the
float64 result is finite and representable is then a failure, like any error beyond the
bound (``reference.bounds`` counts underflow absolutely, rounding relatively).
"""

from __future__ import annotations

import pytest
import torch
from pytest_qconform.reference import bounds, linear

from ._cases import packed_dequantize_bound, reference_decode, require_claim, weight_error

pytestmark = pytest.mark.qconform_operation("value-range")

SHAPE = (64, 128)
ROWS = (1, 5)


def weight_magnitude(value_range: str, dtype: torch.dtype) -> float:
    """The largest |w| of the weight for ``value_range`` in ``dtype``."""
    info = torch.finfo(dtype)
    return {
        "near-max": float(info.max) / 2,
        "near-smallest-normal": 4 * float(info.tiny),
        "subnormal": float(info.tiny) / 4,
        "beyond-fp16": 300.0,
    }[value_range]


def _scaled(shape: tuple[int, ...], seed: int, magnitude: float, device: torch.device) -> torch.Tensor:
    """Normal values scaled so the largest |v| is ``magnitude``, rounded once to fp32."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (values / values.abs().max() * magnitude).to(torch.float32).to(device)


def _partner(
    w_abs_sums: torch.Tensor,
    value_range: str,
    dtype: torch.dtype,
    shape: tuple[int, ...],
    seed: int,
    device: torch.device,
) -> torch.Tensor:
    """Activations (or upstream gradients) in ``dtype`` for weights with the given row (or
    column) sums of |W|: magnitude 1 for the small ranges, 300 beyond fp16 (so results
    reach ~1e6), and for near-max as large as keeps ``sum |x| |W|`` <= max / 4."""
    largest = float(w_abs_sums.max())
    if value_range == "near-max":
        magnitude = float(torch.finfo(dtype).max) / 4 / largest
    else:
        magnitude = 300.0 if value_range == "beyond-fp16" else 1.0
    return _scaled(shape, seed, magnitude, device).to(dtype)


@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype", "value_range")  # magnitudes, not layout
def test_dequantize_matmul_backward_across_the_dtype_range(
    qtarget, qbackend, qdevice, qcheck, spec, dtype, value_range
):
    """Dequantize into ``dtype``; matmul and its backward computed in ``dtype`` at 1 and 5
    rows. The weight is quantized from fp32 values of the range's magnitude."""
    require_claim(qbackend, qtarget, spec, dtype, backward=True, dequantize=True)
    magnitude = weight_magnitude(value_range, dtype)
    qcheck.describe(shape=SHAPE, value_range=value_range, weight_magnitude=magnitude, seed=5)
    quantized = qbackend.quantize(_scaled(SHAPE, 5, magnitude, qdevice), spec)
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    out = qbackend.dequantize(quantized, dtype)
    qcheck.within(out, w, packed_dequantize_bound(packed, w, dtype), f"dequantize, {value_range} weights")
    for rows in ROWS:
        qcheck.describe(rows=rows)
        x = _partner(w.abs().sum(dim=1), value_range, dtype, (rows, SHAPE[1]), rows, qdevice).requires_grad_(True)
        y = qbackend.matmul(x, quantized, None, dtype)
        w_error = weight_error(packed, w, dtype, rows=rows)
        qcheck.within(
            y,
            linear.linear(x.double(), w),
            bounds.matmul_bound(x.double(), w, None, dtype, dtype, w_error=w_error),
            f"matmul, {value_range} weights and activations",
        )
        dy = _partner(w.abs().sum(dim=0), value_range, dtype, tuple(y.shape), 10 + rows, qdevice)
        y.backward(dy)
        qcheck.within(
            x.grad,
            dy.double() @ w,
            bounds.grad_bound(dy.double(), w, dtype, dtype, w_error=w_error),
            f"backward dx = dy W, {value_range} weights and gradients",
        )
