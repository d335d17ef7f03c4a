"""Interop: checkpoints across platform defaults, and bytes across backends.

A checkpoint quantized with blocksize 64 (the CUDA default) loaded where the default is
128 (ROCm), and the reverse, through the backend's serialization: it must decode exactly
as before saving, or refuse with an error that names the blocksize; never be silently
wrong. Bytes quantized by bitsandbytes must decode identically through every other
backend that reads its layout (our Triton kernels) and through the reference. bitsandbytes
serves as the byte source whenever it is installed, selected or not; its own decoding is
judged only when it is under test.
"""

from __future__ import annotations

import pytest
import torch

from pytest_qconform.cases.strategies import WeightCase

from ._cases import packed_dequantize_bound, reference_decode, require_claim

pytestmark = pytest.mark.qconform_operation("interop")


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", format=("nf4", "fp4"))
def test_checkpoint_decodes_exactly_after_reload(qtarget, qbackend, qdevice, qcheck, spec):
    require_claim(qbackend, qtarget, spec, torch.float32, serialize=True, dequantize=True)
    case = WeightCase((33, 47), "normal", 11)
    qcheck.describe(**case.describe(), platform_default_blocksize=qtarget.default_blocksize)
    quantized = qbackend.quantize(case.make(qdevice), spec)
    before = qbackend.dequantize(quantized, torch.float32)
    state = qbackend.serialize(quantized)
    try:
        loaded = qbackend.load(state, qdevice)
    except Exception as exc:  # noqa: BLE001 - a refusal is allowed if it is clear
        if "blocksize" not in str(exc).lower():
            raise AssertionError(
                f"load refused without naming the blocksize: {type(exc).__name__}: {exc}; " + qcheck._where()
            ) from exc
        return
    after = qbackend.dequantize(loaded, torch.float32)
    qcheck.equal(qbackend.export_packed(loaded).blocksize, spec.blocksize, "blocksize after reload")
    qcheck.equal(bool(torch.equal(before, after)), True, "decoded values identical after reload")
    packed = qbackend.export_packed(loaded)
    exact = reference_decode(packed, qdevice)
    qcheck.within(after, exact, packed_dequantize_bound(packed, exact, torch.float32), "reloaded vs reference")


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", format=("nf4", "fp4"))
def test_bitsandbytes_bytes_decode_identically(qtarget, qbackend, qdevice, qcheck, qbackend_named, spec):
    if qbackend.name == "bitsandbytes":
        pytest.skip("not claimed: bitsandbytes is the producer of these bytes")
    require_claim(qbackend, qtarget, spec, torch.float32, dequantize=True)
    producer = qbackend_named("bitsandbytes")
    require_claim(producer, qtarget, spec, torch.float32)
    case = WeightCase((33, 47), "outliers", 12)
    qcheck.describe(**case.describe(), producer=f"bitsandbytes {producer.availability().version}")
    produced = producer.quantize(case.make(qdevice), spec)
    packed = producer.export_packed(produced)
    try:
        adopted = qbackend.from_packed(packed, qdevice)
    except NotImplementedError:
        pytest.skip(f"not claimed: {qbackend.name} does not read bitsandbytes' layout")
    ours = qbackend.dequantize(adopted, torch.float32)
    exact = reference_decode(packed, qdevice)
    bound = packed_dequantize_bound(packed, exact, torch.float32)
    qcheck.within(ours, exact, bound, f"{qbackend.name} decoding bitsandbytes bytes vs reference")
    if qbackend_named.under_test("bitsandbytes"):  # else a byte source only: its decoding is not on trial here
        theirs = producer.dequantize(produced, torch.float32)
        qcheck.within(theirs, exact, bound, "bitsandbytes decoding its own bytes vs reference")
