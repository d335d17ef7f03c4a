"""PEFT LoRA on 4-bit layers: a QLoRA training step, and merging the adapter into the
4-bit weight.

The model is a tiny Llama whose linear layers are the backend's (``_layers.quantized_tiny_llama``),
prepared with ``prepare_model_for_kbit_training`` (which upcasts the rest of the model
to fp32, so the 4-bit layers get fp32 activations) and wrapped by ``get_peft_model``
with LoRA on attention and MLP projections, adapters initialized at random
(``init_lora_weights=False``) so that they change something.

Training step: the LM loss's backward through every LoRA layer. Each layer's input and
upstream gradient are captured by hooks; its adapters' gradients (and its dx where one
flows) are judged against float64 from the layer's own bytes (``_layers.lora_gradients``).

Merge: PEFT dequantizes the 4-bit weight, adds ``s B A`` and quantizes the sum again
(bitsandbytes: a new ``Params4bit``; HQQ: a new ``HQQLinear``). The new weight must be
the target quantized to nearest on its own grid (``reference.requantize``), the target's
error being what PEFT's arithmetic allows (the dequantize in the stored dtype, the fp32
delta, the fp32 sum). Then unmerge (the same, subtracting), then ``merge_and_unload``.
"""

from __future__ import annotations

import pytest
import torch
from pytest_qconform.reference import bounds

from ._cases import dtype_id, reference_decode
from ._layers import (
    check_requantized,
    layer_weight_error,
    lora_delta,
    lora_gradients,
    needs,
    quantized_tiny_llama,
    require_layer_claim,
)

# Double quantization too: merging requantizes the base weight, and the reference's
# requantization bound (reference.requantize) places a nested absmax's grid from the merged
# target's block maxima, known to within the target's error.
PEFT_AXES = ("format", "blocksize", "double_quant", "hqq_axis")
TARGETS = ("q_proj", "v_proj", "down_proj")
RANK, ALPHA = 4, 8  # scaling alpha / r = 2, a power of two
U32 = bounds.unit_roundoff(torch.float32)


def _peft_model(qcheck, facet, caps, spec, dtype, device, tmp_path):
    peft = needs("peft")
    model = quantized_tiny_llama(qcheck, facet, caps, spec, dtype, device, tmp_path, seed=101)
    model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    torch.manual_seed(103)
    config = peft.LoraConfig(
        r=RANK, lora_alpha=ALPHA, target_modules=list(TARGETS), lora_dropout=0.0, init_lora_weights=False
    )
    return peft.get_peft_model(model, config)


def _lora_layers(facet, model) -> dict[str, torch.nn.Module]:
    return {
        name: m
        for name, m in model.named_modules()
        if hasattr(m, "lora_A") and isinstance(getattr(m, "base_layer", None), facet.layer_types())
    }


@pytest.mark.qconform_operation("lora")
@pytest.mark.qconform_axes("format", "hqq_axis", "dtype", dtype=(torch.bfloat16, torch.float16))  # training
def test_qlora_training_step(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, dtype):
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype, backward=True, peft=True)
    model = _peft_model(qcheck, facet, caps, spec, dtype, qdevice, tmp_path)
    layers = _lora_layers(facet, model)
    qcheck.equal(sorted(n.rsplit(".", 1)[-1] for n in layers), sorted(TARGETS), "PEFT wrapped the 4-bit layers")
    seen: dict[str, dict[str, torch.Tensor]] = {name: {} for name in layers}
    for name, module in layers.items():
        module.register_forward_hook(lambda m, args, out, n=name: seen[n].update(x=args[0].detach().clone()))
        module.register_full_backward_hook(
            lambda m, grad_in, grad_out, n=name: seen[n].update(dy=grad_out[0].detach().clone(), dx=grad_in[0])
        )
    tokens = torch.arange(16, device=qdevice).reshape(2, 8) % 128
    qcheck.describe(model="tiny Llama, 1 layer, hidden 128", lora=f"r={RANK} alpha={ALPHA} on {','.join(TARGETS)}")
    model.train()
    model(input_ids=tokens, labels=tokens).loss.backward()
    for name, module in layers.items():
        short = name.split("model.", 1)[-1]
        a, b = module.lora_A["default"].weight, module.lora_B["default"].weight
        for what, grad in (("lora_A", a.grad), ("lora_B", b.grad)):
            state = "missing" if grad is None else "finite" if bool(torch.isfinite(grad).all()) else "not finite"
            qcheck.equal(state, "finite", f"{short}: gradient of {what}")
        x, dy = seen[name]["x"], seen[name]["dy"]
        packed = facet.packed(module.base_layer)
        w = reference_decode(packed, qdevice)
        k, n = w.shape[1], w.shape[0]
        grads = lora_gradients(
            x.double().reshape(-1, k),
            dy.double().reshape(-1, n),
            w,
            layer_weight_error(packed, w, dtype),
            a.detach().double(),
            b.detach().double(),
            ALPHA / RANK,
            dtype,
            a.dtype,
            x.dtype,
        )
        got = {"lora_A": a.grad, "lora_B": b.grad}
        if seen[name].get("dx") is not None:
            got["dx"] = seen[name]["dx"].reshape(-1, k)
        for what, value in got.items():
            exact, bound = grads[what]
            qcheck.within(value, exact, bound, f"{short}: d {what} ({dtype_id(x.dtype)} activations)")


@pytest.mark.qconform_operation("lora-merge")
@pytest.mark.qconform_axes(*PEFT_AXES)
def test_merge_unmerge_and_unload(qtarget, qbackend, qdevice, qcheck, tmp_path, spec):
    dtype = torch.bfloat16 if qtarget.bf16 else torch.float16
    facet, caps = require_layer_claim(qbackend, qtarget, spec, dtype, peft=True)
    model = _peft_model(qcheck, facet, caps, spec, dtype, qdevice, tmp_path)
    layers = _lora_layers(facet, model)
    qcheck.equal(len(layers), len(TARGETS), "PEFT wrapped the 4-bit layers")
    qcheck.describe(model="tiny Llama, 1 layer, hidden 128", lora=f"r={RANK} alpha={ALPHA}", dtype=dtype_id(dtype))
    deltas = {name: lora_delta(module, ALPHA / RANK) for name, module in layers.items()}
    stored = {name: facet.packed(module.get_base_layer()) for name, module in layers.items()}
    model.merge_adapter()
    for name, module in layers.items():
        stored[name] = check_requantized(
            qcheck,
            facet,
            module.get_base_layer(),
            stored[name],
            *deltas[name],
            1.0,
            f"{name.split('model.', 1)[-1]}: merged weight",
        )
    model.unmerge_adapter()
    for name, module in layers.items():
        stored[name] = check_requantized(
            qcheck,
            facet,
            module.get_base_layer(),
            stored[name],
            *deltas[name],
            -1.0,
            f"{name.split('model.', 1)[-1]}: unmerged weight",
        )
    merged = model.merge_and_unload()
    modules = dict(merged.named_modules())
    for name in layers:
        path = name.removeprefix("base_model.model.")
        unloaded = modules.get(path)
        qcheck.equal(isinstance(unloaded, facet.layer_types()), True, f"{path} is a 4-bit layer after merge_and_unload")
        check_requantized(qcheck, facet, unloaded, stored[name], *deltas[name], 1.0, f"{path}: merge_and_unload")
