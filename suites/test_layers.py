"""4-bit layers the way models use them: built, quantized by moving, run in every mode.

Users never call ``quantize_4bit``; they build a layer (``Linear4bit``, ``HQQLinear``,
ours) from a float weight, move it to the device, and call it in train and eval mode,
with and without grad, on activations of every dtype, with the packed bytes stored in every
claimed storage dtype (``Linear4bit(quant_storage=...)``, FSDP-QLoRA's bf16 among them: an
axis of the checks below). Layers have code paths of their
own (bitsandbytes repacks the weight for a CPU kernel in eval mode without grad on
AVX512-BF16 CPUs), so each mode is judged against float64 from the layer's own bytes,
and the layer's stored state must come out of all of it unchanged.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ._cases import dtype_id, reference_decode
from ._layers import (
    LAYER_SHAPE,
    activation,
    bias_of,
    check_forward,
    layer_inputs,
    layer_weight_error,
    lora_gradients,
    require_layer_claim,
    snapshot,
    snapshot_differences,
)

# (training, grad): the four ways a layer is called; x shapes: one row (gemv), a batch, batch x sequence.
MODES = ((True, True), (True, False), (False, True), (False, False))
LEADING = ((1,), (6,), (2, 3))
LORA_RANK, LORA_SCALE = 4, 2.0


def _mode_id(training: bool, grad: bool) -> str:
    return f"{'train' if training else 'eval'}-{'grad' if grad else 'nograd'}"


@pytest.mark.qconform_operation("layer-quantize")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "hqq_axis", "quant_storage", "dtype")
def test_layer_quantized_by_moving_holds_the_reference_quantization(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """A layer built from a float weight and moved to the device holds exactly the bytes
    the backend's quantizer gives that weight (which the quantize suite checks against
    the reference quantizer for bitsandbytes' layout), and they decode to finite values."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    weight, bias = layer_inputs(31, dtype)
    qcheck.describe(shape=LAYER_SHAPE, seed=31, weight_dtype=dtype_id(dtype))
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    functional = qbackend.export_packed(qbackend.quantize(weight.to(qdevice), spec))
    qcheck.equal(
        snapshot_differences(dict(vars(functional)), snapshot(facet, layer)),
        [],
        "layer's stored quantization vs the backend's quantizer on the same weight",
    )
    decoded = reference_decode(facet.packed(layer), qdevice)
    qcheck.equal(tuple(decoded.shape), LAYER_SHAPE, "decoded shape")
    qcheck.equal(bool(np.isfinite(decoded.cpu().numpy()).all()), True, "decoded values finite")


