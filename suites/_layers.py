"""What the layer suites share: the claim check of the layer facet, the layers they build,
and the float64 judgement of a layer's forward from its own stored bytes.

A layer picks its kernel by itself (bitsandbytes: a fused gemv for one row, dequantize
then GEMM otherwise, a CPU-packed gemv in eval mode without grad on AVX512-BF16 CPUs),
so a layer's weight error ``E`` is the larger of the two models ``weight_error`` knows:
the weight dequantized once into the compute dtype, or code table and scales rounded to
the compute dtype first (bitsandbytes' gemv).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bounds, linear
from pytest_qconform.reference.bounds import layer_weight_error
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

from pytest_qconform.backends.base import Backend, QuantSpec
from pytest_qconform.backends.layers import LayerCapabilities, LayerFacet
from pytest_qconform.cases.strategies import WeightCase
from pytest_qconform.hardware.targets import Target
from pytest_qconform.session.outcomes import skip_not_claimed

from ._cases import packed_dequantize_bound, reference_decode, require_claim

LAYER_SHAPE = (64, 128)  # (out, in): whole blocks per row at 64 and 128, as LLM layers have


OPTIONAL = {
    "transformers": "transformers",
    "peft": "PEFT",
    "safetensors.torch": "safetensors",
    "accelerate": "accelerate",
}


def needs(module: str):
    """The optional dependency ``module`` (the ``layers`` extra), or a skip naming it."""
    return pytest.importorskip(
        module, reason=f"needs {OPTIONAL[module]}, which is not installed: pip install 'pytest-qconform[layers]'"
    )


def require_layer_claim(
    backend: Backend,
    target: Target,
    spec: QuantSpec | None = None,
    dtype: torch.dtype | None = None,
    *,
    backward: bool = False,
    move: str | None = None,
    peft: bool = False,
    transformers: bool = False,
) -> tuple[LayerFacet, LayerCapabilities]:
    """The backend's layer facet and its claims on the target, or a ``not claimed`` skip:
    the layer claims what the backend claims (``require_claim``) plus its own flags."""
    facet = backend.layers()
    if facet is None:
        skip_not_claimed(f"{backend.name} offers no layer (Backend.layers() is None)")
    require_claim(backend, target, spec, dtype, backward=backward)
    caps = facet.capabilities(torch.device(target.torch_device or "cpu"))
    problems = []
    if move is not None and move not in caps.moves:
        problems.append(f"the .{move}() move")
    if peft and not caps.peft:
        problems.append("PEFT LoRA on its layer")
    if transformers and not caps.transformers:
        problems.append("transformers quantization")
    if problems:
        skip_not_claimed(f"{backend.name}'s layer does not claim {', '.join(problems)}")
    return facet, caps


def layer_inputs(
    seed: int, dtype: torch.dtype, shape: tuple[int, int] = LAYER_SHAPE, with_bias: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A float weight and bias on the CPU, in ``dtype`` (a model loaded in its compute dtype)."""
    weight = WeightCase(shape, "normal", seed).make("cpu").to(dtype)
    bias = torch.randn(shape[0], generator=torch.Generator().manual_seed(seed + 1)).to(dtype) if with_bias else None
    return weight, bias


