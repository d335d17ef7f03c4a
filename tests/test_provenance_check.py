"""Provenance's own check (suites/_provenance.py): it fails on each way the bytes or the
tensors of a model can stop being its source's, and passes the model built from it."""

from __future__ import annotations

import types

import pytest
import torch

from pytest_qconform.session.fixtures import Checker

pytest.importorskip("transformers")


def _quantized(family: str, dtype: torch.dtype = torch.bfloat16, double_quant: bool = False, backend=None):
    """``family`` from its source checkpoint, its linear layers replaced by the example
    backend's 4-bit layer (or ``backend``'s; as ``quantized_model`` does for a backend without
    a transformers config); the layer facet, the model and its ``Source``."""
    from pytest_qconform.suites._provenance import source_checkpoint
    from pytest_qconform.suites._workloads import _replace_linears, float_model
    from qconform_example_nf4.backend import TorchNF4Backend

    from pytest_qconform.backends.functional_layer import FunctionalLayers
    from pytest_qconform.backends.spec import QuantSpec

    facet = FunctionalLayers(TorchNF4Backend()) if backend is None else backend.layers()
    spec = QuantSpec("nf4", 64, double_quant)

    def quantize(weight, bias, name):
        return facet.quantize(weight.cpu(), None if bias is None else bias.detach(), spec, dtype, "cpu")

    lm = float_model(family, dtype, 211)
    _replace_linears(lm, quantize)
    return facet, lm, source_checkpoint(float_model(family, dtype, 211))


def _qcheck() -> Checker:
    return Checker(types.SimpleNamespace(user_properties=[]))


def test_a_model_built_from_its_source_passes():
    from pytest_qconform.suites._provenance import check_provenance

    for family in ("gpt2", "llama"):
        facet, lm, source = _quantized(family)
        check_provenance(_qcheck(), facet, lm, source)
        check_provenance(_qcheck(), facet, lm.to(torch.float32), source)  # a widening cast is exact


def test_swapped_layers_fail_naming_whose_weight_each_holds():
    """q_proj's layer in k_proj's place and back (same shape): each decodes within bounds
    of a source weight, the wrong one."""
    from pytest_qconform.suites._provenance import check_provenance

    facet, lm, source = _quantized("llama")
    attn = lm.model.layers[0].self_attn
    attn.q_proj, attn.k_proj = attn.k_proj, attn.q_proj
    with pytest.raises(AssertionError, match=r"self_attn.q_proj: .* quantization of model.layers.0.self_attn.k_proj"):
        check_provenance(_qcheck(), facet, lm, source)


def test_a_layer_requantized_from_its_decoded_weight_at_another_blocksize_fails():
    """The bytes of a layer quantized again from its own dequantized weight at blocksize 128
    (a move or load that requantizes at the platform's default): its absmax is still each
    128-block's max |w|, but rounding twice puts elements off the nearest value of the new
    grid. (Requantizing at the same blocksize is idempotent, and passes.)"""
    import dataclasses

    from pytest_qconform.suites._provenance import check_provenance

    facet, lm, source = _quantized("llama")
    layer = lm.model.layers[1].mlp.down_proj
    decoded = facet.backend.dequantize(layer.quantized, torch.bfloat16)
    spec = layer.quantized.spec
    lm.model.layers[1].mlp.down_proj = facet.quantize(decoded, None, spec, torch.bfloat16, "cpu")
    check_provenance(_qcheck(), facet, lm, source)
    wider = dataclasses.replace(spec, blocksize=128)
    lm.model.layers[1].mlp.down_proj = facet.quantize(decoded, None, wider, torch.bfloat16, "cpu")
    with pytest.raises(AssertionError, match=r"down_proj: neither its source's quantization: decodes"):
        check_provenance(_qcheck(), facet, lm, source)


def test_float_tensors_and_ties_must_stay_their_sources():
    from pytest_qconform.suites._provenance import check_provenance

    facet, lm, source = _quantized("gpt2")
    with torch.no_grad():
        lm.transformer.h[0].attn.c_attn.bias[3] += 2.0**-6  # a quantized layer's bias
    with pytest.raises(AssertionError, match=r"c_attn.bias: differs from the source"):
        check_provenance(_qcheck(), facet, lm, source)
    facet, lm, source = _quantized("gpt2")
    lm.lm_head.weight = torch.nn.Parameter(lm.lm_head.weight.detach().clone())  # untied, equal values
    with pytest.raises(AssertionError, match=r"tied in the source that no longer share storage"):
        check_provenance(_qcheck(), facet, lm, source)
    facet, lm, source = _quantized("gpt2")
    del lm.transformer.h[1].ln_2.bias
    lm.transformer.h[1].ln_2.bias = None
    with pytest.raises(AssertionError, match=r"ln_2.bias: in the source checkpoint, not in the model"):
        check_provenance(_qcheck(), facet, lm, source)


