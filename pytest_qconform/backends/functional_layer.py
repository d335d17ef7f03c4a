"""A layer for a backend that has only the functional facet: ``FunctionalLinear``.

Our Triton backend (and the example downstream backend) have no layer class of their
own, so this module gives them one built on their public adapter methods: the
quantization state is the backend's ``serialize()`` dict, held as buffers (so
``state_dict``, ``load_state_dict``, ``.to`` and ``.cuda`` carry it), and the forward
is the backend's ``matmul`` in the layer's compute dtype. For triton-nf4 that means our
kernels and the adapter's one reusable ``WeightBuffer``, shared by every layer of every
model built from that backend instance, which is what the layer-sequencing suite checks.

Two rules a quantized layer must follow and ``nn.Module`` does not give for free:
``model.half()`` / ``.to(dtype)`` cast floating buffers, which would round absmax and the
code table, so a dtype cast moves the state's device only (``_apply``); and a checkpoint
may hold another blocksize than the layer it is loaded into (64 from CUDA into a ROCm
default of 128), so loading replaces the state's tensors, sizes included, after the
backend's ``load`` has accepted them. The backend's view of the buffers follows them when
something replaces one directly (accelerate's ``set_module_tensor_to_device``).
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from pytest_qconform.backends.base import Backend, Quantized, QuantSpec
from pytest_qconform.backends.layers import LayerFacet
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

PREFIX = "quant_"  # buffer name = PREFIX + the key of the backend's serialize() dict


class FunctionalLinear(torch.nn.Module):
    """``y = x W^T + b`` through ``backend.matmul``, the weight held as ``backend.serialize`` buffers."""

    def __init__(
        self, backend: Backend, quantized: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.backend = backend
        self.compute_dtype = compute_dtype
        self.out_features, self.in_features = quantized.shape
        for key, value in backend.serialize(quantized).items():
            # One device for the whole state, as any module's: a backend's scalars (blocksize,
            # shape) come from serialize() on the host, and a layer on a GPU that kept them there
            # could not be wrapped by DDP over NCCL, which broadcasts every buffer.
            self.register_buffer(PREFIX + key, value.to(quantized.device))
        self.bias = (
            torch.nn.Parameter(bias.detach().clone(), requires_grad=bias.requires_grad) if bias is not None else None
        )
        self._rebuild()

    def state(self) -> dict[str, torch.Tensor]:
        """The backend's serialize() dict, as the layer holds it now."""
        return {name.removeprefix(PREFIX): buf for name, buf in self._buffers.items() if name.startswith(PREFIX)}

    def _rebuild(self) -> None:
        """The backend's ``Quantized`` view of the buffers (after init, moves and loads)."""
        state = self.state()
        self._built_names = tuple(PREFIX + key for key in state)
        self._built_from = tuple(state.values())
        self._built_buffer_count = len(self._buffers)
        # A meta-device state has no values to load (accelerate's cpu_ram_efficient_loading
        # moves a model to meta before rank 0's weights are loaded into it): the view waits
        # for real tensors.
        self._quantized = None if state["packed"].is_meta else self.backend.load(state, state["packed"].device)

    @property
    def quantized(self) -> Quantized:
        """The backend's view of the buffers as they are now: rebuilt when a buffer was
        replaced without ``_apply`` or a load (accelerate's ``set_module_tensor_to_device``,
        which moves and loads tensors one by one, assigns ``module._buffers[name]``), or
        one was added or removed. Read on every forward: the comparison runs in C (``map``)."""
        buffers = self._buffers
        if len(buffers) != self._built_buffer_count or not all(
            map(operator.is_, map(buffers.get, self._built_names), self._built_from)
        ):
            self._rebuild()
        if self._quantized is None:
            raise RuntimeError(
                f"{self.backend.name}: this layer's quantization state is on the meta device; load real tensors "
                "into it (load_state_dict(..., assign=True), or to_empty() and a load) before using it"
            )
        return self._quantized

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backend.matmul(x, self.quantized, self.bias, self.compute_dtype)

    def _apply(self, fn: Any, recurse: bool = True) -> FunctionalLinear:
        """Moves apply to everything; dtype casts (``.half()``, ``.to(dtype)``) to the bias only."""
        before = {name: buf for name, buf in self._buffers.items() if name.startswith(PREFIX)}
        super()._apply(fn, recurse)
        for name, old in before.items():
            new = self._buffers[name]
            if new is not None and new.dtype != old.dtype:
                self._buffers[name] = old.to(new.device)
        self._rebuild()
        return self

    def _load_from_state_dict(
        self,
        state_dict: dict[str, Any],
        prefix: str,
        local_metadata: dict,
        strict: bool,
        missing_keys: list[str],
        unexpected_keys: list[str],
        error_msgs: list[str],
    ) -> None:
        """The checkpoint's quantization state replaces the layer's (its blocksize and sizes
        included) once the backend's ``load`` accepts it; a partial or refused state is an
        error, never a mix of the checkpoint's bytes with this layer's scales."""
        names = [name for name in self._buffers if name.startswith(PREFIX)]
        given = {
            name.removeprefix(prefix + PREFIX): value
            for name, value in state_dict.items()
            if name.startswith(prefix + PREFIX)
        }
        if given:
            device = self._buffers[PREFIX + "packed"].device  # the state's, whatever order the names have
            try:
                self.backend.load(given, device)
            except Exception as exc:  # noqa: BLE001 - reported through load_state_dict's error list
                error_msgs.append(f"{prefix}: the backend refused the checkpoint's quantization state: {exc}")
                return
            for name in names:
                self._buffers.pop(name)
            for key, value in given.items():
                self.register_buffer(PREFIX + key, torch.empty_like(value, device=device))
        super()._load_from_state_dict(
            state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs
        )
        self._rebuild()

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"backend={self.backend.name}, format={self._quantized.spec.label() if self._quantized else 'meta'}, "
            f"compute_dtype={self.compute_dtype}"
        )


class FunctionalLayers(LayerFacet):
    """The layer facet of a functional backend, through ``FunctionalLinear`` (or a subclass):
    it claims what the backend claims, and every move; PEFT and transformers do not know it."""

    layer_class: type[FunctionalLinear] = FunctionalLinear

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def layer_types(self) -> tuple[type, ...]:
        return (self.layer_class,)

    def owns(self, module: torch.nn.Module) -> bool:
        """A ``FunctionalLinear`` of this facet's backend (every functional backend's layer
        has that class)."""
        return isinstance(module, FunctionalLinear) and getattr(module.backend, "name", None) == self.backend.name

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        quantized = self.backend.quantize(weight.detach().to(device), spec)
        return self.layer_class(self.backend, quantized, bias.to(device) if bias is not None else None, compute_dtype)

    def packed(self, layer: torch.nn.Module) -> PackedBnb4 | PackedHqq4:
        return self.backend.export_packed(layer.quantized)

    def empty(self, spec: QuantSpec, shape: tuple[int, int], bias: bool, compute_dtype: torch.dtype) -> torch.nn.Module:
        """A layer holding the quantization of zeros with ``spec`` (the loading side's defaults),
        built on the CPU where the backend claims it, else on the first device it claims (a
        backend that quantizes only on a GPU, as our Triton kernels do outside the interpreter)."""
        claimed = self.backend.capabilities(torch.device("cpu")).devices
        device = torch.device("cpu" if "cpu" in claimed or not claimed else claimed[0])
        return self.quantize(torch.zeros(shape), torch.zeros(shape[0]) if bias else None, spec, compute_dtype, device)
