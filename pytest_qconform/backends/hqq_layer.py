"""HQQ's layer facet: ``hqq.core.quantize.HQQLinear``, as PEFT and transformers use it.

Built from an ``nn.Linear`` holding the float weight and bias with
``BaseQuantizeConfig(nbits=4, group_size=spec.blocksize, axis=spec.axis)``, the compute
dtype and ``device=`` (HQQ quantizes on construction, onto that device). A fresh layer is
``HQQLinear(None, None, initialize=False)`` filled by ``load_state_dict``, as transformers
loads an HQQ checkpoint. The layer runs whatever backend ``HQQLinear`` is set to
(the default, ``HQQBackend.PYTORCH``; the functional adapter restores it after each call).
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_qconform.backends.base import Quantized, QuantSpec
from pytest_qconform.backends.handles import HqqHandle
from pytest_qconform.backends.layers import MOVES, LayerCapabilities, LayerFacet
from pytest_qconform.reference.packed import PackedHqq4


class HqqLayers(LayerFacet):
    def __init__(self, backend: Any) -> None:
        self._backend = backend  # HqqBackend: its export_packed reads the bytes

    def capabilities(self, device: torch.device) -> LayerCapabilities:
        return LayerCapabilities(moves=MOVES, peft=True, transformers=True)

    def layer_types(self) -> tuple[type, ...]:
        from hqq.core.quantize import HQQLinear

        return (HQQLinear,)

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        from hqq.core.quantize import BaseQuantizeConfig, HQQLinear

        if weight.dim() != 2:
            raise ValueError(f"hqq layer: HQQLinear needs a 2-D (out, in) weight, got {tuple(weight.shape)}")
        out_features, in_features = weight.shape
        linear = torch.nn.Linear(in_features, out_features, bias=bias is not None, device="meta")
        linear.weight = torch.nn.Parameter(weight.detach().cpu().clone(), requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias.detach().cpu().clone(), requires_grad=False)
        config = BaseQuantizeConfig(nbits=4, group_size=spec.blocksize, axis=spec.axis)
        return HQQLinear(linear, config, compute_dtype=compute_dtype, device=str(device))

    def packed(self, layer: torch.nn.Module) -> PackedHqq4:
        meta = layer.meta
        spec = QuantSpec("hqq4", int(meta["group_size"]), axis=int(meta["axis"]))
        return self._backend.export_packed(
            Quantized(
                self._backend.name, spec, tuple(int(n) for n in meta["shape"]), layer.W_q.device, HqqHandle(layer)
            )
        )

    def empty(self, spec: QuantSpec, shape: tuple[int, int], bias: bool, compute_dtype: torch.dtype) -> torch.nn.Module:
        """An uninitialized ``HQQLinear``: group size, axis, shape and bias all come from the checkpoint."""
        from hqq.core.quantize import HQQLinear

        return HQQLinear(None, None, compute_dtype=compute_dtype, device="cpu", initialize=False)

    def load(self, layer: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
        """``load_state_dict`` on the uninitialized layer (HQQ puts it on ``layer.device``)."""
        layer.device = str(device)
        layer.load_state_dict(state, strict=True)
        return layer

    def mark_quantized(self, model: torch.nn.Module) -> None:
        """``model.hqq_quantized = True``, as HQQ's engine (``hqq.engine.base``) marks a model
        it quantized: PEFT's k-bit preparation reads it (gradient checkpointing, input grads)."""
        model.hqq_quantized = True

    def transformers_config(self, spec: QuantSpec, compute_dtype: torch.dtype) -> Any:
        from transformers import HqqConfig

        return HqqConfig(nbits=4, group_size=spec.blocksize, axis=spec.axis)
