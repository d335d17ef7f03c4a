"""Layer shapes of real models, and tensors of 2^31 elements or more.

The drawn weights of the other suites are at most 64 x 128: every threshold a kernel
has (K at least its tile, K not a multiple of the blocksize, N not a multiple of its
row group, more blocks than one double-quantization group of 256 holds, element
indices past 2^16 or 2^31) lies beyond them. Here every operation runs on layer shapes
at batch 1, a few rows and a prefill-sized batch.

On a GPU these are the projections of a 7-8B model (4096 x 4096 attention, 14336 x 4096
MLP up/gate, 4096 x 14336 down, 32000 and 128256 x 4096 vocabularies) and a K that is
not a multiple of any blocksize (4096 x 4104); the default ``ci`` profile takes the first
of these a backend claims, so the H100 run stays within its minute, and ``thorough`` all
of them in every dtype. On the CPU, where bitsandbytes compiles per shape and Triton
interprets, two shapes cross the same thresholds at a fraction of the size. On a GPU, the
2^31-element case (the int32 index-overflow class: dequantize, a matmul on every declared
route, the gradient) is ``large`` (opt-in: ``-m large``, or ``--qconform-large`` beside the
rest; docs/running.md), run in a child process so that a crash there ends in a verdict; it
is skipped with the reason where the GPU lacks the memory. The other sizes real runs reach
(65536 rows, K = 14336, N = 151936) are the matmul, dequantize and backward suites' own.
"""

from __future__ import annotations

import math

import pytest
import torch
from pytest_qconform.reference import bounds, linear

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.cases.strategies import WeightCase
from pytest_qconform.session.outcomes import OOM_PREFIX, skip_not_claimed

from ._cases import reference_decode, require_claim, weight_error
from ._isolated import run_isolated
from ._large import check_in_chunks, route_rows

# GPU, ci: the first shape a backend claims (a K of 4104 is no multiple of any blocksize,
# nor of HQQ's groups, so HQQ takes 4096 x 4096): about 2 s a case on the H100, where the
# whole list took 15-24 s (the float64 reference of a 32000 x 4096 weight is 1 GiB).
GPU_SHAPES = {
    "ci": ((4096, 4104), (4096, 4096)),
    "thorough": ((4096, 4104), (4096, 4096), (14336, 4096), (4096, 14336), (32000, 4096), (128256, 4096)),
}
# CPU: K a multiple of 256 (the fused rows kernel's) with N not a multiple of its 4-row
# group and 2 nested groups (18 x 1024, small: the interpreter runs the rows kernel at
# ~1 s per 10^5 weights); K not a multiple of any blocksize, 9 nested groups, more than
# 2^17 elements (136 x 1000). thorough adds 19 nested groups at K = 2304.
CPU_SHAPES = {"ci": ((18, 1024), (136, 1000)), "thorough": ((18, 1024), (136, 1000), (130, 2304))}
ROWS = {"cuda": (1, 3, 512), "cpu": (1, 3, 64)}  # batch 1, a few rows, a prefill


def _claimed_shape(spec: QuantSpec, shape: tuple[int, int]) -> bool:
    """HQQ groups run along rows of the flattened weight: K must divide by the group."""
    return spec.format != "hqq4" or shape[1] % spec.blocksize == 0


def layer_shapes(spec: QuantSpec, qprofile: str, device: torch.device) -> list[tuple[int, int]]:
    """The shapes a spec is checked on: every claimed one, except on a GPU in ``ci``
    (the first claimed one: the default H100 run stays within its minute)."""
    claimed = [s for s in (GPU_SHAPES if device.type == "cuda" else CPU_SHAPES)[qprofile] if _claimed_shape(spec, s)]
    return claimed[:1] if device.type == "cuda" and qprofile == "ci" else claimed