def activation(leading: tuple[int, ...], k: int, seed: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.randn(*leading, k, generator=torch.Generator().manual_seed(seed)).to(dtype).to(device)


def bias_of(layer: torch.nn.Module) -> torch.Tensor | None:
    bias = getattr(layer, "bias", None)
    return bias.detach() if isinstance(bias, torch.Tensor) else None


def snapshot(facet: LayerFacet, layer: torch.nn.Module, *, computing: bool = False) -> dict[str, object]:
    """Everything the layer stores about its quantization, as host copies (bytes, scales,
    tables, blocksize, shape, dtypes), to compare bit for bit; ``computing``: what it
    computes from (``LayerFacet.computing_state``) rather than what it would save."""
    packed = facet.computing_state(layer) if computing else facet.packed(layer)
    fields = dict(vars(packed))
    return {key: (value.copy() if hasattr(value, "copy") else value) for key, value in fields.items()}


def _describe(value: object) -> str:
    return f"{value.dtype}{list(value.shape)}" if isinstance(value, np.ndarray) else repr(value)


def snapshot_differences(before: dict[str, object], after: dict[str, object]) -> list[str]:
    """``"field: before -> after"`` for every field that differs (arrays: dtype, shape or values)."""
    changed = []
    for key in sorted(set(before) | set(after)):
        a, b = before.get(key), after.get(key)
        if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
            same = (
                isinstance(a, np.ndarray)
                and isinstance(b, np.ndarray)
                and a.dtype == b.dtype
                and a.shape == b.shape
                and np.array_equal(a, b)
            )
            if not same:
                values_only = _describe(a) == _describe(b)
                changed.append(f"{key}: {_describe(a)} -> {_describe(b)}" + (" (values)" if values_only else ""))
        elif a != b:
            changed.append(f"{key}: {a!r} -> {b!r}")
    return changed


def check_forward(
    qcheck,
    packed: PackedBnb4 | PackedHqq4,
    layer: torch.nn.Module,
    x: torch.Tensor,
    compute_dtype: torch.dtype,
    what: str,
    *,
    grad: bool = True,
) -> torch.Tensor:
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
    qcheck.within(
        y,
        linear.linear(x.double(), w, b64),
        bounds.matmul_bound(x.double(), w, b64, compute_dtype, x.dtype, w_error=e_w),
        f"{what}: forward",
    )
    if grad and x.requires_grad:
        dy = torch.ones_like(y)
        y.backward(dy)
        qcheck.within(
            x.grad,
            dy.double() @ w,
            bounds.grad_bound(dy.double(), w, compute_dtype, x.dtype, w_error=e_w),
            f"{what}: dx",
        )
    return y


def tiny_llama(dtype: torch.dtype, seed: int):
    """A one-layer Llama from a config, random weights: no download."""
    transformers = needs("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=32,
    )
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)


def quantized_tiny_llama(
    qcheck,
    facet: LayerFacet,
    caps: LayerCapabilities,
    spec: QuantSpec,
    dtype: torch.dtype,
    device: torch.device,
    tmp_path,
    seed: int,
):
    """``tiny_llama`` with its decoder's linear layers quantized by the backend: through
    transformers' ``from_pretrained`` where the layer claims it (PEFT recognizes a
    bitsandbytes model only when transformers loaded it), else, or when transformers
    refuses the config, by replacing each ``nn.Linear`` with ``facet.quantize`` of its
    weight (how HQQ models are built by hand). ``lm_head`` stays in ``dtype``."""
    model = tiny_llama(dtype, seed)
    if caps.transformers:
        import transformers

        model.save_pretrained(tmp_path / "float")
        try:
            return transformers.AutoModelForCausalLM.from_pretrained(
                tmp_path / "float",
                quantization_config=facet.transformers_config(spec, dtype),
                device_map=str(device),
                dtype=dtype,
            )
        except NotImplementedError as exc:
            qcheck.describe(built_by="replacing nn.Linear", transformers_refused=str(exc).splitlines()[0])
    model = model.to(device)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is torch.nn.Linear and name != "lm_head":
                setattr(module, name, facet.quantize(child.weight.detach().cpu(), child.bias, spec, dtype, device))
    return model