def test_double_quantized_layers_are_traced_to_their_source():
    """A double-quantized layer's absmax is stored as 8-bit codes of ``absmax - offset``:
    provenance traces the offset, each nested absmax and each decoded absmax to the source's
    block maxima, then the codes to the grid the quantizer rounded on. The model built from
    its source passes (the example backend's quantizer and bitsandbytes' own); a nested absmax
    taken from another layer, and swapped layers, fail, naming what is wrong."""
    from pytest_qconform.suites._provenance import check_provenance

    backends = [None]
    try:
        from pytest_qconform.backends import registry

        backends.append(registry.create("bitsandbytes"))
    except Exception:  # noqa: BLE001 - bitsandbytes missing: the example backend alone
        pass
    for backend in backends:
        facet, lm, source = _quantized("llama", double_quant=True, backend=backend)
        check_provenance(_qcheck(), facet, lm, source)
    facet, lm, source = _quantized("llama", double_quant=True)
    attn = lm.model.layers[0].self_attn
    layer, other = attn.o_proj, attn.q_proj
    assert facet.packed(layer).double_quant
    layer._buffers["quant_nested_absmax"] = other._buffers["quant_nested_absmax"] * 1.5  # a neighbour's, scaled
    layer._rebuild()
    with pytest.raises(AssertionError, match=r"o_proj: .*nested absmax are not their group's max"):
        check_provenance(_qcheck(), facet, lm, source)
    facet, lm, source = _quantized("llama", double_quant=True)
    layer = lm.model.layers[0].self_attn.o_proj
    layer._buffers["quant_nested_absmax"] = torch.full_like(layer._buffers["quant_nested_absmax"], float("nan"))
    layer._rebuild()
    with pytest.raises(AssertionError, match=r"o_proj: .*nested absmax are not their group's max"):
        check_provenance(_qcheck(), facet, lm, source)  # NaN against the source is no match
    facet, lm, source = _quantized("llama", double_quant=True)
    attn = lm.model.layers[0].self_attn
    attn.q_proj, attn.k_proj = attn.k_proj, attn.q_proj
    with pytest.raises(AssertionError, match=r"self_attn.q_proj: .*"):
        check_provenance(_qcheck(), facet, lm, source)


def test_a_merged_double_quantized_layer_is_traced_to_its_target():
    """A merge requantizes ``decode + s B A`` (``derived``: the target and its error): the
    quantizer's block maxima are known to within the target's error, so each nested check and
    the grid widen by it. A layer quantized again from the merged target passes (the example
    backend's quantizer and bitsandbytes' own); the layer left with its bytes from before the
    merge, and one with a neighbour's nested absmax, fail."""
    from pytest_qconform.reference import bounds
    from pytest_qconform.suites._cases import reference_decode
    from pytest_qconform.suites._provenance import check_provenance

    from pytest_qconform.backends.spec import QuantSpec

    backends = [None]
    try:
        from pytest_qconform.backends import registry

        backends.append(registry.create("bitsandbytes"))
    except Exception:  # noqa: BLE001 - bitsandbytes missing: the example backend alone
        pass
    name = "model.layers.0.self_attn.o_proj"
    for backend in backends:
        facet, lm, source = _quantized("llama", double_quant=True, backend=backend)
        attn = lm.model.layers[0].self_attn
        before = facet.packed(attn.o_proj)
        w = reference_decode(before, torch.device("cpu"))
        delta = torch.randn(w.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.01
        merged = (w + delta).to(torch.bfloat16)  # the sum as PEFT computes it, in the layer's dtype
        derived = {name: (w + delta, bounds.rounding_bound(w + delta, torch.bfloat16))}
        spec = QuantSpec(before.quant_type, int(before.blocksize), True)
        old = attn.o_proj
        attn.o_proj = facet.quantize(merged, None, spec, torch.bfloat16, "cpu")
        assert facet.packed(attn.o_proj).double_quant
        check_provenance(_qcheck(), facet, lm, source, derived=derived)
        attn.o_proj = old
        with pytest.raises(AssertionError, match=r"o_proj: neither its source's quantization: "):
            check_provenance(_qcheck(), facet, lm, source, derived=derived)
    facet, lm, source = _quantized("llama", double_quant=True)
    attn = lm.model.layers[0].self_attn
    w = reference_decode(facet.packed(attn.o_proj), torch.device("cpu"))
    target = w + torch.randn(w.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64) * 0.01
    derived = {name: (target, bounds.rounding_bound(target, torch.bfloat16))}
    spec = QuantSpec("nf4", 64, True)
    attn.o_proj = facet.quantize(target.to(torch.bfloat16), None, spec, torch.bfloat16, "cpu")
    attn.o_proj._buffers["quant_nested_absmax"] = attn.q_proj._buffers["quant_nested_absmax"] * 1.5
    attn.o_proj._rebuild()
    with pytest.raises(AssertionError, match=r"o_proj: .*nested absmax are not their group's max"):
        check_provenance(_qcheck(), facet, lm, source, derived=derived)
