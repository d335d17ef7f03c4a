"""A reusable dequantize buffer, as fast training stacks keep one (unsloth's WEIGHT_BUFFER).

Dequantizing a 4-bit weight before every matmul allocates a full-size tensor each time;
stacks avoid that by writing into one buffer that lives across calls. The buffer must
follow the request, not its own history: unsloth PR 4026 was a global buffer that kept
the dtype of its first use, so a bf16 load followed by an fp16 load in one process handed
an fp16 model bf16 weights and the matmul crashed. Here the buffer is an object the owner
(the backend adapter) holds, never module state, and every call checks device and dtype.
"""

from __future__ import annotations

import math

import torch

from qconform_triton_nf4.kernels.nf4_dequant import dequantize_4bit


class WeightBuffer:
    """Owns one flat storage tensor and dequantizes into a view of it.

    The storage is reused while device and dtype match and it holds at least the requested
    number of elements; otherwise it is replaced by one of exactly the new size, device and
    dtype. A shape change that still fits gets a fresh view of the requested shape.

    The tensor ``dequantize`` returns is a view of the shared storage: the NEXT call
    overwrites it (and a reallocating call detaches it). Copy it if it must outlive the call.
    """

    def __init__(self) -> None:
        self._storage: torch.Tensor | None = None

    @property
    def storage(self) -> torch.Tensor | None:
        """The current backing tensor (flat), or None before the first call or after ``release``."""
        return self._storage

    def release(self) -> None:
        """Drop the storage (e.g. before a model is unloaded)."""
        self._storage = None

    def view(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """A ``shape`` view of the storage in ``dtype`` on ``device`` (reallocated when it does
        not fit), for a caller that writes it itself (the Triton adapter's planned dequantize)."""
        numel = math.prod(shape)
        storage = self._storage
        if storage is None or storage.dtype != dtype or storage.device != device or storage.numel() < numel:
            storage = torch.empty(numel, dtype=dtype, device=device)
            self._storage = storage
        return storage[:numel].view(shape)

    def dequantize(
        self,
        packed: torch.Tensor,
        absmax: torch.Tensor,
        *,
        blocksize: int,
        shape: tuple[int, ...],
        code: torch.Tensor,
        out_dtype: torch.dtype,
        nested_absmax: torch.Tensor | None = None,
        nested_code: torch.Tensor | None = None,
        nested_blocksize: int = 256,
        offset: float | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``dequantize_4bit`` into the buffer; returns a ``shape``/``out_dtype`` view of it.

        The result is overwritten by the next call on this buffer.
        """
        shape = tuple(int(s) for s in shape)
        out = self.view(shape, out_dtype, packed.device)
        return dequantize_4bit(
            packed,
            absmax,
            blocksize=blocksize,
            shape=shape,
            code=code,
            out_dtype=out_dtype,
            nested_absmax=nested_absmax,
            nested_code=nested_code,
            nested_blocksize=nested_blocksize,
            offset=offset,
            out=out,
        )
