"""Dtype sequencing: the global-buffer bug (unsloth PR 4026).

A reusable dequantize buffer that kept its first dtype broke a bf16 load followed by an
fp16 load in one process. Here, in one process and one backend instance, weights of the
same shape are quantized and used as bf16, then fp16, then bf16 again, then fp32, each
with forward and backward; every step checks dtype and values against the reference.
"""

from __future__ import annotations

import pytest
import torch
from pytest_qconform.reference import bounds, linear

from pytest_qconform.cases.strategies import WeightCase

from ._cases import dtype_id, packed_dequantize_bound, reference_decode, require_claim, weight_error

pytestmark = pytest.mark.qconform_operation("sequencing")
SEQUENCE = (torch.bfloat16, torch.float16, torch.bfloat16, torch.float32)


@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "rows")  # dtypes in sequence, per route
def test_bf16_fp16_bf16_fp32_in_one_process(qtarget, qbackend, qdevice, qcheck, spec, rows):
    caps = require_claim(qbackend, qtarget, spec, backward=True, dequantize=True)
    steps = [d for d in SEQUENCE if d in caps.dtypes and (d is not torch.bfloat16 or qtarget.bf16)]
    if len(set(steps)) < 2:
        pytest.skip(f"not claimed: {qbackend.name} claims fewer than two dtypes here")
    for step, dtype in enumerate(steps):
        case = WeightCase((64, 128), "normal", 100 + step)
        qcheck.describe(step=step, step_dtype=dtype_id(dtype), **case.describe())
        quantized = qbackend.quantize(case.make(qdevice), spec)
        packed = qbackend.export_packed(quantized)
        w = reference_decode(packed, qdevice)
        out = qbackend.dequantize(quantized, dtype)
        qcheck.equal(out.dtype, dtype, f"step {step}: dequantize dtype")
        qcheck.within(out, w, packed_dequantize_bound(packed, w, dtype), f"step {step}: dequantize values")
        x = torch.randn(rows, 128, generator=torch.Generator().manual_seed(step)).to(dtype).to(qdevice)
        x.requires_grad_(True)
        y = qbackend.matmul(x, quantized, None, dtype)
        qcheck.equal(y.dtype, dtype, f"step {step}: matmul dtype")
        w_error = weight_error(packed, w, dtype, rows=rows)
        qcheck.within(
            y,
            linear.linear(x.double(), w),
            bounds.matmul_bound(x.double(), w, None, dtype, dtype, w_error=w_error),
            f"step {step}: matmul values",
        )
        dy = torch.ones_like(y)
        y.backward(dy)
        qcheck.equal(x.grad.dtype, dtype, f"step {step}: gradient dtype")
        qcheck.within(
            x.grad,
            dy.double() @ w,
            bounds.grad_bound(dy.double(), w, dtype, dtype, w_error=w_error),
            f"step {step}: gradient values",
        )
