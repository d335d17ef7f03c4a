"""What the layer suites share: the claim check of the layer facet, the layers they build,
and the float64 judgement of a layer's forward from its own stored bytes.

A layer picks its kernel by itself (bitsandbytes: a fused gemv for one row, dequantize
then GEMM otherwise, a CPU-packed gemv in eval mode without grad on AVX512-BF16 CPUs),
so a layer's weight error ``E`` is the larger of the two models ``weight_error`` knows:
the weight dequantized once into the compute dtype, or code table and scales rounded to
the compute dtype first (bitsandbytes' gemv).
"""
from __future__ import annotations

import pytest
import torch

from pytest_qconform.backends.base import Backend, QuantSpec
from pytest_qconform.backends.layers import LayerCapabilities, LayerFacet
from pytest_qconform.outcomes import NOT_CLAIMED_PREFIX
from pytest_qconform.reference import bounds, linear
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4
from pytest_qconform.strategies import WeightCase
from pytest_qconform.targets import Target

from ._cases import dtype_id, reference_decode, weight_error

# The platform defaults (64: CUDA and CPU, 128: ROCm), double quantization, and HQQ.
LAYER_SPECS: tuple[QuantSpec, ...] = (QuantSpec("nf4", 64), QuantSpec("nf4", 64, True), QuantSpec("fp4", 128),
                                      QuantSpec("hqq4", 64))
LAYER_SHAPE = (64, 128)  # (out, in): whole blocks per row at 64 and 128, as LLM layers have


def layer_spec_id(spec: QuantSpec) -> str:
    return spec.label()


def require_layer_claim(backend: Backend, target: Target, spec: QuantSpec | None = None,
                        dtype: torch.dtype | None = None, *, backward: bool = False, move: str | None = None,
                        peft: bool = False, transformers: bool = False) -> tuple[LayerFacet, LayerCapabilities]:
    """The backend's layer facet and its claims on the target, or a ``not claimed`` skip."""
    facet = backend.layers()
    if facet is None:
        pytest.skip(f"{NOT_CLAIMED_PREFIX} {backend.name} offers no layer (Backend.layers() is None)")
    device = torch.device(target.torch_device or "cpu")
    caps = facet.capabilities(device)
    problems = []
    if ("cuda" if device.type == "cuda" else device.type) not in caps.devices:
        problems.append(f"device {device.type}")
    if spec is not None:
        if spec.format not in caps.formats:
            problems.append(f"format {spec.format}")
        if spec.blocksize not in caps.blocksizes:
            problems.append(f"blocksize {spec.blocksize}")
        if spec.double_quant and not caps.double_quant:
            problems.append("double quantization")
    if dtype is not None and dtype not in caps.dtypes:
        problems.append(f"dtype {dtype_id(dtype)}")
    if dtype is torch.bfloat16 and not target.bf16:
        problems.append(f"bf16 on {target.arch} (the arch has no bf16)")
    if backward and not caps.backward:
        problems.append("backward")
    if move is not None and move not in caps.moves:
        problems.append(f"the .{move}() move")
    if peft and not caps.peft:
        problems.append("PEFT LoRA on its layer")
    if transformers and not caps.transformers:
        problems.append("transformers quantization")
    if problems:
        pytest.skip(f"{NOT_CLAIMED_PREFIX} {backend.name}'s layer does not claim {', '.join(problems)}")
    return facet, caps


def layer_inputs(seed: int, dtype: torch.dtype, shape: tuple[int, int] = LAYER_SHAPE,
                 with_bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float weight and bias on the CPU, in ``dtype`` (a model loaded in its compute dtype)."""
    weight = WeightCase(shape, "normal", seed).make("cpu").to(dtype)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(seed + 1)).to(dtype) if with_bias else None
    return weight, bias


def activation(leading: tuple[int, ...], k: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*leading, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def layer_weight_error(packed: PackedBnb4 | PackedHqq4, w: torch.Tensor, compute_dtype: torch.dtype) -> torch.Tensor:
    """``E`` for a layer's forward: either kernel model (see the module docstring)."""
    return torch.maximum(weight_error(packed, w, compute_dtype), weight_error(packed, w, compute_dtype, rows=1))


def bias_of(layer: torch.nn.Module) -> torch.Tensor | None:
    bias = getattr(layer, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def snapshot(facet: LayerFacet, layer: torch.nn.Module) -> dict[str, object]:
    """Everything the layer stores about its quantization, as host copies (bytes, scales,
    tables, blocksize, shape, dtypes), to compare bit for bit."""
    packed = facet.packed(layer)
    fields = dict(vars(packed))
    return {key: (value.copy() if hasattr(value, "copy") else value) for key, value in fields.items()}


def snapshot_differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    import numpy as np

    changed = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            same = (isinstance(a, np.ndarray) and isinstance(b, np.ndarray) and a.dtype == b.dtype
                    and a.shape == b.shape and np.array_equal(a, b))
            if not same:
                describe = lambda v: f"{v.dtype}{list(v.shape)}" if isinstance(v, np.ndarray) else repr(v)  # noqa: E731
                changed.append(f"{key}: {describe(a)} -> {describe(b)}"
                               + ("" if describe(a) != describe(b) else " (values)"))
        elif a != b:
            changed.append(f"{key}: {a!r} -> {b!r}")
    return changed


def check_forward(qcheck, packed: PackedBnb4 | PackedHqq4, layer: torch.nn.Module, x: torch.Tensor,
                  compute_dtype: torch.dtype, what: str, *, grad: bool = True) -> torch.Tensor:
    """Run ``layer(x)`` (with or without grad) and judge it against float64 from ``packed``,
    the layer's bytes as read when it was built (its weight, whatever a forward later
    does to how it is stored: that is layer-state's business), and its bias; with
    ``grad`` and a differentiable x, also ``dx`` for dy = 1."""
    if grad:
        y = layer(x)
    else:
        with torch.no_grad():
            y = layer(x)
    qcheck.equal(y.dtype, x.dtype, f"{what}: output dtype (the input's)")
    w = reference_decode(packed, x.device)
    b = bias_of(layer)
    b64 = b.double() if b is not None else None
    e_w = layer_weight_error(packed, w, compute_dtype)
    qcheck.within(y, linear.linear(x.double(), w, b64),
                  bounds.matmul_bound(x.double(), w, b64, compute_dtype, x.dtype, w_error=e_w), f"{what}: forward")
    if grad and x.requires_grad:
        dy = torch.ones_like(y)
        y.backward(dy)
        qcheck.within(x.grad, dy.double() @ w, bounds.grad_bound(dy.double(), w, compute_dtype, x.dtype, w_error=e_w),
                      f"{what}: dx")
    return y
