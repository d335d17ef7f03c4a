"""HQQ 4-bit affine through ``hqq.core.quantize.HQQLinear``, as PEFT and transformers use it.

The layer is built from an ``nn.Linear(in, out, bias=False)`` holding the weight, with
``BaseQuantizeConfig(nbits=4, group_size=spec.blocksize, axis=spec.axis)`` and
``compute_dtype`` = the weight's dtype (users quantize a model loaded in its compute
dtype). HQQ stores ``scale`` and ``zero`` in the compute dtype and dequantizes in it:
``W = (W_q - zero) * scale``. In 0.2.8 ``quant_scale``/``quant_zero`` default off, so the
stored scale/zero are plain tensors; a layer with them on is refused (not claimed).

HQQ's backend is class-level state (``HQQLinear.set_backend``); every call here sets
``HQQBackend.PYTORCH`` and restores the previous backend afterwards.

Matmul calls the layer as PEFT does (``layer(x)`` with ``layer.bias`` set), with no dtype
casting: HQQ computes in the layer's compute dtype and does not cast activations, so fp32
activations into a bf16 layer (PEFT's k-bit preparation) fail inside HQQ, visibly. A
compute dtype other than the quantized layer's gets the layer HQQ itself builds when a
checkpoint is loaded with that ``compute_dtype`` (scale/zero cast to it by HQQ).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from pytest_qconform.backends.adapter_helpers import dtype_name, import_failure, to_numpy
from pytest_qconform.backends.base import Availability, Backend, Capabilities, Quantized, QuantSpec
from pytest_qconform.backends.handles import HqqHandle
from pytest_qconform.reference.packed import PackedHqq4

GROUP_SIZES: tuple[int, ...] = (32, 64, 128)
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
_DTYPES_BY_NAME = {dtype_name(d): d for d in DTYPES}
# HQQ's own fast paths compile the PyTorch backend's forward (HQQBackend.PYTORCH_COMPILE)
# and capture decoding in CUDA graphs (hqq.utils.generation_hf, enable_cuda_graph).
PATH_OPERATIONS: tuple[str, ...] = ("dequantize", "matmul", "layer-forward")


@contextlib.contextmanager
def _pytorch_backend() -> Iterator[Any]:
    """``HQQLinear`` with the PYTORCH backend for the duration; the previous one restored."""
    from hqq.core.quantize import HQQBackend, HQQLinear

    previous = HQQLinear.backend
    HQQLinear.set_backend(HQQBackend.PYTORCH)
    try:
        yield HQQLinear
    finally:
        HQQLinear.set_backend(previous)


def _decode_dtype(value: Any, where: str) -> torch.dtype:
    """A dtype from HQQ's checkpoint encoding (a uint8 tensor of the characters of
    ``"torch.bfloat16"``), read without HQQ's ``eval``."""
    if isinstance(value, torch.dtype):
        return value
    text = "".join(chr(int(c)) for c in value.reshape(-1).tolist()) if isinstance(value, torch.Tensor) else str(value)
    dtype = _DTYPES_BY_NAME.get(text.removeprefix("torch."))
    if dtype is None:
        raise ValueError(f"{where}: compute_dtype {text!r} is not one of {sorted(_DTYPES_BY_NAME)}")
    return dtype


