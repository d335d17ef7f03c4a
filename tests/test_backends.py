"""The backend adapters and the registry, on CPU.

Each adapter must report a missing or broken library instead of raising, and on CPU its
quantize / dequantize / matmul / backward / export / serialize / load must agree with a
float64 decoding of the bytes it exports (written out here, independent of the adapters).
bitsandbytes' CPU path torch.compiles per shape and dtype, so few shapes are used.
"""

from __future__ import annotations

import importlib.abc
import importlib.metadata
import os
import sys

import numpy as np
import pytest
import torch

# Triton picks compiler or interpreter when kernels are defined (at import): ask for the
# interpreter before anything here imports them, as the plugin does on GPU-less machines.
os.environ.setdefault("TRITON_INTERPRET", "1")

from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4  # noqa: E402

from pytest_qconform.backends import registry  # noqa: E402
from pytest_qconform.backends.base import QuantSpec  # noqa: E402

CPU = torch.device("cpu")
BNB_SHAPE = (33, 47)  # numel not a multiple of any blocksize, odd: partial block and a padding nibble
HQQ_SHAPE = (64, 128)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def unit_roundoff(dtype: torch.dtype) -> float:
    return float(torch.finfo(dtype).eps) / 2


# -- an independent float64 decoding of the exported bytes ------------------------------------
def decode_bnb4(packed: PackedBnb4) -> torch.Tensor:
    """w[e] = code[nibble(e)] * absmax[e // blocksize], absmax = nested_code[c] * nested_absmax + offset."""
    data = np.asarray(packed.packed, dtype=np.uint8).reshape(-1)
    nibbles = np.stack([data >> 4, data & 15], axis=1).reshape(-1)[: packed.numel]
    absmax = np.asarray(packed.absmax).reshape(-1)
    if packed.double_quant:
        nested = np.repeat(np.asarray(packed.nested_absmax, np.float64), packed.nested_blocksize)[: absmax.size]
        absmax = np.asarray(packed.nested_code, np.float64)[absmax.astype(np.int64)] * nested + packed.offset
    scale = np.repeat(absmax.astype(np.float64), packed.blocksize)[: packed.numel]
    values = np.asarray(packed.code, np.float64)[nibbles] * scale
    return torch.from_numpy(values.reshape(packed.shape))


def decode_hqq4(packed: PackedHqq4) -> torch.Tensor:
    """W = (W_q - zero) * scale, W_q unpacked from HQQ's 4bit_u8 (high nibbles = first half of rows)."""
    data = np.asarray(packed.packed, dtype=np.uint8)
    codes = np.concatenate([data >> 4, data & 15], axis=0).astype(np.float64)
    values = (codes - np.asarray(packed.zero, np.float64)) * np.asarray(packed.scale, np.float64)
    return torch.from_numpy(values.reshape(packed.shape))


def decode(packed: PackedBnb4 | PackedHqq4) -> torch.Tensor:
    return decode_bnb4(packed) if isinstance(packed, PackedBnb4) else decode_hqq4(packed)


