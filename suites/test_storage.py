"""Packed storage dtypes: the same 4-bit bytes stored as bf16, fp16 or fp32 elements.

bitsandbytes' ``quant_storage`` lets the packed weight live in a float tensor (so FSDP
shards it with the other parameters: the QLoRA-with-FSDP recipe stores it as bf16).
The storage dtype is a view of the bytes, never a conversion of values: quantize must
produce the very bytes it produces for uint8 storage, and dequantize, matmul and a
checkpoint round trip (``serialize``, safetensors, ``load``) must read them back
bit-identical, with numbers within bound of the float64 decoding. These are fixed rows (1
and 5); the storage dtype is also an axis of the route, backward, layer and workload checks
(``quant_storage``), where it meets every route, layout and dtype.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bounds, linear

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.cases.strategies import WeightCase

from ._cases import packed_dequantize_bound, reference_decode, require_claim, weight_error

pytestmark = pytest.mark.qconform_operation("storage")

STORAGES = (torch.bfloat16, torch.float16, torch.float32)
# Element counts whose packed bytes divide into 4-byte elements: 8192 and 1568 elements.
STORAGE_SHAPES = ((64, 128), (32, 49))


def _safetensors_round_trip(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` written to safetensors bytes and read back (what a checkpoint on disk holds)."""
    from safetensors.torch import load, save

    return load(save({key: value.detach().cpu().contiguous() for key, value in state.items()}))


@pytest.mark.qconform_axes(
    "format",
    "double_quant",
    "quant_storage",
    format=("nf4", "fp4"),  # a view of the bytes
    quant_storage=STORAGES,
)
def test_storage_dtype_keeps_the_bytes(qtarget, qbackend, qdevice, qcheck, spec):
    """quantize -> bytes identical to uint8 storage's; dequantize and matmul (1 and 5 rows)
    within bound, in the storage dtype itself (the FSDP setup: bf16 storage, bf16 compute;
    the other dtypes read the same bytes the same way); serialize -> safetensors -> load
    -> bytes identical again and dequantize identical to before."""
    dtype = spec.quant_storage
    require_claim(qbackend, qtarget, spec, dtype, serialize=True, dequantize=True)
    for index, shape in enumerate(STORAGE_SHAPES):
        case = WeightCase(shape, "outliers", 40 + index)
        qcheck.describe(**case.describe(), quant_storage=str(spec.quant_storage))
        weight = case.make(qdevice)
        quantized = qbackend.quantize(weight, spec)
        packed = qbackend.export_packed(quantized)
        as_uint8 = qbackend.export_packed(
            qbackend.quantize(weight, QuantSpec(spec.format, spec.blocksize, spec.double_quant))
        )
        qcheck.equal(
            bool(np.array_equal(np.asarray(packed.packed), np.asarray(as_uint8.packed))),
            True,
            f"packed bytes stored as {spec.quant_storage} equal the uint8-stored bytes",
        )
        exact = reference_decode(packed, qdevice)
        out = qbackend.dequantize(quantized, dtype)
        qcheck.within(out, exact, packed_dequantize_bound(packed, exact, dtype), "dequantize from the stored bytes")
        for rows in (1, 5):
            x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype).to(qdevice)
            y = qbackend.matmul(x, quantized, None, dtype)
            bound = bounds.matmul_bound(
                x.double(), exact, None, dtype, dtype, w_error=weight_error(packed, exact, dtype, rows=rows)
            )
            qcheck.within(y, linear.linear(x.double(), exact), bound, f"matmul with {rows} rows from the stored bytes")
        loaded = qbackend.load(_safetensors_round_trip(qbackend.serialize(quantized)), qdevice)
        reloaded = qbackend.export_packed(loaded)
        qcheck.equal(
            bool(np.array_equal(np.asarray(reloaded.packed), np.asarray(packed.packed))),
            True,
            "packed bytes after serialize -> safetensors -> load",
        )
        qcheck.equal(
            bool(torch.equal(qbackend.dequantize(loaded, dtype), out)),
            True,
            "dequantize after the checkpoint round trip equals before",
        )
