"""The context a quantized layer was called in, as the call-site oracle records it.

Real workloads call a 4-bit layer in settings that a test calling one operation never
writes: without grad (generate), in inference mode (serving), under autocast (a trainer's
mixed precision), again during the backward pass (gradient checkpointing recomputes the
forward), on a side stream, inside a ``torch.compile``d model, captured into a CUDA graph,
with 3-D activations that are views of a wider tensor. Each
checked call carries its context so that the report can say, per backend, which of these
settings were seen and judged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace

import torch

from pytest_qconform.vocabulary import DtypeLabel


def _dtype_label(dtype: torch.dtype) -> str:
    try:
        return DtypeLabel.of(dtype).value
    except ValueError:
        return str(dtype).removeprefix("torch.")


def _layout(x: torch.Tensor) -> str:
    if x.is_contiguous():
        return "contiguous"
    if x.dim() >= 2 and x.transpose(-1, -2).is_contiguous():
        return "transposed"
    return "strided"


def _autocast(device: torch.device) -> str:
    """``"off"``, or the autocast dtype in force for ``device``'s type (``"cuda:bf16"``)."""
    kind = device.type
    try:
        enabled = torch.is_autocast_enabled(kind)
    except (TypeError, RuntimeError):  # a device type autocast does not know
        return "off"
    if not enabled:
        return "off"
    return f"{kind}:{_dtype_label(torch.get_autocast_dtype(kind))}"


def _stream(device: torch.device) -> str:
    if device.type != "cuda":
        return "none"
    current = torch.cuda.current_stream(device)
    return "default" if current == torch.cuda.default_stream(device) else "side"


def capturing(device: torch.device) -> bool:
    """Whether the current stream of ``device`` is capturing a CUDA graph: the call is being
    recorded, its result exists only after a replay."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def in_backward() -> bool:
    """Whether autograd's engine is running a backward pass on this thread: a forward that
    runs then is a recomputation (gradient checkpointing)."""
    return torch._C._current_graph_task_id() != -1


@dataclass(frozen=True)
class CallContext:
    """How one call of a quantized layer was made. ``signature`` leaves out the row count
    (every shape is checked on its own, see ``oracle.Sampler``)."""

    direction: str  # "forward" or "backward"
    grad: bool
    inference_mode: bool
    autocast: str
    recompute: bool
    compiled: bool  # called from code torch.compile traced (queued inside the graph, see oracle)
    captured: bool  # called while a CUDA graph was being captured (judged after a replay)
    stream: str
    device: str
    rank: int
    rows: int
    layout: str
    storage_offset: bool
    dtype: str

    @classmethod
    def _of(cls, t: torch.Tensor, direction: str, **settings: object) -> CallContext:
        """The tensor's part of the context (device, rank, rows, layout, dtype) and ``settings``."""
        return cls(
            direction=direction,
            grad=torch.is_grad_enabled(),
            stream=_stream(t.device),
            device=t.device.type,
            rank=t.dim(),
            rows=t.numel() // max(t.shape[-1], 1) if t.dim() else 0,
            layout=_layout(t),
            storage_offset=t.storage_offset() != 0,
            dtype=_dtype_label(t.dtype),
            **settings,  # type: ignore[arg-type]
        )

    @classmethod
    def of_forward(cls, x: torch.Tensor) -> CallContext:
        return cls._of(
            x,
            "forward",
            inference_mode=torch.is_inference_mode_enabled(),
            autocast=_autocast(x.device),
            recompute=in_backward(),
            compiled=False,
            captured=capturing(x.device),
        )

    @classmethod
    def of_compiled(
        cls, x: torch.Tensor, *, grad: bool, inference_mode: bool, autocast: torch.dtype | None
    ) -> CallContext:
        """A call compiled code made, with the modes it ran under (recorded inside the graph):
        the tensors are the graph's, read after it ran."""
        context = cls._of(
            x,
            "forward",
            inference_mode=inference_mode,
            autocast="off" if autocast is None else f"{x.device.type}:{_dtype_label(autocast)}",
            recompute=False,
            compiled=True,
            captured=False,
        )
        return replace(context, grad=grad)

    @classmethod
    def of_backward(cls, dy: torch.Tensor) -> CallContext:
        return cls._of(
            dy,
            "backward",
            inference_mode=False,
            autocast="off",
            recompute=False,
            compiled=False,
            captured=capturing(dy.device),
        )

    def signature(self) -> str:
        """Everything but the row count, as one readable string (the report's coverage key)."""
        grad = (
            ("grad" if self.grad else "no-grad")
            if self.direction == "forward"
            else ("create-graph" if self.grad else "")
        )
        parts = [
            self.direction,
            *([grad] if grad else []),
            *(["inference-mode"] if self.inference_mode else []),
            *([f"autocast={self.autocast}"] if self.autocast != "off" else []),
            *(["recompute"] if self.recompute else []),
            *(["compiled"] if self.compiled else []),
            *(["captured"] if self.captured else []),
            *([f"stream={self.stream}"] if self.stream == "side" else []),
            self.device,
            f"{self.rank}-D",
            self.layout,
            *(["offset"] if self.storage_offset else []),
            self.dtype,
        ]
        return " ".join(parts)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)
