"""Compiled and captured paths: dequantize, matmul and a layer's forward the way serving
stacks run them (vLLM, HQQ's and gemlite's fast paths): under ``torch.compile``, and
captured in a CUDA graph and replayed.

A backend may take another path there: dynamo traces its Python and falls back around
what it cannot trace (graph breaks), libraries branch on ``torch.compiler.is_compiling()``,
and a captured graph replays only the kernels launched on the capturing stream, with the
addresses and host-side values of the capture. So each claimed operation
(``Capabilities.compiled`` / ``.captured``) is judged again there, against the same
float64 decoding of the backend's own bytes and the same bounds as the eager checks.

Inputs change between calls as they do in serving: a compiled function and a replayed
graph each get two different activations (into the same static input for a graph, as
vLLM copies each batch in), and both results are judged, so a path that baked in its
first input fails. A replayed graph's output is filled with NaN before each replay, so a
graph that does not write it (a kernel launched outside the capture) fails too. A
captured dequantize replays the same weight (weights are constant in a captured model).
Inference only (eval mode, no grad), as those stacks run. The captured checks need a GPU.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from pytest_qconform.reference import bounds, linear

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.cases.strategies import WeightCase
from pytest_qconform.session.outcomes import skip_other_device

from ._cases import packed_dequantize_bound, reference_decode, require_claim, weight_error
from ._layers import LAYER_SHAPE, activation, bias_of, check_forward, layer_inputs, require_layer_claim

# The axes the paths depend on: each compiles (or captures) one function per instance, a
# few seconds on a 2-core CPU, so the blocksize, which the eager checks cover at every
# claimed value, is left at the default here; format, double quantization, HQQ's axis
# and the dtype decide which kernel and which traced code a path takes.
PATH_AXES: tuple[str, ...] = ("format", "double_quant", "hqq_axis", "dtype")
# One activation row for matmul (the decode step: fused gemv kernels) and 2 x 9 = 18 rows
# for the layer (a prefill: past every fused small-batch limit, dequantize + GEMM).
MATMUL_LEADING, LAYER_LEADING = (1,), (2, 9)
WARMUP_CALLS = 3  # on a side stream before capture, as torch.cuda.graphs documents


def path_check(operation: str) -> Callable:
    """A check of matrix operation ``operation``, its instances a covering array of ``PATH_AXES``."""

    def instances(test: Callable) -> Callable:
        test = pytest.mark.qconform_axes(*PATH_AXES)(test)
        return pytest.mark.qconform_operation(operation)(test)

    return instances


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each instance compiles its own graphs: dynamo caches compiled code per code object
    (the same lambda for every instance) and, past its recompile limit, runs it eagerly
    without a word, which would judge the eager path here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compile_once(fn: Callable) -> Callable:
    """``torch.compile`` as users call it, static shapes (one graph per instance)."""
    return torch.compile(fn, dynamic=False)


class Captured:
    """``fn(static_input)`` captured in a CUDA graph. Calling it with ``x`` copies ``x`` into
    the static input, fills the static output with NaN, replays, and returns a copy of the
    output. ``bias`` is the captured layer's (``check_forward`` reads it off what it calls).

    Warm-up runs on a side stream first (lazy initialization, kernel compilation and
    allocator state stay out of the graph), as torch.cuda.graphs documents."""

    def __init__(
        self, fn: Callable[[torch.Tensor], torch.Tensor], static_input: torch.Tensor, bias: torch.Tensor | None = None
    ) -> None:
        self.static_input, self.bias = static_input, bias
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(WARMUP_CALLS):
                fn(static_input)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()  # held: the graph and its memory pool live as long as this
        with torch.cuda.graph(self.graph):
            self.static_output = fn(static_input)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.static_input.copy_(x)
        self.static_output.fill_(float("nan"))
        self.graph.replay()
        torch.cuda.synchronize()
        return self.static_output.clone()


def require_gpu(qdevice: torch.device) -> None:
    """Skip as ``other device:`` (no matrix cell, as for any instance of a device this run
    does not report on): a CPU run has nothing to capture, and a skipped cell would fail a
    ``--require pass`` gate."""
    if qdevice.type != "cuda":
        skip_other_device(
            f"GPU only: a CUDA graph captures GPU kernels, and this run computes on the {qdevice.type.upper()}"
        )


def quantized_weight(qbackend, qdevice, spec: QuantSpec, dtype: torch.dtype, seed: int):
    """A weight quantized in the compute dtype (a model loaded in it), so that no backend
    rebuilds its state for another dtype inside the compiled or captured call."""
    weight = WeightCase(LAYER_SHAPE, "normal", seed).make(qdevice).to(dtype)
    return qbackend.quantize(weight, spec)


def judge_dequantize(qcheck, qbackend, quantized, out: torch.Tensor, dtype: torch.dtype, what: str) -> None:
    qcheck.equal(out.dtype, dtype, f"{what}: output dtype")
    qcheck.equal(tuple(out.shape), LAYER_SHAPE, f"{what}: output shape")
    packed = qbackend.export_packed(quantized)
    exact = reference_decode(packed, out.device)
    qcheck.within(out, exact, packed_dequantize_bound(packed, exact, dtype), f"{what} vs reference decoding")


def judge_matmul(
    qcheck,
    qbackend,
    quantized,
    x: torch.Tensor,
    bias: torch.Tensor,
    y: torch.Tensor,
    compute_dtype: torch.dtype,
    what: str,
) -> None:
    """As the matmul suite judges it: float64 ``x W^T + b`` from the backend's bytes."""
    qcheck.equal(y.dtype, x.dtype, f"{what}: output dtype (the activation's dtype)")
    packed = qbackend.export_packed(quantized)
    w_exact = reference_decode(packed, x.device)
    b_exact = bias.double()
    rows = x.numel() // x.shape[-1]
    bound = bounds.matmul_bound(
        x.double(),
        w_exact,
        b_exact,
        compute_dtype,
        y.dtype,
        w_error=weight_error(packed, w_exact, compute_dtype, rows=rows),
    )
    qcheck.within(y, linear.linear(x.double(), w_exact, b_exact), bound, f"{what} vs float64 x W^T + b")


