"""The layer facet: a backend's 4-bit weight held the way models hold it, as an ``nn.Module``.

The functional facet (``Backend.quantize``/``matmul``...) checks the arithmetic with a
fresh state per call. Users meet a backend through its layer class instead
(bitsandbytes' ``Linear4bit``, HQQ's ``HQQLinear``, ours): built from a float weight,
quantized when moved to the device, run in train and eval mode, saved and loaded as
state dicts, moved between devices, wrapped by PEFT and loaded by transformers. The
layer classes have code paths of their own, so the layer suites drive the module only
through ``nn.Module``'s public API (``layer(x)``, ``.train()``, ``.eval()``, ``.to()``,
``.cuda()``, ``.cpu()``, ``state_dict()``, ``load_state_dict()``) plus the few methods
below, which say how the library builds a layer and where it keeps its bytes.

A backend offers the facet by returning a ``LayerFacet`` from ``Backend.layers()``
(default ``None``: every layer cell is "not claimed"). Docs: docs/layers.md.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any

import torch

from pytest_qconform.backends.spec import QuantSpec
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

MOVES: tuple[str, ...] = ("to", "cuda", "cpu")  # the device-move methods a layer may claim


@dataclass(frozen=True)
class LayerCapabilities:
    """What a backend's layer claims beyond the backend's own ``Capabilities`` (formats,
    blocksizes, dtypes, devices and backward are those; the layer suites test every claim).

    ``moves`` names the ``nn.Module`` methods that move a quantized layer between
    devices and keep it working (``"to"``, ``"cuda"``, ``"cpu"``). ``peft``: PEFT's LoRA
    wraps this layer class (it dispatches on the class). ``transformers``: the library
    quantizes and reloads whole models through ``from_pretrained`` with the quantization
    config of ``LayerFacet.transformers_config``.
    """

    moves: tuple[str, ...] = MOVES
    peft: bool = False
    transformers: bool = False


class LayerFacet(ABC):
    """How a backend builds, inspects and reloads its layer class."""

    def capabilities(self, device: torch.device) -> LayerCapabilities:
        """What the layer claims on ``device`` beyond the backend's capabilities (default:
        every move; neither PEFT nor transformers)."""
        return LayerCapabilities()

    @abstractmethod
    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        """A quantized layer on ``device`` built from a float ``weight`` (N, K) and ``bias``
        held on the CPU, the way the library's users do it: bitsandbytes builds a
        ``Linear4bit`` holding the float weight and moves it (``.to(device)`` quantizes);
        HQQ builds an ``HQQLinear`` from an ``nn.Linear`` with ``device=``."""

    @abstractmethod
    def packed(self, layer: torch.nn.Module) -> PackedBnb4 | PackedHqq4:
        """The layer's stored bytes and scales as they are now (host NumPy copies, no
        repacking), for the reference to decode."""

    @abstractmethod
    def empty(self, spec: QuantSpec, shape: tuple[int, int], bias: bool, compute_dtype: torch.dtype) -> torch.nn.Module:
        """A fresh, not yet loaded layer of logical ``shape`` (N, K), built as a loader builds
        it before reading a checkpoint, with ``spec`` as the loading platform's defaults
        (bitsandbytes: a ``Linear4bit`` whose ``Params4bit`` has blocksize
        ``spec.blocksize``, as 128 is on ROCm); ``load`` fills it."""

    def load(self, layer: torch.nn.Module, state: dict[str, torch.Tensor], device: torch.device) -> torch.nn.Module:
        """Fill ``layer`` (from ``empty``) from a saved layer's state dict the way the
        library's loaders do, returning the loaded layer on ``device``. Default:
        ``load_state_dict`` (strict), then ``.to(device)`` (``empty`` builds on the CPU, as
        a loader does before it dispatches). bitsandbytes overrides it with
        ``Params4bit.from_prequantized``, which is how transformers loads a pre-quantized layer."""
        layer.load_state_dict(state, strict=True)
        return layer.to(device)

    def transformers_config(self, spec: QuantSpec, compute_dtype: torch.dtype) -> Any:
        """The ``quantization_config`` for ``transformers`` ``from_pretrained`` that
        quantizes a model's linear layers with this backend (claimed by
        ``LayerCapabilities.transformers``)."""
        raise NotImplementedError(f"{type(self).__name__} has no transformers quantization config")

    def layer_types(self) -> tuple[type, ...]:
        """The module classes of this backend's quantized layers (to find them in a model
        that transformers or PEFT built)."""
        return ()

    def computing_state(self, layer: torch.nn.Module) -> PackedBnb4 | PackedHqq4:
        """The bytes and scales the layer computes its next forward from, for the reference
        to decode (the call-site oracle). Default: ``packed`` (what a checkpoint written now
        holds); a layer that keeps a kernel layout of its own for computing reads that."""
        return self.packed(layer)

    def mark_quantized(self, model: torch.nn.Module) -> None:
        """Mark a model whose layers were replaced by hand (``quantize`` of each) the way the
        library's own model-quantizing entry point marks it, for the libraries that read the
        mark (PEFT's ``prepare_model_for_kbit_training``). Default: nothing."""
        return None

    def owns(self, module: torch.nn.Module) -> bool:
        """Whether ``module`` is one of this backend's quantized layers (the call-site
        oracle hooks those). Default: an instance of ``layer_types()``."""
        types = self.layer_types()
        return bool(types) and isinstance(module, types)

    def compute_dtype(self, layer: torch.nn.Module) -> torch.dtype | None:
        """The dtype the layer computes its product in, or ``None`` when it takes the
        input's (bitsandbytes' ``Linear4bit`` before its first call without one).
        Default: the layer's ``compute_dtype`` attribute, as all three layer classes hold it."""
        dtype = getattr(layer, "compute_dtype", None)
        return dtype if isinstance(dtype, torch.dtype) else None

    def bias(self, layer: torch.nn.Module) -> torch.Tensor | None:
        """The bias the layer adds (default: its ``bias`` attribute when it is a tensor)."""
        bias = getattr(layer, "bias", None)
        return bias.detach() if isinstance(bias, torch.Tensor) else None
