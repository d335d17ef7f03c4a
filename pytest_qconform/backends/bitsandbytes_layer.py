"""bitsandbytes' layer facet: ``bitsandbytes.nn.Linear4bit`` holding a ``Params4bit``.

Built as transformers' bitsandbytes integration builds it: a ``Linear4bit`` whose weight
is a ``Params4bit`` holding the float weight, quantized by ``.to(device)``. A fresh
layer is loaded with ``Params4bit.from_prequantized`` (transformers' way of reading a
pre-quantized checkpoint); ``load_state_dict`` itself is what the checkpoint suite
calls on an already-quantized layer.

On CPUs with AVX512-BF16, ``Linear4bit.forward`` in eval mode without grad repacks the
weight into a CPU layout (``quant_state.packing_format_for_cpu``) as a cache; its bytes
are then read as the layer would save them now (``state_dict()`` of a copy, which packs
them back), since that is what a checkpoint written at that moment holds.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from pytest_qconform.backends.base import Quantized, QuantSpec
from pytest_qconform.backends.handles import BnbHandle
from pytest_qconform.backends.layers import MOVES, LayerCapabilities, LayerFacet
from pytest_qconform.reference.packed import PackedBnb4


def _quant_state(layer: torch.nn.Module) -> Any:
    """The weight's ``quant_state``, or the layer's copy of it where the weight is a plain
    tensor (FSDP's unsharded parameter: ``Linear4bit`` keeps its own for that case)."""
    state = getattr(layer.weight, "quant_state", None)
    return state if state is not None else layer.quant_state


class BitsandbytesLayers(LayerFacet):
    def __init__(self, backend: Any) -> None:
        self._backend = backend  # BitsandbytesBackend: its export_packed/load read the bytes

    def capabilities(self, device: torch.device) -> LayerCapabilities:
        return LayerCapabilities(moves=MOVES, peft=True, transformers=True)

    def layer_types(self) -> tuple[type, ...]:
        from bitsandbytes.nn import Linear4bit

        return (Linear4bit,)

    def _layer(
        self,
        shape: tuple[int, int],
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        data: torch.Tensor,
    ) -> Any:
        from bitsandbytes.nn import Linear4bit, Params4bit

        out_features, in_features = shape
        layer = Linear4bit(
            in_features,
            out_features,
            bias=bias is not None,
            compute_dtype=compute_dtype,
            compress_statistics=spec.double_quant,
            quant_type=spec.format,
            quant_storage=spec.quant_storage,
            device="meta",
        )
        layer.weight = Params4bit(
            data,
            requires_grad=False,
            blocksize=spec.blocksize,
            compress_statistics=spec.double_quant,
            quant_type=spec.format,
            quant_storage=spec.quant_storage,
            module=layer,
        )
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad)
        return layer

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        if weight.dim() != 2:
            raise ValueError(f"bitsandbytes layer: Linear4bit needs a 2-D (out, in) weight, got {tuple(weight.shape)}")
        layer = self._layer(tuple(weight.shape), bias, spec, compute_dtype, weight.detach().cpu().clone())
        return layer.to(device)  # Params4bit.to quantizes

    def packed(self, layer: torch.nn.Module) -> PackedBnb4:
        state = _quant_state(layer)
        if getattr(state, "packing_format_for_cpu", False):
            # A copy without the layer's hooks (whatever they hold: an observer's state), whose
            # state_dict packs the bytes back as a checkpoint written now would hold them.
            memo: dict[int, Any] = {id(v): type(v)() for k, v in vars(layer).items() if "hooks" in k}
            saved = copy.deepcopy(layer, memo).state_dict()
            return self._backend.export_packed(
                self._backend.load({k: v for k, v in saved.items() if k.startswith("weight")}, saved["weight"].device)
            )
        packed = layer.weight.data.as_subclass(torch.Tensor)
        spec = QuantSpec(state.quant_type, int(state.blocksize), bool(state.nested))
        return self._backend.export_packed(
            Quantized(self._backend.name, spec, tuple(state.shape), packed.device, BnbHandle(packed, state))
        )

    def computing_state(self, layer: torch.nn.Module) -> PackedBnb4:
        """In the CPU-packed layout (see the module docstring) the layer computes from the
        repacked codes and the absmax it keeps for that kernel, in bf16 and transposed to
        ``[K / blocksize, N]``: read both as they are (``state_dict`` of that layout writes
        another absmax: a known failure), as the plain layout's record."""
        state = _quant_state(layer)
        if not getattr(state, "packing_format_for_cpu", False):
            return self.packed(layer)
        import numpy as np

        n, k = (int(d) for d in state.shape)
        block_n = 32  # bitsandbytes' _convert_weight_packed_for_cpu default
        data = layer.weight.data.as_subclass(torch.Tensor).reshape(-1, block_n).cpu()
        codes = torch.cat([data & 0xF, data >> 4], dim=-1).reshape(n // block_n, k // 2, block_n, 2)
        codes = codes.transpose(1, 2).reshape(-1)
        packed = ((codes[0::2] << 4) | codes[1::2]).to(torch.uint8).numpy()
        absmax = state.absmax.detach().float().T.reshape(-1).cpu().numpy()
        return PackedBnb4(
            quant_type=state.quant_type,
            blocksize=int(state.blocksize),
            shape=(n, k),
            packed=packed,
            absmax=np.ascontiguousarray(absmax, dtype=np.float32),
            code=state.code.detach().float().cpu().numpy(),
            dtype=str(getattr(state, "original_dtype", state.dtype)).removeprefix("torch."),
        )

    def empty(self, spec: QuantSpec, shape: tuple[int, int], bias: bool, compute_dtype: torch.dtype) -> torch.nn.Module:
        return self._layer(shape, torch.zeros(shape[0]) if bias else None, spec, compute_dtype, torch.empty(0))

    def load(self, layer: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
        """transformers' loading of a pre-quantized ``Linear4bit``: ``Params4bit.from_prequantized``
        with the checkpoint's ``weight.*`` entries; the bias is copied."""
        from bitsandbytes.nn import Params4bit

        stats = {key.removeprefix("weight."): value for key, value in state.items() if key.startswith("weight.")}
        layer.weight = Params4bit.from_prequantized(
            data=state["weight"], quantized_stats=stats, requires_grad=False, device=device, module=layer
        )
        if "bias" in state:
            layer.bias = torch.nn.Parameter(state["bias"].to(device), requires_grad=False)
        return layer

    def transformers_config(self, spec: QuantSpec, compute_dtype: torch.dtype) -> Any:
        """``BitsAndBytesConfig``: it takes no blocksize, so a model gets the platform default;
        ``bnb_4bit_quant_storage`` is the spec's (FSDP-QLoRA stores the bytes as the compute dtype)."""
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=spec.format,
            bnb_4bit_use_double_quant=spec.double_quant,
            bnb_4bit_compute_dtype=compute_dtype,
            bnb_4bit_quant_storage=spec.quant_storage,
        )