class HqqBackend(Backend):
    name = "hqq"

    def availability(self) -> Availability:
        try:
            import hqq
            import hqq.core.quantize  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - ImportError, OSError, RuntimeError: reported, never raised
            return Availability(False, None, import_failure(self.name, exc))
        return Availability(True, str(getattr(hqq, "__version__", "unknown")))

    def capabilities(self, device: torch.device) -> Capabilities:
        devices = ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)
        return Capabilities(
            formats=("hqq4",),
            blocksizes=GROUP_SIZES,
            double_quant=False,
            dtypes=DTYPES,
            devices=devices,
            backward=True,
            serialize=True,
            axes=(0, 1),
            compiled=PATH_OPERATIONS,
            captured=PATH_OPERATIONS,
        )

    # -- quantize / dequantize / matmul ------------------------------------------------------
    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        from hqq.core.quantize import BaseQuantizeConfig

        where = f"{self.name}.quantize"
        if spec.format != "hqq4":
            raise ValueError(f"{where}: format {spec.format!r} is not supported; HQQ claims only 'hqq4'")
        if spec.double_quant:
            raise ValueError(
                f"{where}: HQQ has no double quantization in this adapter (quant_scale/quant_zero are off)"
            )
        if spec.axis not in (0, 1):
            raise ValueError(f"{where}: axis must be 0 or 1, got {spec.axis}")
        if weight.dim() != 2:
            raise ValueError(f"{where}: HQQLinear needs a 2-D (out, in) weight, got shape {tuple(weight.shape)}")
        if weight.dtype not in DTYPES:
            raise ValueError(f"{where}: weight dtype {weight.dtype} is not a compute dtype HQQ supports {DTYPES}")
        out_features, in_features = weight.shape
        linear = torch.nn.Linear(in_features, out_features, bias=False, device="meta")
        # The user's tensor as passed, strides and all (HQQ reads it without writing to it).
        linear.weight = torch.nn.Parameter(weight.detach(), requires_grad=False)
        config = BaseQuantizeConfig(nbits=4, group_size=spec.blocksize, axis=spec.axis)
        with _pytorch_backend() as hqq_linear:
            layer = hqq_linear(linear, config, compute_dtype=weight.dtype, device=str(weight.device))
        return Quantized(self.name, spec, tuple(weight.shape), weight.device, HqqHandle(layer))

    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        """``HQQLinear.dequantize()`` (in the layer's compute dtype), then cast to ``dtype``
        if that differs, as PEFT's merge does."""
        with _pytorch_backend():
            weight = q.handle.layer.dequantize()
        return weight if weight.dtype == dtype else weight.to(dtype)

    def _layer_for(self, q: Quantized, compute_dtype: torch.dtype) -> Any:
        layer = q.handle.layer
        if layer.compute_dtype == compute_dtype:
            return layer
        from hqq.core.quantize import HQQLinear

        sibling = HQQLinear(None, None, compute_dtype=compute_dtype, device=layer.device, initialize=False)
        sibling.load_state_dict(dict(layer.state_dict()))
        return sibling

    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        with _pytorch_backend():
            layer = self._layer_for(q, compute_dtype)
            previous_bias = layer.bias
            layer.bias = bias
            try:
                return layer(x)
            finally:
                layer.bias = previous_bias

    # -- packed state, serialization -------------------------------------------------------------
    def export_packed(self, q: Quantized) -> PackedHqq4:
        """``W_q`` and ``meta['scale']``/``meta['zero']`` as the layer stores them (bf16
        widened to fp32 exactly, since NumPy has no bf16; ``meta['scale_dtype']`` says so)."""
        layer = q.handle.layer
        meta = layer.meta
        if meta.get("quant_scale") or meta.get("quant_zero") or "scale" not in meta:
            raise NotImplementedError(f"{self.name}: quantized scale/zero are not exported (not claimed)")
        if meta.get("view_as_float"):
            raise NotImplementedError(f"{self.name}: W_q viewed as float is not exported (not claimed)")
        return PackedHqq4(
            shape=tuple(int(n) for n in meta["shape"]),
            group_size=int(meta["group_size"]),
            axis=int(meta["axis"]),
            packed=to_numpy(layer.W_q),
            scale=to_numpy(meta["scale"]),
            zero=to_numpy(meta["zero"]),
            packing=str(meta["packing"]),
            meta={
                "compute_dtype": dtype_name(layer.compute_dtype),
                "scale_dtype": dtype_name(meta["scale"].dtype),
                "zero_dtype": dtype_name(meta["zero"].dtype),
                "nbits": int(meta["nbits"]),
            },
        )

    def serialize(self, q: Quantized) -> dict[str, torch.Tensor]:
        """``HQQLinear.state_dict()`` (HQQ's safetensors-compatible encoding)."""
        state = q.handle.layer.state_dict()
        return {
            key: value.detach().as_subclass(torch.Tensor)
            for key, value in state.items()
            if isinstance(value, torch.Tensor)
        }

    def load(self, state: dict[str, torch.Tensor], device: torch.device) -> Quantized:
        """``HQQLinear(None, None, compute_dtype=..., initialize=False).load_state_dict``, as
        transformers loads an HQQ checkpoint; the compute dtype is the checkpoint's."""
        from hqq.core.quantize import HQQLinear

        where = f"{self.name}.load"
        missing = [
            key for key in ("W_q", "scale", "zero", "group_size", "axis", "shape", "compute_dtype") if key not in state
        ]
        if missing:
            raise ValueError(
                f"{where}: checkpoint lacks {missing} (group_size is the blocksize); "
                "save it with HQQLinear.state_dict()"
            )
        compute_dtype = _decode_dtype(state["compute_dtype"], where)
        with _pytorch_backend():
            layer = HQQLinear(None, None, compute_dtype=compute_dtype, device=str(device), initialize=False)
            layer.load_state_dict(dict(state))
        meta = layer.meta
        spec = QuantSpec("hqq4", int(meta["group_size"]), False, axis=int(meta["axis"]))
        return Quantized(self.name, spec, tuple(int(n) for n in meta["shape"]), torch.device(device), HqqHandle(layer))

    def from_packed(self, packed: Any, device: torch.device) -> Quantized:
        """Adopt HQQ-layout bytes (``PackedHqq4``: ``W_q``, scale and zero as a layer stores
        them) without quantizing: the state HQQ's ``state_dict`` would hold, through ``load``.
        Its encoding of the settings comes from a two-group layer quantized with the same ones
        (HQQ's own ``state_dict``), so nothing of HQQ's format is written here. A 2^31-element
        weight is adopted so (its float weight would be 8 GiB to quantize)."""
        if not isinstance(packed, PackedHqq4):
            raise NotImplementedError(f"{self.name} reads HQQ's layout only, not {type(packed).__name__}")
        where = f"{self.name}.from_packed"
        if packed.packing != "4bit_u8" or int(packed.meta.get("nbits", 4)) != 4:
            raise ValueError(f"{where}: HQQ 4-bit in the '4bit_u8' packing only, got {packed.packing!r}")
        compute_dtype = _decode_dtype(packed.meta.get("compute_dtype", "bfloat16"), where)
        spec = QuantSpec("hqq4", packed.group_size, False, axis=packed.axis)
        template = self.serialize(self.quantize(torch.zeros(2, packed.group_size, dtype=compute_dtype), spec))

        def stored(values: Any, key: str) -> torch.Tensor:
            dtype = _decode_dtype(packed.meta.get(key, str(compute_dtype)), where)
            return torch.from_numpy(np.ascontiguousarray(values, dtype=np.float32)).to(dtype)

        state = {
            **template,
            "W_q": torch.from_numpy(np.ascontiguousarray(packed.packed, dtype=np.uint8)),
            "scale": stored(packed.scale, "scale_dtype"),
            "zero": stored(packed.zero, "zero_dtype"),
            "shape": torch.tensor(tuple(packed.shape), dtype=template["shape"].dtype),
        }
        return self.load(state, device)

    def layers(self) -> Any:
        """``HQQLinear`` (``hqq_layer.HqqLayers``)."""
        from pytest_qconform.backends.hqq_layer import HqqLayers

        return HqqLayers(self)
