"""``pytest_qconform.watch``: the call-site oracle judges a model's calls, names the failing
one with its context, refuses a watch that judged nothing, and names a backend it cannot watch."""

from __future__ import annotations

import pytest
import torch
from qconform_example_nf4.backend import TorchNF4Backend
from zoo import _InferenceModeDropsBiasLinear

from pytest_qconform.backends.functional_layer import FunctionalLayers
from pytest_qconform.backends.spec import QuantSpec
from pytest_qconform.watch import WatchFailure, layer_facets, watch


def _model(layer_class=None) -> tuple[torch.nn.Module, dict]:
    backend = TorchNF4Backend()
    facet = (
        FunctionalLayers(backend)
        if layer_class is None
        else type("F", (FunctionalLayers,), {"layer_class": layer_class})(backend)
    )
    gen = torch.Generator().manual_seed(5)
    layers = [
        facet.quantize(
            torch.randn(n, k, generator=gen),
            torch.randn(n, generator=gen),
            QuantSpec("nf4", 64),
            torch.float32,
            torch.device("cpu"),
        )
        for n, k in ((128, 64), (64, 128))
    ]
    return torch.nn.Sequential(layers[0], torch.nn.ReLU(), layers[1]), {backend.name: facet}


def test_every_sampled_call_is_judged_with_its_context() -> None:
    model, facets = _model()
    x = torch.randn(2, 3, 64, requires_grad=True)
    with watch(model, facets) as oracle:
        model(x).sum().backward()
        with torch.inference_mode():
            model(torch.randn(5, 64))
    assert oracle.verdicts and not oracle.failures
    contexts = oracle.summary()["torch-nf4"]["contexts"]
    assert "forward grad cpu 3-D contiguous fp32" in contexts
    assert "forward no-grad inference-mode cpu 2-D contiguous fp32" in contexts
    assert any(signature.startswith("backward") for signature in contexts)


def test_a_call_outside_its_bound_fails_naming_layer_call_and_context() -> None:
    model, facets = _model(_InferenceModeDropsBiasLinear)
    with pytest.raises(WatchFailure, match=r"0 \[torch-nf4\] forward call 1 \(4 rows; forward no-grad inference-mode"):
        with watch(model, facets), torch.inference_mode():
            model(torch.randn(4, 64))


def test_a_watch_that_judged_nothing_fails() -> None:
    model, facets = _model()
    with pytest.raises(WatchFailure, match="judged no call: 2 quantized layers"):
        with watch(model, facets):
            pass


def test_an_unknown_backend_is_named() -> None:
    with pytest.raises(Exception, match="unknown backend 'no-such-backend'"):
        layer_facets(["no-such-backend"])
