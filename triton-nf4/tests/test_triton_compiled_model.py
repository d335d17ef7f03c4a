"""A model of our layers under ``torch.compile``: the path serving takes (issue 38).

Dynamo must trace a forward through ``FunctionalLinear`` and the Triton adapter in one
graph, with our matmul as the custom operator ``qconform::nf4_linear`` (inductor calls it
from its generated code, and ``mode="reduce-overhead"`` captures that graph in one CUDA
graph; bench/decode_step.py times that on a GPU). On the CPU the operator runs the
kernels in Triton's interpreter; the graph is the same."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from pytest_qconform.backends.base import QuantSpec  # noqa: E402  (after TRITON_INTERPRET)
from qconform_triton_nf4.backend import TritonNf4Backend  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
HIDDEN, INTERMEDIATE = 128, 256


class Block(torch.nn.Module):
    def __init__(self, up: torch.nn.Module, down: torch.nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    layers = TritonNf4Backend().layers()
    generator = torch.Generator().manual_seed(0)

    def linear(n: int, k: int) -> torch.nn.Module:
        weight = torch.randn(n, k, generator=generator).to(torch.bfloat16)
        return layers.quantize(weight, None, QuantSpec("nf4", 64), torch.bfloat16, DEVICE)

    blocks = [Block(linear(INTERMEDIATE, HIDDEN), linear(HIDDEN, INTERMEDIATE)) for _ in range(2)]
    return torch.nn.Sequential(*blocks).eval()


def test_a_two_layer_model_traces_in_one_graph_through_the_custom_operator(model) -> None:
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(1)).to(DEVICE, torch.bfloat16)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            explained = torch._dynamo.explain(model)(x)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons
    assert explained.graph_count == 1
    targets = [str(node.target) for graph in explained.graphs for node in graph.graph.nodes]
    assert sum("qconform.nf4_linear" in target for target in targets) == 4, targets


def test_the_weights_are_static_addresses_to_a_compiled_graph(model) -> None:
    """A CUDA graph reads them in place instead of copying them in before every replay."""
    state = model[0].up.quantized.handle
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in (state.packed, state.absmax))


def test_a_compiled_layer_computes_with_buffers_replaced_from_outside() -> None:
    """accelerate's ``set_module_tensor_to_device`` (a move, or a load as transformers loads)
    assigns ``module._buffers[name]`` directly. A layer compiled before must then compute
    with the new state, not with the one it was traced from: dynamo's guards on the layer's
    buffers (the staleness check of ``FunctionalLinear.quantized``, traced) see the
    replacement and the layer is traced again."""
    set_module_tensor_to_device = pytest.importorskip("accelerate.utils").set_module_tensor_to_device
    layers = TritonNf4Backend().layers()

    def linear(seed: int) -> torch.nn.Module:
        weight = torch.randn(HIDDEN, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        return layers.quantize(weight, None, QuantSpec("nf4", 64), torch.bfloat16, DEVICE)

    saved, loading = linear(11), linear(12)
    x = torch.randn(1, HIDDEN, generator=torch.Generator().manual_seed(2)).to(DEVICE, torch.bfloat16)
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            compiled = torch.compile(loading, backend="eager")
            assert torch.equal(compiled(x), loading(x))
            for name, value in saved.state_dict().items():
                set_module_tensor_to_device(loading, name, DEVICE, value=value)
            assert torch.equal(compiled(x), saved(x))
    finally:
        torch._dynamo.reset()
