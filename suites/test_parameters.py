"""The other documented parameters of the functions users call.

Output buffers (``out=``) of dequantize and matmul, with ONE buffer reused across calls
of different dtypes and shapes (the global-buffer class of unsloth PR 4026, now through
the caller's own buffer); dequantize from the bytes and an explicit ``absmax`` with the
blocksize and format given by hand (bitsandbytes' stateless form); a bias of every dtype
whatever the compute dtype; and every orientation of the packed weight the library
documents as accepted. Each is a claim (``Capabilities``); a backend without the
parameter is "not claimed". These checks call at fixed rows; the route check
(``test_matmul_every_route``) pairs matmul's ``out=`` and each orientation (its ``call_form``
axis) with every route, layout and dtype.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bnb4, bounds, linear

from pytest_qconform.cases.strategies import WeightCase
from pytest_qconform.session.outcomes import skip_not_claimed

from ._cases import DTYPES, dtype_id, packed_dequantize_bound, reference_decode, require_claim, weight_error

pytestmark = pytest.mark.qconform_operation("parameters")

# Both formats, both default blocksizes, double quantization on and off, in four specs.
# One buffer, these calls in order: the dtype changes at every step and the shape at most.
BUFFER_SEQUENCE = (
    ((64, 128), torch.bfloat16),
    ((33, 47), torch.float16),
    ((64, 128), torch.float32),
    ((1, 64), torch.bfloat16),
    ((33, 47), torch.float32),
    ((64, 128), torch.float16),
)
POISON_BYTE = 0xFF  # every float dtype reads all-ones bytes as NaN: a value never written shows


def _views_of_one_buffer(device: torch.device) -> tuple[torch.Tensor, callable]:
    nbytes = max(int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size() for shape, dtype in BUFFER_SEQUENCE)
    storage = torch.empty(nbytes, dtype=torch.uint8, device=device)

    def view(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        storage.fill_(POISON_BYTE)
        size = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        return storage[:size].view(dtype).view(shape)

    return storage, view


def _claimed_steps(caps, qtarget) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return [
        (shape, dtype)
        for shape, dtype in BUFFER_SEQUENCE
        if dtype in caps.dtypes and (dtype is not torch.bfloat16 or qtarget.bf16)
    ]


@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # staging of dtypes and shapes
def test_dequantize_into_one_buffer_across_dtypes_and_shapes(qtarget, qbackend, qdevice, qcheck, spec):
    caps = require_claim(qbackend, qtarget, spec, out="dequantize", dequantize=True)
    _, view = _views_of_one_buffer(qdevice)
    for step, (shape, dtype) in enumerate(_claimed_steps(caps, qtarget)):
        if spec.format == "hqq4" and shape != (64, 128):
            continue  # HQQ groups need rows that divide by the group size
        case = WeightCase(shape, "normal", 60 + step)
        qcheck.describe(step=step, step_dtype=dtype_id(dtype), **case.describe())
        quantized = qbackend.quantize(case.make(qdevice), spec)
        out = view(shape, dtype)
        result = qbackend.dequantize_with(quantized, dtype, out=out)
        qcheck.equal(
            result.data_ptr() == out.data_ptr() and result.dtype == dtype,
            True,
            f"step {step}: dequantize returned the out= buffer, in {dtype_id(dtype)}",
        )
        packed = qbackend.export_packed(quantized)
        exact = reference_decode(packed, qdevice)
        qcheck.within(out, exact, packed_dequantize_bound(packed, exact, dtype), f"step {step}: values written to out=")


@pytest.mark.qconform_axes("format", "double_quant", format=("nf4", "fp4"))  # staging of dtypes and shapes
def test_matmul_into_one_buffer_across_dtypes_and_shapes(qtarget, qbackend, qdevice, qcheck, spec):
    """Rows 1, 3 and 16 in turn (gemv, fused few-row and GEMM paths), the compute dtype
    and the weight shape changing between calls; no autograd (out= is for inference)."""
    caps = require_claim(qbackend, qtarget, spec, out="matmul")
    _, view = _views_of_one_buffer(qdevice)
    for step, (shape, dtype) in enumerate(_claimed_steps(caps, qtarget)):
        rows = (1, 3, 16)[step % 3]
        case = WeightCase(shape, "normal", 70 + step)
        qcheck.describe(step=step, step_dtype=dtype_id(dtype), rows=rows, **case.describe())
        quantized = qbackend.quantize(case.make(qdevice), spec)
        x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(step)).to(dtype).to(qdevice)
        bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(step)).to(dtype).to(qdevice)
        out = view((rows, shape[0]), dtype)
        with torch.no_grad():
            result = qbackend.matmul_with(x, quantized, bias, dtype, out=out)
        qcheck.equal(
            result.data_ptr() == out.data_ptr() and result.dtype == dtype,
            True,
            f"step {step}: matmul returned the out= buffer, in {dtype_id(dtype)}",
        )
        packed = qbackend.export_packed(quantized)
        w = reference_decode(packed, qdevice)
        bound = bounds.matmul_bound(
            x.double(), w, bias.double(), dtype, dtype, w_error=weight_error(packed, w, dtype, rows=rows)
        )
        qcheck.within(out, linear.linear(x.double(), w, bias.double()), bound, f"step {step}: values written to out=")


@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "dtype", format=("nf4", "fp4"))
def test_dequantize_with_explicit_absmax(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """The bytes with an fp32 absmax handed in (double quantization decoded beforehand, as
    a caller of the stateless form does): decoded with that absmax, within the plain
    (single-level) bound. Two shapes: whole blocks, and a partial last block."""
    require_claim(qbackend, qtarget, spec, dtype, explicit_absmax=True, dequantize=True)
    for index, shape in enumerate(((64, 128), (33, 47))):
        case = WeightCase(shape, "outliers", 80 + index)
        qcheck.describe(**case.describe())
        quantized = qbackend.quantize(case.make(qdevice), spec)
        packed = qbackend.export_packed(quantized)
        absmax = bnb4.decode_absmax(packed, qdevice).float()
        plain = dataclasses.replace(
            packed,
            absmax=absmax.cpu().numpy(),
            nested_absmax=None,
            nested_code=None,
            nested_blocksize=None,
            offset=None,
        )
        out = torch.empty(shape, dtype=dtype, device=qdevice)
        result = qbackend.dequantize_with(quantized, dtype, out=out, absmax=absmax)
        exact = reference_decode(plain, qdevice)
        qcheck.within(
            result,
            exact,
            packed_dequantize_bound(plain, exact, dtype),
            "dequantize with absmax= (blocksize and format passed by hand)",
        )


@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")  # the bias' dtype
def test_matmul_bias_of_every_dtype(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """A bias in each dtype (a model's bias may stay fp32 while the layer computes in
    bf16): the result has the activation's dtype and is within bound, the bias counted
    as rounded to the compute dtype. 1 and 5 rows, forward only."""
    caps = require_claim(qbackend, qtarget, spec, dtype)
    case = WeightCase((64, 128), "normal", 90)
    quantized = qbackend.quantize(case.make(qdevice), spec)
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    for bias_dtype in [d for d in DTYPES if d in caps.dtypes and (d is not torch.bfloat16 or qtarget.bf16)]:
        for rows in (1, 5):
            qcheck.describe(**case.describe(), bias_dtype=dtype_id(bias_dtype), rows=rows)
            gen = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, 128, generator=gen).to(dtype).to(qdevice)
            bias = (torch.randn(64, generator=gen) * 4).to(bias_dtype).to(qdevice)
            with torch.no_grad():
                y = qbackend.matmul(x, quantized, bias, dtype)
            qcheck.equal(y.dtype, dtype, f"matmul output dtype with a {dtype_id(bias_dtype)} bias")
            bound = bounds.matmul_bound(
                x.double(), w, bias.double(), dtype, dtype, w_error=weight_error(packed, w, dtype, rows=rows)
            )
            qcheck.within(
                y, linear.linear(x.double(), w, bias.double()), bound, f"matmul with a {dtype_id(bias_dtype)} bias"
            )


@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "dtype", format=("nf4", "fp4"))
def test_matmul_every_documented_weight_orientation(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """Each orientation the backend claims for handing matmul the packed weight (for
    bitsandbytes 0.50: as ``quantize_4bit`` returned it, and transposed as
    ``Linear4bit`` passes it), at 1 and 5 rows, with bias, forward and backward."""
    caps = require_claim(qbackend, qtarget, spec, dtype)
    if len(caps.weight_orientations) < 2:
        skip_not_claimed(f"{qbackend.name} documents one orientation of the packed weight only")
    case = WeightCase((64, 128), "normal", 95)
    quantized = qbackend.quantize(case.make(qdevice), spec)
    packed = qbackend.export_packed(quantized)
    w = reference_decode(packed, qdevice)
    for orientation in caps.weight_orientations:
        for rows in (1, 5):
            qcheck.describe(**case.describe(), orientation=orientation, rows=rows)
            gen = torch.Generator().manual_seed(rows)
            x = torch.randn(rows, 128, generator=gen).to(dtype).to(qdevice).requires_grad_(True)
            bias = torch.randn(64, generator=gen).to(dtype).to(qdevice)
            y = qbackend.matmul_with(x, quantized, bias, dtype, orientation=orientation)
            w_error = weight_error(packed, w, dtype, rows=rows)
            qcheck.within(
                y,
                linear.linear(x.double(), w, bias.double()),
                bounds.matmul_bound(x.double(), w, bias.double(), dtype, dtype, w_error=w_error),
                f"matmul with the weight {orientation}",
            )
            dy = torch.randn(y.shape, generator=gen).to(dtype).to(qdevice)
            y.backward(dy)
            qcheck.within(
                x.grad,
                dy.double() @ w,
                bounds.grad_bound(dy.double(), w, dtype, dtype, w_error=w_error),
                f"gradient with the weight {orientation}",
            )
