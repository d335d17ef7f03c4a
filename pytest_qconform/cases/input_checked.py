"""The backend under test as the suites see it: every quantization it makes is checked
against the weight it was given.

A suite compares a backend's results with the float64 decoding of its own stored state.
Were that state itself wrong (an inf scale, a NaN absmax, an absmax off by a factor), both
sides would agree. Wrapping the backend once here, rather than adding a line to every
test, puts the input check on every path that quantizes: the functional ``quantize``
and the layer facet's ``quantize`` (the layer built the way users build it), on every
device. Nothing is repaired or converted on the way in: the library gets what the test
passes, and its answer goes back to the test unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from pytest_qconform.backends.base import Backend, Quantized, QuantSpec
    from pytest_qconform.backends.layers import LayerFacet
    from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4


class Checker(Protocol):
    """What this module needs of ``fixtures.Checker`` (which imports this module)."""

    def faithful(self, packed: PackedBnb4 | PackedHqq4, weight: torch.Tensor, what: str) -> None: ...


class _InputCheckedFacet:
    """A layer facet whose every built layer is checked against its float weight."""

    def __init__(self, facet: LayerFacet, checker: Checker, backend_name: str) -> None:
        self._facet = facet
        self._checker = checker
        self._backend_name = backend_name

    def __getattr__(self, name: str) -> Any:
        return getattr(self._facet, name)

    def quantize(
        self,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        spec: QuantSpec,
        compute_dtype: torch.dtype,
        device: torch.device,
    ) -> torch.nn.Module:
        layer = self._facet.quantize(weight, bias, spec, compute_dtype, device)
        self._checker.faithful(self._facet.packed(layer), weight, f"{self._backend_name} layer quantized by moving")
        return layer


class InputCheckedBackend:
    """Delegates everything to the backend; checks what ``quantize`` stored against its input."""

    def __init__(self, backend: Backend, checker: Checker) -> None:
        self._backend = backend
        self._checker = checker

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)

    @property
    def unchecked(self) -> Backend:
        """The backend itself (for code that needs its identity)."""
        return self._backend

    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        quantized = self._backend.quantize(weight, spec)
        self._checker.faithful(self._backend.export_packed(quantized), weight, f"{self._backend.name}.quantize")
        return quantized

    def layers(self) -> _InputCheckedFacet | None:
        facet = self._backend.layers()
        return None if facet is None else _InputCheckedFacet(facet, self._checker, self._backend.name)
