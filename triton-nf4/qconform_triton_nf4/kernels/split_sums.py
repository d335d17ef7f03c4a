"""The buffers of a launch whose K is split: fp32 partial sums per call, tickets per stream.

Why one place: the tensor-core kernels (``nf4_mma``, ``nf4_tc_gemm``) and the
warp-specialized GEMM (``nf4_ws_gemm``) sum a K split the same way: each split writes its
fp32 sums to its slab of a [splits, M, N] work buffer, and the last program of a tile to
draw a ticket (one int32 a tile, zeroed again by that program) adds them in split order.
The work buffer is a fresh tensor each call, from torch's allocator; the tickets are kept
per stream, since two streams may run the same plan at once and a kernel leaves them zero.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class SplitSums:
    """``buffers(out, unused)`` -> (work, tickets) for one launch of a plan with ``splits``
    K splits over ``tiles`` output tiles of an [M, N] result on ``device``. Unsplit, the
    kernel writes ``out`` directly and reads no ticket: (out, unused), any tensor of the
    launch standing in for the pointer it does not read."""

    __slots__ = ("_device", "_device_index", "_shape", "_stream_of", "_tickets", "splits", "tiles")

    def __init__(self, splits: int, tiles: int, M: int, N: int, device: torch.device) -> None:
        self.splits, self.tiles = splits, tiles
        self._shape = (splits, M, N)
        self._device = device
        self._device_index = device.index if device.index is not None else 0
        stream_of: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._stream_of = stream_of if device.type == "cuda" else None
        self._tickets: dict[int, torch.Tensor] = {}  # per stream: one int32 per tile, zero between launches

    def buffers(self, out: torch.Tensor, unused: object) -> tuple[object, object]:
        if self.splits == 1:
            return out, unused
        work = torch.empty(self._shape, dtype=torch.float32, device=self._device)
        stream = self._stream_of(self._device_index) if self._stream_of is not None else 0
        tickets = self._tickets.get(stream)
        if tickets is None:
            tickets = self._tickets[stream] = torch.zeros(self.tiles, dtype=torch.int32, device=self._device)
        return work, tickets
