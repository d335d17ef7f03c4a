"""Matmul forward, the "silent wrong matmul": ``y = x W^T + b`` against float64.

The weight is the float64 decoding of the backend's own bytes, so only the matmul is
judged. Activations: batch 1 (the gemv path), small and larger batches, 2-D and 3-D
(batch and sequence), contiguous, transposed and sliced views, with and without bias,
in every claimed dtype; and fp32 activations into a low-precision layer, as PEFT's
k-bit preparation produces them. A crash is a failed cell with its message.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from pytest_qconform.reference import bounds, linear
from pytest_qconform.strategies import ActivationCase, WeightCase, activation_cases, weight_cases

from ._cases import DTYPES, SPECS, dtype_id, reference_decode, require_claim, shapes_for, spec_id, weight_error


def check_matmul(qbackend, qdevice, qcheck, spec, compute_dtype, x_dtype, case, act, with_bias) -> None:
    qcheck.describe(**case.describe(), **act.describe(), bias=with_bias, x_dtype=dtype_id(x_dtype))
    weight = case.make(qdevice)
    n, k = case.shape
    quantized = qbackend.quantize(weight, spec)
    x = act.make(k, x_dtype, qdevice)
    bias = (torch.randn(n, generator=torch.Generator().manual_seed(act.seed)).to(compute_dtype).to(qdevice)
            if with_bias else None)
    y = qbackend.matmul(x, quantized, bias, compute_dtype)
    qcheck.equal(y.dtype, x_dtype, "matmul output dtype (the activation's dtype)")
    packed = qbackend.export_packed(quantized)
    w_exact = reference_decode(packed, qdevice)
    b_exact = bias.double() if bias is not None else None
    y_exact = linear.linear(x.double(), w_exact, b_exact)
    bound = bounds.matmul_bound(x.double(), w_exact, b_exact, compute_dtype, y.dtype,
                                w_error=weight_error(packed, w_exact, compute_dtype, rows=x.numel() // k))
    qcheck.within(y, y_exact, bound, "matmul vs float64 x W^T + b")


@pytest.mark.qconform_operation("matmul")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", SPECS, ids=spec_id)
def test_matmul_matches_reference(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    require_claim(qbackend, qtarget, spec, dtype)

    @given(case=weight_cases(shapes_for(spec), ("normal", "outliers", "zero_blocks")),
           act=activation_cases(), with_bias=st.booleans())
    def check(case, act, with_bias):
        check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, act, with_bias)

    check()


@pytest.mark.qconform_operation("matmul-fp32-input")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16), ids=dtype_id)
@pytest.mark.parametrize("spec", SPECS[:1] + SPECS[-3:-2], ids=spec_id)
def test_matmul_fp32_activation_into_low_precision_layer(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """PEFT's prepare_model_for_kbit_training upcasts activations to fp32 ahead of a
    bf16/fp16-compute 4-bit layer; the layer must compute, and return fp32."""
    require_claim(qbackend, qtarget, spec, dtype)

    @given(case=weight_cases(shapes_for(spec), ("normal",)), act=activation_cases(), with_bias=st.booleans())
    def check(case, act, with_bias):
        check_matmul(qbackend, qdevice, qcheck, spec, dtype, torch.float32, case, act, with_bias)

    check()


# Fused small-batch kernels take over where the weight's rows are long: the Triton rows
# kernel needs K a multiple of 256, which the drawn weight shapes (K <= 128) never reach.
# N is not a multiple of 4: a partial last group of rows. On a GPU, K = 1024 also makes the
# tensor-core kernel split K over programs and add their sums in a second kernel (a weight
# this narrow leaves the GPU idle otherwise); the interpreter runs one program, so the CPU
# keeps K = 256 (its run time grows with K).
SMALL_BATCH_SHAPES = {"cuda": (10, 1024), "cpu": (10, 256)}
SMALL_BATCH_DEFAULT_LIMIT = 4  # row counts checked for a backend that claims no max_gemv_rows
# Blocksize 64 in each packing: NF4 plain and double-quantized (what the Triton fused kernels
# read; FP4 shares their code path) and HQQ along axis 1.
SMALL_BATCH_SPECS = tuple(
    s for s in SPECS if s.blocksize == 64 and (s.format == "nf4" or (s.format == "hqq4" and s.axis == 1))
)


@pytest.mark.qconform_operation("matmul")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", SMALL_BATCH_SPECS, ids=spec_id)
def test_matmul_every_row_count_past_the_fused_limit(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """Each batch from 1 row to one past the backend's ``max_gemv_rows``: a fused
    small-batch path serves exactly these, and the drawn activations of
    ``test_matmul_matches_reference`` need not hit every one. Contiguous x (what fused
    kernels take), with bias; the seeds are fixed and printed on failure."""
    caps = require_claim(qbackend, qtarget, spec, dtype)
    limit = caps.max_gemv_rows or SMALL_BATCH_DEFAULT_LIMIT
    case = WeightCase(SMALL_BATCH_SHAPES.get(qdevice.type, SMALL_BATCH_SHAPES["cpu"]), "normal", seed=17)
    for rows in range(1, limit + 2):
        check_matmul(qbackend, qdevice, qcheck, spec, dtype, dtype, case, ActivationCase((rows,), "contiguous", rows),
                     with_bias=True)