def matmul_case(qbackend, qdevice, spec: QuantSpec, dtype: torch.dtype, seed: int):
    """A quantized weight, a bias in the compute dtype and two different activations."""
    quantized = quantized_weight(qbackend, qdevice, spec, dtype, seed)
    bias = torch.randn(LAYER_SHAPE[0], generator=torch.Generator().manual_seed(seed)).to(dtype).to(qdevice)
    xs = [activation(MATMUL_LEADING, LAYER_SHAPE[1], seed + i, dtype, qdevice) for i in (1, 2)]
    return quantized, bias, xs


def inference_layer(qbackend, qtarget, qdevice, spec: QuantSpec, dtype: torch.dtype, seed: int, **claim):
    """A layer in eval mode, its bytes, and two different activations (the layer's
    claims as the layer suites ask them, plus ``claim``)."""
    facet, _ = require_layer_claim(qbackend, qtarget, spec, dtype)
    require_claim(qbackend, qtarget, spec, dtype, **claim)
    weight, bias = layer_inputs(seed, dtype)
    layer = facet.quantize(weight, bias, spec, dtype, qdevice).eval()
    xs = [activation(LAYER_LEADING, LAYER_SHAPE[1], seed + i, dtype, qdevice) for i in (1, 2)]
    return layer, facet.packed(layer), xs


# -- torch.compile ----------------------------------------------------------------------------


