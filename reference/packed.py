"""Backend-neutral records of packed 4-bit state, as the reference decodes it.

Backends export their own bytes into these records (``Backend.export_packed``); the
reference decodes them without importing any backend. Arrays are NumPy, on the host,
exactly as the backend stores them (no re-packing), so a layout bug in a backend shows
up as a decoding mismatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class PackedBnb4:
    """bitsandbytes-layout 4-bit blockwise state (NF4 or FP4).

    packed: uint8, the flattened weight two codes per byte, ceil(numel / 2) bytes.
    absmax: float32 per block, or uint8 codes into nested_code when double quantized.
    code: float32[16], the backend's own code table (quant_map).
    nested_absmax / nested_code / offset / nested_blocksize: double quantization of absmax.
    shape: the logical weight shape; numel = prod(shape), possibly not a multiple of blocksize.
    """

    quant_type: str  # "nf4" | "fp4"
    blocksize: int
    shape: tuple[int, ...]
    packed: np.ndarray
    absmax: np.ndarray
    code: np.ndarray
    nested_absmax: np.ndarray | None = None
    nested_code: np.ndarray | None = None
    nested_blocksize: int | None = None
    offset: float | None = None
    dtype: str = "float32"  # the dtype the backend dequantizes to by default

    @property
    def double_quant(self) -> bool:
        return self.nested_absmax is not None

    @property
    def numel(self) -> int:
        return int(np.prod(self.shape)) if self.shape else 1


@dataclass(frozen=True)
class PackedHqq4:
    """HQQ 4-bit affine state: W = (W_q - zero) * scale per group.

    packed: uint8 as HQQ's ``4bit_u8`` packing stores it (two groups of rows per byte).
    scale, zero: float arrays as HQQ stores them (shape depends on axis).
    group_size / axis: HQQ's grouping; shape: the logical weight shape (out, in).
    """

    shape: tuple[int, ...]
    group_size: int
    axis: int
    packed: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    packing: str = "4bit_u8"
    meta: dict = field(default_factory=dict)


@dataclass(frozen=True)
class PackedGemlite4:
    """An HQQ layer after gemlite's conversion (``A16Wn.from_hqqlinear``), as
    ``GemLiteLinearTriton`` stores it: HQQ's 4-bit affine codes re-packed for gemlite's
    kernels, with group-wise scale and zero along the input features only (axis 1).

    packed: int32 ``(K / 8, N)``: eight 4-bit codes of one weight row per word, the code of
        input feature ``8 c + j`` in bits ``4 j .. 4 j + 3`` of word ``c``, stored transposed.
    scale, zero: ``(K / group_size, N)`` in the layer's dtype (bf16 widened to fp32 exactly);
        what ``zero`` means depends on ``group_mode`` (``gemlite4`` has the formulas).
    group_mode: gemlite's ``W_group_mode`` (3: ``(q - zero) * scale``; 4: ``fma(q, scale, zero)``).
    channel_scale_mode: gemlite's ``channel_scale_mode`` (0: scale applied to the weight).
    shape: the logical weight shape (out, in) = (N, K); meta: dtypes as stored.
    """

    shape: tuple[int, ...]
    group_size: int
    packed: np.ndarray
    scale: np.ndarray
    zero: np.ndarray
    group_mode: int
    channel_scale_mode: int = 0
    elements_per_sample: int = 8
    meta: dict = field(default_factory=dict)

    @property
    def axis(self) -> int:
        """Groups run along the input features, HQQ's axis 1 (the only axis gemlite converts)."""
        return 1
