"""Checkpoints of 4-bit layers: state dicts through safetensors files, and whole models
through transformers' ``save_pretrained`` / ``from_pretrained``.

A checkpoint must come back bit for bit: into a fresh layer built with the *loading*
platform's default blocksize (64 on CUDA, 128 on ROCm: unsloth's pre-quantized
checkpoints at the other platform's blocksize), into a layer that is already quantized
(``load_state_dict``, strict and non-strict, as PEFT and accelerate load), after the
layer has run inference, and through transformers for a tiny Llama built from a config
(random weights, no download). Loading may refuse with an error; it must never leave a
layer that decodes to something else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ._layers import (
    LAYER_SHAPE,
    activation,
    layer_inputs,
    needs,
    require_layer_claim,
    snapshot,
    snapshot_differences,
    tiny_llama,
)

pytestmark = pytest.mark.qconform_operation("checkpoint")
PLATFORM_BLOCKSIZES = (64, 128)  # CUDA/CPU, ROCm


def _through_safetensors(state: dict[str, torch.Tensor], tmp_path, name: str) -> dict[str, torch.Tensor]:
    safetensors_torch = needs("safetensors.torch")
    path = tmp_path / f"{name}.safetensors"
    safetensors_torch.save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return safetensors_torch.load_file(str(path))


def _same_decode(qcheck, before: dict, facet, layer, what: str) -> None:
    qcheck.equal(snapshot_differences(before, snapshot(facet, layer)), [], what)


@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "hqq_axis")
@pytest.mark.parametrize("loading_default", PLATFORM_BLOCKSIZES, ids=lambda b: f"loader-b{b}")
def test_state_dict_file_into_a_fresh_layer(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, loading_default):
    """state_dict -> safetensors file -> a fresh layer built with the loading platform's
    default blocksize -> the library's loader: the same stored quantization, bit for bit."""
    dtype = torch.bfloat16 if qtarget.bf16 else torch.float16
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    if spec.format == "hqq4" and loading_default != spec.blocksize:
        pytest.skip("not claimed: an HQQ loader has no default group size (it takes the checkpoint's)")
    weight, bias = layer_inputs(61, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    before = snapshot(facet, layer)
    qcheck.describe(shape=LAYER_SHAPE, seed=61, saved_blocksize=spec.blocksize, loading_default=loading_default)
    state = _through_safetensors(layer.state_dict(), tmp_path, "layer")
    loader_spec = dataclasses.replace(spec, blocksize=loading_default) if spec.format != "hqq4" else spec
    fresh = facet.load(facet.empty(loader_spec, LAYER_SHAPE, bias is not None, dtype), state, qdevice)
    _same_decode(qcheck, before, facet, fresh, "stored quantization after the round trip")


@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "blocksize", "double_quant", "hqq_axis")
@pytest.mark.parametrize("strict", (True, False), ids=("strict", "nonstrict"))
def test_load_state_dict_into_a_quantized_layer(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, strict):
    """``load_state_dict`` into a layer already quantized from another weight: it raises,
    or the layer then holds the checkpoint's quantization exactly (never the checkpoint's
    bytes with its own old scales)."""
    dtype = torch.bfloat16 if qtarget.bf16 else torch.float16
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    weight, bias = layer_inputs(67, dtype)
    saved = facet.quantize(weight, bias, spec, dtype, qdevice)
    before = snapshot(facet, saved)
    other_weight, other_bias = layer_inputs(71, dtype)
    existing = facet.quantize(other_weight * 3, other_bias, spec, dtype, qdevice)
    qcheck.describe(shape=LAYER_SHAPE, seed=67, strict=strict)
    state = _through_safetensors(saved.state_dict(), tmp_path, "layer")
    try:
        existing.load_state_dict(state, strict=strict)
    except Exception:  # noqa: BLE001 - refusing is allowed; loading half of it is not
        return
    _same_decode(qcheck, before, facet, existing, f"stored quantization after load_state_dict(strict={strict})")


@pytest.mark.qconform_dtype("bf16")
@pytest.mark.qconform_axes("format", "double_quant", "hqq_axis")  # state after a forward
def test_checkpoint_saved_after_inference(qtarget, qbackend, qdevice, qcheck, tmp_path, spec):
    """A checkpoint written after the layer ran in eval mode without grad (what saving a
    model after evaluating it does) reloads to the quantization the layer was built with."""
    dtype = torch.bfloat16 if qtarget.bf16 else torch.float16
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    weight, bias = layer_inputs(73, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice)
    before = snapshot(facet, layer)
    qcheck.describe(shape=LAYER_SHAPE, seed=73, after="eval-mode forward without grad")
    with torch.no_grad():
        layer.eval()(activation((2,), LAYER_SHAPE[1], 3, dtype, qdevice))
    state = _through_safetensors(layer.state_dict(), tmp_path, "layer")
    fresh = facet.load(facet.empty(spec, LAYER_SHAPE, bias is not None, dtype), state, qdevice)
    _same_decode(qcheck, before, facet, fresh, "stored quantization of the checkpoint saved after inference")


@pytest.mark.qconform_axes(
    "format", "double_quant", "hqq_axis", "dtype", dtype=(torch.bfloat16, torch.float16)
)  # the model's path through transformers
def test_pre_quantized_model_through_transformers(qtarget, qbackend, qdevice, qcheck, tmp_path, spec, dtype):
    """A tiny Llama saved in ``dtype``, quantized by ``from_pretrained`` with the backend's
    quantization config, saved pre-quantized with ``save_pretrained`` and loaded back:
    every 4-bit layer holds the same quantization, bit for bit, and the logits agree."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype, transformers=True)
    transformers = needs("transformers")
    model = tiny_llama(dtype, 79)
    model.save_pretrained(tmp_path / "float")
    qcheck.describe(model="tiny Llama, 1 layer, hidden 128", seed=79)
    load = dict(device_map=str(qdevice), dtype=dtype)
    quantized = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=facet.transformers_config(spec, dtype), **load
    )
    layers = {name: m for name, m in quantized.named_modules() if isinstance(m, facet.layer_types())}
    qcheck.equal(len(layers) > 0, True, "transformers replaced the linear layers with the backend's layers")
    before = {name: snapshot(facet, m) for name, m in layers.items()}
    quantized.save_pretrained(tmp_path / "quantized")
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "quantized", **load)
    modules = dict(reloaded.named_modules())
    for name, snap in before.items():
        qcheck.equal(isinstance(modules.get(name), facet.layer_types()), True, f"{name} reloaded as a 4-bit layer")
        _same_decode(qcheck, snap, facet, modules[name], f"{name}: stored quantization after the reload")
    tokens = torch.arange(8, device=qdevice).reshape(1, 8)
    with torch.no_grad():
        logits = (quantized(tokens).logits, reloaded(tokens).logits)
    qcheck.equal(bool(torch.equal(*logits)), True, "logits of the reloaded model equal the saved model's")