@path_check("compiled")
def test_dequantize_compiled(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    require_claim(qbackend, qtarget, spec, dtype, compiled="dequantize", dequantize=True)
    quantized = quantized_weight(qbackend, qdevice, spec, dtype, 61)
    qcheck.describe(shape=LAYER_SHAPE, seed=61, path="torch.compile")
    dequantize = compile_once(lambda q: qbackend.dequantize(q, dtype))
    with torch.no_grad():
        out = dequantize(quantized)
    judge_dequantize(qcheck, qbackend, quantized, out, dtype, "compiled dequantize")


@path_check("compiled")
def test_matmul_compiled(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    require_claim(qbackend, qtarget, spec, dtype, compiled="matmul")
    quantized, bias, xs = matmul_case(qbackend, qdevice, spec, dtype, 67)
    matmul = compile_once(lambda x: qbackend.matmul(x, quantized, bias, dtype))
    for call, x in enumerate(xs, 1):
        qcheck.describe(shape=LAYER_SHAPE, seed=67, x_leading=MATMUL_LEADING, path="torch.compile", call=call)
        with torch.no_grad():
            y = matmul(x)
        judge_matmul(qcheck, qbackend, quantized, x, bias, y, dtype, f"compiled matmul, call {call}")


@path_check("compiled")
def test_layer_forward_compiled(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    layer, packed, xs = inference_layer(qbackend, qtarget, qdevice, spec, dtype, 71, compiled="layer-forward")
    compiled = compile_once(layer)  # what torch.compile(model) does to each of its layers
    for call, x in enumerate(xs, 1):
        qcheck.describe(
            shape=LAYER_SHAPE, seed=71, x_leading=LAYER_LEADING, mode="eval-nograd", path="torch.compile", call=call
        )
        check_forward(qcheck, packed, compiled, x, dtype, f"compiled layer, call {call}", grad=False)


# -- CUDA graphs ------------------------------------------------------------------------------


@path_check("captured")
def test_dequantize_captured(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    require_claim(qbackend, qtarget, spec, dtype, captured="dequantize", dequantize=True)
    require_gpu(qdevice)
    quantized = quantized_weight(qbackend, qdevice, spec, dtype, 73)
    unused = torch.zeros(1, device=qdevice)  # the weight is the input, constant as in a captured model
    with torch.no_grad():
        replay = Captured(lambda _: qbackend.dequantize(quantized, dtype), unused)
        for call in (1, 2):
            qcheck.describe(shape=LAYER_SHAPE, seed=73, path="CUDA graph", replay=call)
            out = replay(unused)
            judge_dequantize(qcheck, qbackend, quantized, out, dtype, f"replayed dequantize, replay {call}")


@path_check("captured")
def test_matmul_captured(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    require_claim(qbackend, qtarget, spec, dtype, captured="matmul")
    require_gpu(qdevice)
    quantized, bias, xs = matmul_case(qbackend, qdevice, spec, dtype, 79)
    with torch.no_grad():
        replay = Captured(lambda x: qbackend.matmul(x, quantized, bias, dtype), torch.zeros_like(xs[0]))
        for call, x in enumerate(xs, 1):
            qcheck.describe(shape=LAYER_SHAPE, seed=79, x_leading=MATMUL_LEADING, path="CUDA graph", replay=call)
            judge_matmul(qcheck, qbackend, quantized, x, bias, replay(x), dtype, f"replayed matmul, replay {call}")


@path_check("captured")
def test_layer_forward_captured(qtarget, qbackend, qdevice, qcheck, spec, dtype):
    layer, packed, xs = inference_layer(qbackend, qtarget, qdevice, spec, dtype, 83, captured="layer-forward")
    require_gpu(qdevice)
    with torch.no_grad():
        replay = Captured(layer, torch.zeros_like(xs[0]), bias_of(layer))
        for call, x in enumerate(xs, 1):
            qcheck.describe(
                shape=LAYER_SHAPE, seed=83, x_leading=LAYER_LEADING, mode="eval-nograd", path="CUDA graph", replay=call
            )
            check_forward(qcheck, packed, replay, x, dtype, f"replayed layer, replay {call}", grad=False)
