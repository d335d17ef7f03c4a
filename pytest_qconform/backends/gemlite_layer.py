"""gemlite's layer facet: ``gemlite.core.GemLiteLinearTriton``, the layer HQQ's
``prepare_for_inference(model, backend="gemlite")`` puts in a model in place of each
``HQQLinear``.

Built as that conversion builds it: an ``HQQLinear`` quantized from an ``nn.Linear``
holding the float weight and bias (``BaseQuantizeConfig(nbits=4, group_size, axis=1)``,
the compute dtype, HQQ's PyTorch backend), converted by
``hqq.backends.gemlite.patch_hqq_to_gemlite``, which carries the bias over. Its bytes are
gemlite's own (``W_q`` words, ``scales``, ``zeros``), decoded by ``reference.gemlite4``;
so the call-site oracle judges a converted model's calls against the bytes it computes
from, not the HQQ layer it came from.

What the layer claims beyond the backend's capabilities: no move between devices
(gemlite computes on CUDA only, and a converted layer moved to the CPU cannot run), no
PEFT (PEFT's LoRA dispatches on ``HQQLinear``, not on gemlite's class), no transformers
quantization config (HQQ converts after loading). A fresh layer is
``GemLiteLinearTriton(W_nbits=4, group_size, in_features, out_features, dtype)`` filled
by its own ``load_state_dict``, as gemlite documents for reloading a converted layer.
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.backends.layers import LayerCapabilities, LayerFacet
from pytest_qconform.reference.packed import PackedGemlite4


class GemliteLayers(LayerFacet):
    def __init__(self, backend: Any) -> None:
        self._backend = backend  # HqqGemliteBackend: its converter and its reading of the bytes

    def capabilities(self, device: torch.device) -> LayerCapabilities:
        return LayerCapabilities(moves=(), peft=False, transformers=False)

    def layer_types(self) -> tuple[type, ...]:
        from gemlite.core import GemLiteLinearTriton

        return (GemLiteLinearTriton,)

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        return self._backend.convert_linear(weight, bias, spec, compute_dtype, device)

    def packed(self, layer: torch.nn.Module) -> PackedGemlite4:
        return self._backend.packed_of(layer)

    def empty(self, spec: QuantSpec, shape: tuple[int, int], bias: bool, compute_dtype: torch.dtype) -> torch.nn.Module:
        """A fresh ``GemLiteLinearTriton`` of the checkpoint's shape and group size: its
        ``load_state_dict`` reads everything else (packing, modes, dtypes) from the checkpoint's
        ``metadata``."""
        from gemlite.core import DType, GemLiteLinearTriton

        dtype = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}.get(compute_dtype)
        if dtype is None:
            raise ValueError(f"gemlite layer: no 16-bit gemlite dtype for {compute_dtype}")
        out_features, in_features = shape
        return GemLiteLinearTriton(
            W_nbits=4,
            group_size=spec.blocksize,
            in_features=in_features,
            out_features=out_features,
            input_dtype=dtype,
            output_dtype=dtype,
        )
