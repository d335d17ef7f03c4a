"""The one interface every 4-bit backend is tested through.

A backend adapter wraps a library's *public* API (what users call) and exposes the
operations the suites check. It must never raise on construction or on
``availability()``: a backend that cannot load reports why, and the run goes on.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from pytest_qconform.backends.spec import QuantSpec
from pytest_qconform.reference.packed import PackedBnb4, PackedGemlite4, PackedHqq4

if TYPE_CHECKING:
    from pytest_qconform.backends.layers import LayerFacet

__all__ = ["Availability", "Backend", "Capabilities", "QuantSpec", "Quantized"]  # QuantSpec: spec.py


@dataclass(frozen=True)
class Availability:
    """Whether the backend can run here; ``reason`` names what is missing when not."""

    available: bool
    version: str | None = None
    reason: str = ""


@dataclass(frozen=True)
class Capabilities:
    """What a backend claims; the suites test every claim and nothing else."""

    formats: tuple[str, ...]
    blocksizes: tuple[int, ...]
    double_quant: bool
    dtypes: tuple[torch.dtype, ...]  # output / compute dtypes supported
    devices: tuple[str, ...]  # "cpu", "cuda" (ROCm devices are "cuda" in torch)
    backward: bool = True
    serialize: bool = True
    max_gemv_rows: int | None = None  # for fused small-batch kernels
    # Row counts at which ``matmul`` changes route (the first row count of each new route:
    # a gemv for 1 row and GEMM from 2 declares (2,)). The suites check every one, its
    # neighbours, and 1, 128 and a prefill (``pytest_qconform.cases.axes``).
    dispatch_rows: tuple[int, ...] = ()
    # The rest of the parameters users pass (issue 18). Defaults claim nothing beyond the
    # plain calls, so an adapter written before them stays correct; each claim is checked.
    axes: tuple[int, ...] = (1,)  # HQQ grouping axes (QuantSpec.axis)
    quant_storages: tuple[torch.dtype, ...] = (torch.uint8,)  # dtypes the packed bytes may be stored as
    out_arguments: tuple[str, ...] = ()  # operations taking an output buffer: "dequantize", "matmul"
    explicit_absmax: bool = False  # dequantize from the bytes and an absmax tensor, without the state object
    weight_orientations: tuple[str, ...] = ("default",)  # how matmul may be handed the packed weight
    # Paths users run (issue 26): operations ("dequantize", "matmul", "layer-forward") claimed to
    # give the eager results under torch.compile, and when captured in a CUDA graph and replayed.
    compiled: tuple[str, ...] = ()
    captured: tuple[str, ...] = ()
    # The widest weight (output features) claimed on this device; None: any. A backend that
    # only emulates a device (Triton's interpreter on a CPU) may claim less than real models'
    # lm_heads (``axes.LM_HEAD_WIDTHS``), and its cell then says so.
    max_out_features: int | None = None
    # Whether the library offers a dequantize its users call. A layer converted for a fast
    # kernel (gemlite) may offer only its forward; its dequantize cells are then not claimed.
    dequantize: bool = True


@dataclass
class Quantized:
    """A backend's quantized weight: opaque ``handle`` plus what the suites need to know."""

    backend: str
    spec: QuantSpec
    shape: tuple[int, ...]
    device: torch.device
    handle: Any = field(repr=False)


class Backend(ABC):
    """Adapter contract. Subclasses set ``name`` and implement every abstract method."""

    name: str = "abstract"

    @abstractmethod
    def availability(self) -> Availability:
        """Import the library lazily; never raise, report the reason instead."""

    @abstractmethod
    def capabilities(self, device: torch.device) -> Capabilities:
        """What this backend supports on ``device``."""

    @abstractmethod
    def quantize(self, weight: torch.Tensor, spec: QuantSpec) -> Quantized:
        """Quantize ``weight`` (on its device) with the backend's own quantizer."""

    @abstractmethod
    def dequantize(self, q: Quantized, dtype: torch.dtype) -> torch.Tensor:
        """Decode to ``dtype`` with the logical shape, on ``q.device``."""

    @abstractmethod
    def matmul(
        self, x: torch.Tensor, q: Quantized, bias: torch.Tensor | None, compute_dtype: torch.dtype
    ) -> torch.Tensor:
        """``y = x W^T + b`` as users compute it; differentiable in ``x`` and ``bias``."""

    @abstractmethod
    def export_packed(self, q: Quantized) -> PackedBnb4 | PackedHqq4 | PackedGemlite4:
        """The backend's own stored bytes, in the record the reference decodes."""

    def dequantize_with(
        self, q: Quantized, dtype: torch.dtype, *, out: torch.Tensor | None = None, absmax: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``dequantize`` with the library's optional parameters: ``out`` (a buffer of
        ``dtype`` and the logical shape to write into; claimed by ``"dequantize" in
        Capabilities.out_arguments``) and ``absmax`` (fp32 per-block scales passed in place
        of the state object, with blocksize and format given by hand; claimed by
        ``Capabilities.explicit_absmax``). Returns the result (``out`` itself when given)."""
        if out is None and absmax is None:
            return self.dequantize(q, dtype)
        raise NotImplementedError(f"{self.name}: dequantize with out=/absmax= is not claimed")

    def matmul_with(
        self,
        x: torch.Tensor,
        q: Quantized,
        bias: torch.Tensor | None,
        compute_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
        orientation: str = "default",
    ) -> torch.Tensor:
        """``matmul`` with an output buffer (``"matmul" in Capabilities.out_arguments``,
        in the compute dtype: the result is written there and returned) or the packed
        weight handed over in another documented orientation (one of
        ``Capabilities.weight_orientations``; "default" is what ``matmul`` does)."""
        if out is None and orientation == "default":
            return self.matmul(x, q, bias, compute_dtype)
        raise NotImplementedError(f"{self.name}: matmul with out=/orientation={orientation!r} is not claimed")

    def serialize(self, q: Quantized) -> dict[str, torch.Tensor]:
        """A state dict as the backend writes it to a checkpoint."""
        raise NotImplementedError(f"{self.name} does not serialize")

    def load(self, state: dict[str, torch.Tensor], device: torch.device) -> Quantized:
        """Rebuild from ``serialize`` output, or raise a clear error (never decode silently wrong)."""
        raise NotImplementedError(f"{self.name} does not load")

    def from_packed(self, packed: PackedBnb4 | PackedHqq4, device: torch.device) -> Quantized:
        """Adopt bytes another backend produced (interop: bitsandbytes bytes through our
        kernels). Raise NotImplementedError when the backend cannot read that layout."""
        raise NotImplementedError(f"{self.name} does not read packed state from other backends")

    def layers(self) -> LayerFacet | None:
        """The layer facet (``pytest_qconform.backends.layers.LayerFacet``): the backend's
        quantized ``nn.Module`` as models use it, checked by the layer suites. ``None``
        (the default): the backend offers no layer, and every layer cell is not claimed."""
        return None