def lora_gradients(
    x: torch.Tensor,
    dy: torch.Tensor,
    w: torch.Tensor,
    w_error: torch.Tensor,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scale: float,
    compute_dtype: torch.dtype,
    adapter_dtype: torch.dtype,
    x_dtype: torch.dtype,
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{name: (exact, bound)}`` for the gradients of ``y = layer(x) + s (x A^T) B^T``
    (LoRA as PEFT adds it beside a frozen layer) given the upstream ``dy``; all inputs
    exact float64, x ``(M, K)``, dy ``(M, N)``, A ``(r, K)``, B ``(N, r)``, ``s`` a power of 2.

    The layer's ``dy W`` runs in ``compute_dtype`` (``grad_bound`` with the layer's weight
    error), the adapter's matmuls in ``adapter_dtype`` (``u = x A^T``, ``g = s dy B``,
    each ``matmul_bound``, errors of an operand propagated through the next product), and
    dx's two parts are each rounded to ``x_dtype`` and added there:

        dx = dy W + g A        dA = g^T x        dB = s dy^T u
    """

    def mm(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:  # bound of fl(p @ q) in the adapter dtype
        return bounds.matmul_bound(p, q.T, None, adapter_dtype, adapter_dtype)

    u, g = x @ lora_a.T, scale * dy @ lora_b
    e_u, e_g = mm(x, lora_a.T), scale * mm(dy, lora_b)
    dx_lora = g @ lora_a
    e_dx_lora = mm(g, lora_a) + e_g @ lora_a.abs()
    dx = dy @ w + dx_lora
    e_dx = (
        bounds.grad_bound(dy, w, compute_dtype, x_dtype, w_error=w_error)
        + e_dx_lora
        + bounds.rounding_bound(dx_lora.abs() + e_dx_lora, x_dtype)
        + bounds.rounding_bound(dx.abs() + e_dx_lora, x_dtype)
    )
    da = g.T @ x
    db = scale * dy.T @ u
    return {
        "dx": (dx, e_dx),
        "lora_A": (da, mm(g.T, x) + e_g.T @ x.abs()),
        "lora_B": (db, scale * (mm(dy.T, u) + dy.abs().T @ e_u)),
    }


# -- PEFT's LoRA merge, judged by its requantization (test_peft, test_lifecycle_sequences) --------


def lora_delta(
    lora_module: torch.nn.Module, scale: float, adapter_name: str = "default"
) -> tuple[torch.Tensor, torch.Tensor, torch.dtype]:
    """``(s B A, its bound, the adapter's dtype)`` for a PEFT LoRA layer, in float64: the
    delta a merge adds, computed by PEFT in the adapter's dtype."""
    a = lora_module.lora_A[adapter_name].weight.detach().double()
    b = lora_module.lora_B[adapter_name].weight.detach().double()
    adapter = lora_module.lora_A[adapter_name].weight.dtype
    return scale * b @ a, scale * bounds.matmul_bound(b, a.T, None, adapter, adapter), adapter


def merge_dequantized_dtype(packed: PackedBnb4 | PackedHqq4) -> torch.dtype:
    """The dtype PEFT's merge dequantizes into: bitsandbytes' quant_state.dtype, HQQ's compute dtype."""
    from pytest_qconform.backends.adapter_helpers import dtype_from_name

    if isinstance(packed, PackedBnb4):
        return dtype_from_name(packed.dtype)
    return dtype_from_name(packed.meta["compute_dtype"])


def quantizer_dtype(packed: PackedBnb4 | PackedHqq4, on_gpu: bool) -> torch.dtype:
    """The dtype a layer's quantizer computed in: fp32, but HQQ's optimizer on a GPU casts
    the weight to fp16 and evaluates ``w * scale^-1 + zero`` there (the quantize suite's HQQ
    check widens its tie band the same way). PEFT's HQQ merge requantizes with that quantizer,
    so a merged fp32 layer on a GPU lands within the fp16 band too (an H200's thorough loop
    run: 1.0x the fp32 bound, 2026-11-28)."""
    return torch.float16 if on_gpu and isinstance(packed, PackedHqq4) else torch.float32


def check_requantized(
    qcheck,
    facet: LayerFacet,
    layer: torch.nn.Module,
    before: PackedBnb4 | PackedHqq4,
    delta: torch.Tensor,
    e_delta: torch.Tensor,
    adapter_dtype: torch.dtype,
    sign: float,
    what: str,
) -> PackedBnb4 | PackedHqq4:
    """``layer`` (a merge's base layer) now holds ``decode(before) + sign * delta`` quantized
    to nearest on its own grid, the target's error being what PEFT's arithmetic allows: the
    dequantize in the stored dtype, the delta in the adapter's (``lora_delta``), and their
    sum in the promotion of the two (fp32 with the fp32 adapters of a k-bit-prepared model;
    a bare fp16 layer's adapter is fp16, and so is the sum); returns the layer's bytes."""
    from pytest_qconform.reference import requantize

    w = reference_decode(before, delta.device)
    target = w + sign * delta
    dequantized = merge_dequantized_dtype(before)
    e_target = (
        packed_dequantize_bound(before, w, dequantized)
        + e_delta
        + bounds.rounding_bound(target.abs() + e_delta, torch.promote_types(dequantized, adapter_dtype))
    )
    after = facet.packed(layer)
    qcheck.within(
        reference_decode(after, delta.device),
        target,
        requantize.requantize_bound(after, target, e_target, quantizer_dtype(after, delta.device.type == "cuda")),
        what,
    )
    return after