@pytest.mark.qconform_operation("real-shapes")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "dtype")
def test_layer_shapes(qtarget, qbackend, qdevice, qcheck, qprofile, spec, dtype):
    """Per shape: quantize, dequantize into ``dtype`` (against the reference decoding of
    the backend's own bytes, in slices), matmul at batch 1, a few rows and a prefill, and
    the backward of the prefill."""
    require_claim(qbackend, qtarget, spec, dtype, backward=True, dequantize=True)
    for shape in layer_shapes(spec, qprofile, qdevice):
        case = WeightCase(shape, "normal", 2024)
        qcheck.describe(**case.describe())
        quantized = qbackend.quantize(case.make(qdevice), spec)
        packed = qbackend.export_packed(quantized)
        check_in_chunks(qcheck, qbackend.dequantize(quantized, dtype), packed, dtype, f"dequantize {shape}")
        w = reference_decode(packed, qdevice)
        w_errors = {}  # by weight model: bitsandbytes' fused kernels' and the others' (bounds.weight_error)
        for rows in ROWS[qdevice.type]:
            qcheck.describe(rows=rows)
            x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype).to(qdevice)
            x.requires_grad_(rows == ROWS[qdevice.type][-1])
            bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(7)).to(dtype).to(qdevice)
            y = qbackend.matmul(x, quantized, bias, dtype)
            model = (rows == 1, bounds.bnb_fused_kernel_may_run(rows, qdevice))
            if model not in w_errors:
                w_errors[model] = weight_error(packed, w, dtype, rows=rows)
            w_error = w_errors[model]
            qcheck.within(
                y,
                linear.linear(x.double(), w, bias.double()),
                bounds.matmul_bound(x.double(), w, bias.double(), dtype, dtype, w_error=w_error),
                f"matmul {shape} with {rows} rows",
            )
            if x.requires_grad:
                dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(9)).to(dtype).to(qdevice)
                y.backward(dy)
                qcheck.within(
                    x.grad,
                    dy.double() @ w,
                    bounds.grad_bound(dy.double(), w, dtype, dtype, w_error=w_error),
                    f"backward {shape} with {rows} rows",
                )
            del x, y
        del w, w_errors


# 2^31 + 2^25 elements: past the int32 index range by more than one program's tile.
LARGE_SHAPE = (65537, 32768)


# One spec, the one with the most index arithmetic (the nested absmax index too). ``large``:
# opt-in (-m large, or --qconform-large beside the rest), in any profile; on a GPU only.
@pytest.mark.large
@pytest.mark.qconform_heavy  # about a minute an instance: first in its worker's share
@pytest.mark.qconform_operation("large-tensor")
@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "double_quant", format=("nf4",), double_quant=(True,))
def test_more_than_2_31_elements(qtarget, qbackend, qdevice, qcheck, spec):
    """A 65537 x 32768 weight (2^31 + 2^25 elements) adopted from random bytes in
    bitsandbytes' layout (``from_packed``): its dequantization, a matmul at one row and at
    the first row count of each route the backend declares (``_large.route_rows``), and the
    gradient of x where backward is claimed, each compared with the reference in slices."""
    _check_more_than_2_31_elements(qtarget, qbackend, qdevice, qcheck, spec)


# The same in HQQ's layout (its 4-bit, grouped along the rows: axis 1, its default), so that
# HQQ's dequantize and matmul meet a 2^31-element weight too; the reference decodes it a
# slice of whole groups at a time (``_large.slice_groups``).
@pytest.mark.large
@pytest.mark.qconform_heavy
@pytest.mark.qconform_operation("large-tensor")
@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "hqq_axis", format=("hqq4",), hqq_axis=(1,))
def test_more_than_2_31_elements_in_hqq_layout(qtarget, qbackend, qdevice, qcheck, spec):
    """``test_more_than_2_31_elements`` for a weight in HQQ's layout: random 4-bit values
    with a bf16 scale and zero point per group of 64, adopted through ``from_packed``."""
    _check_more_than_2_31_elements(qtarget, qbackend, qdevice, qcheck, spec)


def _check_more_than_2_31_elements(qtarget, qbackend, qdevice, qcheck, spec) -> None:
    if qdevice.type != "cuda":
        skip_not_claimed("2^31-element tensors are checked on a GPU")
    caps = require_claim(qbackend, qtarget, spec, torch.bfloat16, dequantize=True)
    numel = math.prod(LARGE_SHAPE)
    # packed bytes, the bf16 output (and a GEMM route's dequantized weight), slices and workspace
    needed = numel // 2 + numel * 2 + (8 << 30)
    free, _ = torch.cuda.mem_get_info(qdevice)
    if free < needed:
        pytest.skip(f"{OOM_PREFIX} needs about {needed / 2**30:.1f} GiB of GPU memory, {free / 2**30:.1f} GiB free")
    torch.cuda.empty_cache()
    run_isolated(
        "pytest_qconform.suites._large:check_large_tensor",
        qbackend,
        qcheck,
        spec,
        LARGE_SHAPE,
        str(qdevice),
        route_rows(caps),
        caps.backward,
    )