def packed_dequantize_bound(packed: PackedBnb4 | PackedHqq4, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A few fp32 (or compute-dtype) operations on the scale, then one rounding to ``dtype``."""
    if isinstance(packed, PackedBnb4):
        inner = 4 * unit_roundoff(torch.float32)
        scale_size = exact.abs() + (abs(packed.offset) if packed.double_quant else 0.0)
    else:
        compute = getattr(torch, packed.meta["compute_dtype"])
        inner = 4 * unit_roundoff(compute)
        zero = torch.from_numpy(np.asarray(packed.zero, np.float64)).abs().max().item()
        scale = torch.from_numpy(np.asarray(packed.scale, np.float64)).abs().max().item()
        scale_size = exact.abs() + (zero + 15) * scale
    return unit_roundoff(dtype) * exact.abs() + inner * scale_size + float(torch.finfo(dtype).tiny)


def assert_within(got: torch.Tensor, exact: torch.Tensor, bound: torch.Tensor, what: str) -> None:
    err = (got.double() - exact).abs()
    worst = int(torch.argmax(err - bound))
    assert bool((err <= bound).all()), (
        f"{what}: |error| {err.reshape(-1)[worst].item():.3g} > bound {bound.reshape(-1)[worst].item():.3g} "
        f"at flat index {worst}"
    )


def matmul_bound(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """gamma_(K+2) (|x| |W|^T + |b|) in ``dtype``, plus the weight's rounding to ``dtype``."""
    k = x.shape[-1]
    u = unit_roundoff(dtype)
    magnitude = x.double().abs() @ w.abs().T + (bias.double().abs() if bias is not None else 0.0)
    return (k + 3) * u / (1 - (k + 3) * u) * magnitude * 2 + float(torch.finfo(dtype).tiny) * k


# -- fixtures ------------------------------------------------------------------------------------
def available_backend(name: str):
    backend = registry.create(name)
    status = backend.availability()
    if not status.available:
        pytest.skip(f"{name} unavailable here: {status.reason}")
    return backend


def weight(shape: tuple[int, int], seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


CASES = [
    pytest.param("bitsandbytes", QuantSpec("nf4", 64), BNB_SHAPE, id="bnb-nf4-b64"),
    pytest.param("bitsandbytes", QuantSpec("fp4", 64, double_quant=True), BNB_SHAPE, id="bnb-fp4-b64-dq"),
    pytest.param("hqq", QuantSpec("hqq4", 64, axis=1), HQQ_SHAPE, id="hqq-g64-ax1"),
    pytest.param("hqq", QuantSpec("hqq4", 32, axis=0), HQQ_SHAPE, id="hqq-g32-ax0"),
    pytest.param("triton-nf4", QuantSpec("nf4", 64), BNB_SHAPE, id="triton-nf4-b64"),
    pytest.param("triton-nf4", QuantSpec("fp4", 128, double_quant=True), BNB_SHAPE, id="triton-fp4-b128-dq"),
]


# -- unavailability is reported, never raised -------------------------------------------------------
@pytest.mark.parametrize(
    "backend_name, module", [("bitsandbytes", "bitsandbytes"), ("hqq", "hqq"), ("triton-nf4", "triton")]
)
def test_hidden_library_reports_unavailable_with_reason(monkeypatch, backend_name, module):
    monkeypatch.setitem(sys.modules, module, None)
    status = registry.create(backend_name).availability()
    assert not status.available
    assert status.reason.startswith(f"{module}: import failed: ModuleNotFoundError"), status.reason


class _FailingFinder(importlib.abc.MetaPathFinder):
    """Makes importing ``module`` raise ``exc``, as a native library that fails to load does."""

    def __init__(self, module: str, exc: BaseException) -> None:
        self.module, self.exc = module, exc

    def find_spec(self, fullname, path=None, target=None):
        if fullname == self.module or fullname.startswith(self.module + "."):
            raise self.exc
        return None


@pytest.mark.parametrize(
    "backend_name, module, exc",
    [
        (
            "bitsandbytes",
            "bitsandbytes",
            OSError("libbitsandbytes_cpu.so: undefined symbol: cquantize_blockwise\nmore"),
        ),
        ("hqq", "hqq", RuntimeError("HIP error: hipErrorNoBinaryForGpu\nsecond line")),
    ],
)
def test_broken_native_library_reports_first_line_of_error(monkeypatch, backend_name, module, exc):
    for loaded in [m for m in sys.modules if m == module or m.startswith(module + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setattr(sys, "meta_path", [_FailingFinder(module, exc), *sys.meta_path])
    status = registry.create(backend_name).availability()
    first_line = str(exc).splitlines()[0]
    assert (status.available, status.reason) == (False, f"{module}: import failed: {type(exc).__name__}: {first_line}")


def test_triton_without_interpreter_or_gpu_is_unavailable_with_reason(monkeypatch):
    pytest.importorskip("triton")
    from qconform_triton_nf4 import kernels

    monkeypatch.setattr(kernels, "interpreter_active", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    status = registry.create("triton-nf4").availability()
    assert not status.available
    assert "TRITON_INTERPRET=1" in status.reason


# -- quantize / dequantize / matmul / backward / export / serialize against float64 ---------------------
@pytest.mark.parametrize("backend_name, spec, shape", CASES)
def test_dequantize_matches_float64_decoding_of_exported_bytes(backend_name, spec, shape):
    backend = available_backend(backend_name)
    quantized = backend.quantize(weight(shape), spec)
    packed = backend.export_packed(quantized)
    exact = decode(packed)
    assert tuple(packed.shape) == shape
    assert (packed.blocksize if isinstance(packed, PackedBnb4) else packed.group_size) == spec.blocksize
    for dtype in DTYPES:
        out = backend.dequantize(quantized, dtype)
        assert (out.dtype, tuple(out.shape)) == (dtype, shape)
        assert_within(out, exact, packed_dequantize_bound(packed, exact, dtype), f"{backend_name} dequantize {dtype}")
    # Within a quarter of max|w| of the weight (every format's half code gap is below that):
    # a layout misread by the decoder would not be.
    original = weight(shape).double()
    assert_within(
        exact,
        original,
        torch.full_like(exact, 0.25 * original.abs().max().item()),
        f"{backend_name} decode vs original weight",
    )


@pytest.mark.parametrize("rows", [3, 40], ids=["gemv", "batch40"])
@pytest.mark.parametrize("backend_name, spec, shape", CASES)
def test_matmul_and_gradients_match_float64(backend_name, spec, shape, rows):
    backend = available_backend(backend_name)
    quantized = backend.quantize(weight(shape), spec)
    w = decode(backend.export_packed(quantized))
    n, k = shape
    dtype = torch.float32
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, k, generator=gen).requires_grad_(True)
    bias = torch.randn(n, generator=gen).requires_grad_(True)
    y = backend.matmul(x, quantized, bias, dtype)
    assert (y.dtype, tuple(y.shape)) == (dtype, (rows, n))
    exact = x.detach().double() @ w.T + bias.detach().double()
    assert_within(y.detach(), exact, matmul_bound(x.detach(), w, bias.detach(), dtype), f"{backend_name} matmul")
    dy = torch.randn(rows, n, generator=gen)
    y.backward(dy)
    assert_within(x.grad, dy.double() @ w, matmul_bound(dy, w.T, None, dtype), f"{backend_name} d x")
    assert_within(
        bias.grad,
        dy.double().sum(0),
        matmul_bound(torch.ones(1, rows), dy.double().T, None, dtype)[0],
        f"{backend_name} d bias",
    )


@pytest.mark.parametrize("backend_name, spec, shape", CASES)
def test_serialize_then_load_decodes_identically(backend_name, spec, shape):
    backend = available_backend(backend_name)
    quantized = backend.quantize(weight(shape), spec)
    state = backend.serialize(quantized)
    assert all(isinstance(value, torch.Tensor) for value in state.values())
    loaded = backend.load(state, CPU)
    assert (loaded.spec.format, loaded.spec.blocksize, loaded.spec.double_quant) == (
        spec.format,
        spec.blocksize,
        spec.double_quant,
    )
    assert loaded.shape == shape
    assert torch.equal(backend.dequantize(loaded, torch.float32), backend.dequantize(quantized, torch.float32))
    before, after = backend.export_packed(quantized), backend.export_packed(loaded)
    assert np.array_equal(before.packed, after.packed)


@pytest.mark.parametrize("backend_name", ["bitsandbytes", "triton-nf4"])
def test_load_without_blocksize_refuses_naming_it(backend_name):
    backend = available_backend(backend_name)
    state = backend.serialize(backend.quantize(weight(BNB_SHAPE), QuantSpec("nf4", 64)))
    stripped = {key: value for key, value in state.items() if "quant_state" not in key and key != "blocksize"}
    with pytest.raises(ValueError, match="blocksize"):
        backend.load(stripped, CPU)


# -- adapter-specific contracts ---------------------------------------------------------------------
def test_bitsandbytes_produces_the_requested_dtype_natively():
    """From an fp16 weight, bf16 output is fp32 code*absmax rounded once to bf16, not via fp16."""
    backend = available_backend("bitsandbytes")
    quantized = backend.quantize(weight(BNB_SHAPE).half(), QuantSpec("nf4", 64))
    packed = backend.export_packed(quantized)
    assert packed.dtype == "float16"
    once = decode(packed).float().to(torch.bfloat16)  # the fp32 product (exactly rounded), then bf16
    assert torch.equal(backend.dequantize(quantized, torch.bfloat16), once)


def test_bitsandbytes_default_blocksize_reads_params4bit(monkeypatch):
    backend = available_backend("bitsandbytes")
    import bitsandbytes.nn

    assert backend.default_blocksize() == bitsandbytes.nn.Params4bit(torch.empty(0)).blocksize

    class Rocm128Params4bit:
        def __init__(self, data):
            self.blocksize = 128

    monkeypatch.setattr(bitsandbytes.nn, "Params4bit", Rocm128Params4bit)
    assert backend.default_blocksize() == 128
    monkeypatch.setitem(sys.modules, "bitsandbytes.nn", None)
    assert backend.default_blocksize() == 64


def test_hqq_restores_the_class_level_backend():
    backend = available_backend("hqq")
    from hqq.core.quantize import HQQBackend, HQQLinear

    previous = HQQLinear.backend
    HQQLinear.set_backend(HQQBackend.PYTORCH_FORWARD)
    try:
        quantized = backend.quantize(weight(HQQ_SHAPE), QuantSpec("hqq4", 64))
        backend.matmul(torch.randn(2, HQQ_SHAPE[1]), quantized, None, torch.float32)
        assert HQQLinear.backend is HQQBackend.PYTORCH_FORWARD
    finally:
        HQQLinear.set_backend(previous)


def test_hqq_fp32_activation_into_bf16_layer_fails_as_in_hqq():
    """The adapter calls the layer as PEFT does; HQQ's dtype crash must stay visible."""
    backend = available_backend("hqq")
    quantized = backend.quantize(weight(HQQ_SHAPE).to(torch.bfloat16), QuantSpec("hqq4", 64))
    with pytest.raises(RuntimeError, match="dtype"):
        backend.matmul(torch.randn(2, HQQ_SHAPE[1]), quantized, None, torch.bfloat16)


def test_hqq_matmul_in_another_compute_dtype_uses_hqqs_own_cast():
    backend = available_backend("hqq")
    quantized = backend.quantize(weight(HQQ_SHAPE), QuantSpec("hqq4", 64))
    x = torch.randn(2, HQQ_SHAPE[1], dtype=torch.bfloat16)
    y = backend.matmul(x, quantized, None, torch.bfloat16)
    assert y.dtype == torch.bfloat16
    assert quantized.handle.layer.compute_dtype == torch.float32  # the quantized layer is untouched


def test_triton_adopts_bitsandbytes_bytes_and_decodes_identically():
    producer = available_backend("bitsandbytes")
    backend = available_backend("triton-nf4")
    for spec in (QuantSpec("nf4", 64), QuantSpec("fp4", 64, double_quant=True)):
        produced = producer.quantize(weight(BNB_SHAPE, 3), spec)
        adopted = backend.from_packed(producer.export_packed(produced), CPU)
        for dtype in (torch.float32, torch.bfloat16):
            assert torch.equal(backend.dequantize(adopted, dtype), producer.dequantize(produced, dtype)), (spec, dtype)


def test_triton_buffer_follows_dtype_sequence():
    """bf16, fp16, bf16, fp32 through one backend instance (unsloth PR 4026's bug class)."""
    backend = available_backend("triton-nf4")
    quantized = backend.quantize(weight(BNB_SHAPE), QuantSpec("nf4", 64))
    w = decode(backend.export_packed(quantized))
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16, torch.float32):
        x = torch.randn(40, BNB_SHAPE[1]).to(dtype)
        y = backend.matmul(x, quantized, None, dtype)
        assert y.dtype == dtype
        assert_within(y, x.double() @ w.T, matmul_bound(x, w, None, dtype), f"matmul in {dtype}")


@pytest.mark.parametrize("rows", [3, 40], ids=["gemv", "batch40"])
def test_triton_operators_for_torch_compile_match_the_kernels(rows):
    """What torch.compile calls (triton_nf4_ops) gives the eager kernels' bytes, and the
    operators pass torch's own checks (schema, fake tensors, autograd registration)."""
    from qconform_triton_nf4 import ops as triton_nf4_ops
    from qconform_triton_nf4.backend import FUSED_MAX_ROWS

    backend = available_backend("triton-nf4")
    state = backend.quantize(weight((64, 128)), QuantSpec("nf4", 64, double_quant=True)).handle
    x, bias = torch.randn(rows, 128).to(torch.bfloat16), torch.randn(64).to(torch.bfloat16)
    assert torch.equal(triton_nf4_ops.dequantize(state, torch.bfloat16), backend.buffered_weight(state, torch.bfloat16))
    assert torch.equal(triton_nf4_ops.linear(x, state, bias, FUSED_MAX_ROWS), backend.linear(x, state, bias))
    args = triton_nf4_ops.state_args(state)
    checks = ("test_schema", "test_faketensor", "test_autograd_registration")
    torch.library.opcheck(triton_nf4_ops.nf4_linear, (x, bias, *args, FUSED_MAX_ROWS), test_utils=checks)
    torch.library.opcheck(triton_nf4_ops.nf4_dequantize, (*args, torch.float16), test_utils=checks)


# -- registry ---------------------------------------------------------------------------------------------
def test_registry_builds_each_builtin_lazily():
    factories = registry.discover()
    assert set(registry.BUILTIN_BACKENDS) <= set(factories)
    for name in registry.BUILTIN_BACKENDS:
        assert factories[name]().name == name


def test_unknown_backend_error_lists_known_names():
    with pytest.raises(registry.UnknownBackendError) as info:
        registry.create("no-such-backend")
    message = str(info.value)
    assert "'no-such-backend'" in message
    for name in registry.BUILTIN_BACKENDS:
        assert name in message


def test_entry_points_broken_wrong_type_and_duplicate_are_reported_unavailable(monkeypatch):
    group = registry.ENTRY_POINT_GROUP
    entry_points = [
        importlib.metadata.EntryPoint("broken", "qconform_no_such_module_xyz:Backend", group),
        importlib.metadata.EntryPoint("not-a-backend", "builtins:dict", group),
        importlib.metadata.EntryPoint("hqq", "somepackage.adapter:Hqq", group),
        importlib.metadata.EntryPoint("bnb-again", "pytest_qconform.backends.bitsandbytes:BitsandbytesBackend", group),
    ]
    real = importlib.metadata.entry_points

    def fake_entry_points(**params):
        return entry_points if params.get("group") == group else real(**params)

    monkeypatch.setattr(importlib.metadata, "entry_points", fake_entry_points)
    factories = registry.discover()
    broken = factories["broken"]().availability()
    assert not broken.available
    assert "qconform_no_such_module_xyz" in broken.reason and "ModuleNotFoundError" in broken.reason
    wrong = factories["not-a-backend"]().availability()
    assert not wrong.available and "not a pytest_qconform.backends.base.Backend" in wrong.reason
    assert factories["hqq"]().name == "hqq"  # the built-in keeps its name
    clash = factories["hqq (somepackage.adapter:Hqq)"]().availability()
    assert not clash.available and "reuses the backend name 'hqq'" in clash.reason
    assert type(factories["bnb-again"]()).__name__ == "BitsandbytesBackend"
    with pytest.raises(RuntimeError, match="unavailable"):
        factories["broken"]().quantize(weight(BNB_SHAPE), QuantSpec("nf4", 64))
