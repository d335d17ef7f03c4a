"""Quantized layers over a process's life: moved between devices, cast with the model,
and loaded one model after another.

Device moves: a layer quantized on the GPU goes to the CPU and back through ``.to``,
``.cpu()`` and ``.cuda()``; each time it must hold the same quantization, bit for bit,
and compute right where it is. ``model.half()`` / ``.to(dtype)`` on a quantized model
must leave the quantization alone (checked on every device). Models in sequence: the
global-buffer class (unsloth PR 4026) at layer level, a bf16 model, then an fp16 one,
then bf16 again, each forward and backward checked, through the same backend instance
(for triton-nf4: the adapter's one ``WeightBuffer``).
"""

from __future__ import annotations

import pytest
import torch

from ._cases import dtype_id
from ._layers import (
    LAYER_SHAPE,
    activation,
    check_forward,
    layer_inputs,
    require_layer_claim,
    snapshot,
    snapshot_differences,
)

# A move there and a move back, each as users write it.
ROUND_TRIPS = {
    "to": (lambda m: m.to("cpu"), lambda m, d: m.to(d)),
    "cuda": (lambda m: m.cpu(), lambda m, d: m.cuda()),
}  # the current device: the target's
MOVE_CLAIMS = {"to": ("to",), "cuda": ("cpu", "cuda")}


def _model_dtype(target) -> torch.dtype:
    return torch.bfloat16 if target.bf16 else torch.float16


@pytest.mark.qconform_operation("device-move")
@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # moves keep whatever bytes
@pytest.mark.parametrize("move", tuple(ROUND_TRIPS), ids=lambda m: {"to": "to", "cuda": "cpu-cuda"}[m])
def test_gpu_to_cpu_and_back(qtarget, qbackend, qdevice, qcheck, spec, move):
    """Quantized on the GPU, to the CPU and back (``.to("cpu")``/``.to(device)``, or
    ``.cpu()``/``.cuda()``): the same stored quantization on each device, and forwards
    that are right on each (on the CPU where the layer claims the CPU)."""
    dtype = _model_dtype(qtarget)
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    for name in MOVE_CLAIMS[move]:
        require_layer_claim(qbackend, qtarget, spec, dtype, move=name)
    if qdevice.type != "cuda":
        pytest.skip("needs a GPU: the move is GPU -> CPU -> GPU")
    weight, bias = layer_inputs(83, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    before = snapshot(facet, layer)
    to_cpu, back = ROUND_TRIPS[move]
    qcheck.describe(shape=LAYER_SHAPE, seed=83, move=move)
    layer = to_cpu(layer)
    cpu_claimed = "cpu" in qbackend.capabilities(torch.device("cpu")).devices
    if cpu_claimed:
        check_forward(
            qcheck,
            facet.packed(layer),
            layer,
            activation((3,), LAYER_SHAPE[1], 1, dtype, "cpu"),
            dtype,
            "forward on the CPU after the move",
            grad=False,
        )
    qcheck.equal(snapshot_differences(before, snapshot(facet, layer)), [], "stored quantization on the CPU")
    layer = back(layer, qdevice)
    qcheck.equal(snapshot_differences(before, snapshot(facet, layer)), [], "stored quantization back on the GPU")
    check_forward(
        qcheck,
        facet.packed(layer),
        layer,
        activation((3,), LAYER_SHAPE[1], 2, dtype, qdevice),
        dtype,
        "forward back on the GPU",
    )


@pytest.mark.qconform_operation("device-move")
@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # casts keep whatever bytes
def test_dtype_cast_of_a_quantized_layer_keeps_its_quantization(qtarget, qbackend, qdevice, qcheck, spec):
    """``model.half()``, ``.to(torch.bfloat16)``, ``.float()`` on a quantized layer cast
    what is float (the bias) and leave the quantization bit for bit; it still computes."""
    dtype = _model_dtype(qtarget)
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, move="to")
    weight, bias = layer_inputs(89, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    before = snapshot(facet, layer)
    casts = (
        ("half()", lambda m: m.half()),
        ("to(bfloat16)", lambda m: m.to(torch.bfloat16)),
        ("float()", lambda m: m.float()),
        (f"to({dtype_id(dtype)})", lambda m: m.to(dtype)),
    )
    for name, cast in casts:
        qcheck.describe(shape=LAYER_SHAPE, seed=89, cast=name)
        layer = cast(layer)
        qcheck.equal(snapshot_differences(before, snapshot(facet, layer)), [], f"stored quantization after .{name}")
    check_forward(
        qcheck,
        facet.packed(layer),
        layer,
        activation((3,), LAYER_SHAPE[1], 4, dtype, qdevice),
        dtype,
        "forward after the casts",
        grad=False,
    )


SEQUENCE = (torch.bfloat16, torch.float16, torch.bfloat16)
MODEL_SHAPES = ((128, 128), (64, 128))  # two layers of other shapes: a buffer must follow both


@pytest.mark.qconform_operation("layer-sequencing")
@pytest.mark.qconform_axes("format")  # a buffer across models: the dtype sequence, not the layout
def test_models_loaded_one_after_another(qtarget, qbackend, qdevice, qcheck, spec):
    """A bf16 model, then an fp16 one, then bf16 again, in one process and through one
    backend instance: each two-layer model's forward (one row and a batch of 8) and
    backward checked in its own dtype, the previous model deleted first."""
    steps = [d for d in SEQUENCE if d is not torch.bfloat16 or qtarget.bf16]
    for dtype in set(steps):
        facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True)
    for step, dtype in enumerate(steps):
        layers = []
        for index, shape in enumerate(MODEL_SHAPES):
            weight, bias = layer_inputs(97 + 10 * step + index, dtype, shape)
            layers.append(facet.quantize(weight, bias, spec, dtype, qdevice).train())
        model = torch.nn.Sequential(*layers)
        packed = [facet.packed(layer) for layer in layers]
        for rows in (1, 8):
            qcheck.describe(step=step, step_dtype=dtype_id(dtype), rows=rows, shapes=MODEL_SHAPES)
            x = activation((rows,), MODEL_SHAPES[0][1], step, dtype, qdevice).requires_grad_(True)
            hidden = check_forward(qcheck, packed[0], layers[0], x, dtype, f"step {step} ({dtype_id(dtype)}) layer 0")
            check_forward(
                qcheck,
                packed[1],
                layers[1],
                hidden.detach().requires_grad_(True),
                dtype,
                f"step {step} ({dtype_id(dtype)}) layer 1",
            )
        del model, layers