@pytest.mark.qconform_operation("layer-forward")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "hqq_axis", "quant_storage", "dtype")
def test_layer_forward_in_every_mode(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """Train and eval, with and without grad, one row, a batch and batch x sequence, in
    the layer's compute dtype; dx through the layer wherever grad is on."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    weight, bias = layer_inputs(41, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    packed = facet.packed(layer)
    for step, (training, grad) in enumerate(MODES):
        layer.train(training)
        for leading in LEADING:
            qcheck.describe(shape=LAYER_SHAPE, seed=41, mode=_mode_id(training, grad), x_leading=leading)
            x = activation(leading, LAYER_SHAPE[1], step, dtype, qdevice).requires_grad_(grad)
            check_forward(qcheck, packed, layer, x, dtype, f"{_mode_id(training, grad)} x{list(leading)}", grad=grad)


@pytest.mark.qconform_operation("layer-forward")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "quant_storage", "dtype")  # the input's dtype
def test_layer_forward_other_input_dtypes(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """Activations of every other dtype into a layer of compute dtype ``dtype``: what
    PEFT's k-bit preparation (fp32) and mixed-precision models feed a layer. The layer
    computes in its compute dtype and returns the input's dtype."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    weight, bias = layer_inputs(43, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    packed = facet.packed(layer)
    others = [
        d for d in qbackend.capabilities(qdevice).dtypes if d != dtype and (d is not torch.bfloat16 or qtarget.bf16)
    ]
    for x_dtype in others:
        for training, grad in ((True, True), (False, False)):
            layer.train(training)
            qcheck.describe(shape=LAYER_SHAPE, seed=43, mode=_mode_id(training, grad), x_dtype=dtype_id(x_dtype))
            x = activation((3,), LAYER_SHAPE[1], 5, x_dtype, qdevice).requires_grad_(grad)
            check_forward(
                qcheck, packed, layer, x, dtype, f"{dtype_id(x_dtype)} input, {_mode_id(training, grad)}", grad=grad
            )


@pytest.mark.qconform_operation("layer-forward")
@pytest.mark.qconform_axes(
    "format", "double_quant", "hqq_axis", "quant_storage", "dtype"
)  # gradients through the branch
def test_lora_branch_on_the_layer_backward(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """LoRA as PEFT adds it, beside the frozen layer: ``y = layer(x) + s (x A^T) B^T``, the
    adapter in the layer's dtype. Gradients of x, A and B against float64
    (``_layers.lora_gradients``)."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    weight, bias = layer_inputs(47, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice).train()
    packed = facet.packed(layer)
    n, k = LAYER_SHAPE
    gen = torch.Generator().manual_seed(47)
    a = (torch.randn(LORA_RANK, k, generator=gen) * 0.1).to(dtype).to(qdevice).requires_grad_(True)
    b = (torch.randn(n, LORA_RANK, generator=gen) * 0.1).to(dtype).to(qdevice).requires_grad_(True)
    x = activation((2, 3), k, 48, dtype, qdevice).requires_grad_(True)
    qcheck.describe(shape=LAYER_SHAPE, seed=47, lora_rank=LORA_RANK, lora_scale=LORA_SCALE)
    y = layer(x) + LORA_SCALE * ((x @ a.T) @ b.T)
    dy = torch.randn(y.shape, generator=gen).to(dtype).to(qdevice)
    y.backward(dy)
    w = reference_decode(packed, qdevice)
    grads = lora_gradients(
        x.detach().double().reshape(-1, k),
        dy.double().reshape(-1, n),
        w,
        layer_weight_error(packed, w, dtype),
        a.detach().double(),
        b.detach().double(),
        LORA_SCALE,
        dtype,
        dtype,
        dtype,
    )
    for name, got in (("dx", x.grad.reshape(-1, k)), ("lora_A", a.grad), ("lora_B", b.grad)):
        exact, bound = grads[name]
        qcheck.within(got, exact, bound, f"d {name} (through the layer and the LoRA branch)")


@pytest.mark.qconform_operation("layer-state")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis", "quant_storage", "dtype")  # state across forwards
def test_forwards_leave_the_quantization_state_unchanged(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    """After forwards in every mode and input dtype, the layer's stored quantization
    (bytes, absmax or scale/zero, tables, blocksize, shape, dtypes) is bit for bit what
    it was, and a forward after them is still right."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    weight, bias = layer_inputs(53, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    before = snapshot(facet, layer)
    x_dtypes = [d for d in qbackend.capabilities(qdevice).dtypes if d is not torch.bfloat16 or qtarget.bf16]
    for training, grad in MODES:
        layer.train(training)
        for x_dtype in x_dtypes:
            x = activation((3,), LAYER_SHAPE[1], 7, x_dtype, qdevice)
            try:
                if grad:
                    layer(x.requires_grad_(True)).sum().backward()
                else:
                    with torch.no_grad():
                        layer(x)
            except RuntimeError:
                continue  # a layer that refuses an input dtype is judged by layer-forward, not here
    qcheck.describe(shape=LAYER_SHAPE, seed=53, after="forwards in train/eval, grad/no-grad, every input dtype")
    qcheck.equal(snapshot_differences(before, snapshot(facet, layer)), [], "stored quantization state after forwards")
    layer.train()
    check_forward(
        qcheck,
        facet.packed(layer),
        layer,
        activation((3,), LAYER_SHAPE[1], 9, dtype, qdevice),
        dtype,
        "forward after the others (from the state as it is now)",
        grad=False,
    )


@pytest.mark.qconform_operation("layer-state")
@pytest.mark.qconform_dtype("fp32")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # the bias across forwards
def test_forwards_leave_the_bias_unchanged(qtarget, qbackend, qdevice, qcheck, spec):
    """A bf16 (fp16 without bf16) layer given an fp32 bias keeps it fp32 and unchanged
    through forwards in every mode: a forward must not round a parameter that the
    optimizer and the next checkpoint own. (The cell's dtype is the bias's.)"""
    dtype = torch.float32
    compute = torch.bfloat16 if qtarget.bf16 else torch.float16
    facet, _ = require_layer_claim(qbackend, qtarget, spec, compute)
    weight, bias = layer_inputs(59, dtype)
    layer = facet.quantize(weight.to(compute), bias, spec, compute, qdevice)
    stored = bias_of(layer)
    if stored is None or stored.dtype != dtype:
        held = "no" if stored is None else dtype_id(stored.dtype)
        pytest.skip(f"not claimed: {qbackend.name}'s layer holds the bias in {held} dtype, not the fp32 it was given")
    before = stored.clone()
    qcheck.describe(shape=LAYER_SHAPE, seed=59, compute_dtype=dtype_id(compute), bias_dtype=dtype_id(dtype))
    for training, grad in MODES:
        layer.train(training)
        x = activation((3,), LAYER_SHAPE[1], 11, compute, qdevice)
        with torch.set_grad_enabled(grad):
            layer(x)
    after = bias_of(layer)
    qcheck.equal(after.dtype, before.dtype, "bias dtype after forwards")
    qcheck.equal(bool(torch.equal(after, before)), True, "bias values unchanged after forwards")
