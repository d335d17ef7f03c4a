"""gemlite's 4-bit layout of a converted HQQ layer: unpack the int32 words and decode.

gemlite's ``A16Wn.from_hqqlinear`` (gemlite 0.6, helper.py) takes HQQ's unpacked codes
``Q`` (uint8, shape ``(N, K)`` = (out, in)), its ``scale`` and ``zero`` (one per group of
``group_size`` consecutive input features of a row, HQQ's axis 1) and calls
``GemLiteLinearTriton.pack`` (core.py), which stores, with ``e = 32 / 4 = 8`` codes a word:

    packed[c, n] = OR_j  Q[n, 8 c + j] << 4 j        int32, shape (K / 8, N)

(``pack_weights_over_cols`` over the input features, then transposed), and the scale and
zero as ``(K / group_size, N)`` tensors (``x.view(N, -1).t()``) in the layer's dtype.
With ``fma_mode`` (the default) and more than one group per row, ``zero`` is replaced by

    zero_fma = fl(-zero * scale)        rounded from float32 to the layer's dtype

and the kernels dequantize with ``W_group_mode``

    3:  W = (q - zero) * scale          (one group per row, or fma_mode off)
    4:  W = fma(q, scale, zero_fma)     (grouped, fma_mode on)

in the layer's dtype (gemlite triton_kernels/utils.py ``dequantize``). The reference
evaluates both exactly in float64 from the stored values; it knows modes 3 and 4 with the
scale applied to the weight (``channel_scale_mode`` 0), what a CUDA build converts to.
"""

from __future__ import annotations

import numpy as np
import torch
from pytest_qconform.reference.packed import PackedGemlite4

__all__ = ["GROUP_MODES", "decode", "decode_parts", "hqq_parts", "unpack_over_cols"]

GROUP_MODES: dict[int, str] = {3: "(q - zero) * scale", 4: "fma(q, scale, zero)"}
_NBITS = 4


def unpack_over_cols(packed: np.ndarray, in_features: int) -> np.ndarray:
    """gemlite's ``(K / 8, N)`` int32 words -> the codes ``(N, K)`` as uint8: code ``j`` of
    word ``c`` (bits ``4 j .. 4 j + 3``) is input feature ``8 c + j``."""
    words = np.ascontiguousarray(np.asarray(packed))
    if words.dtype not in (np.int32, np.uint32):
        raise ValueError(f"gemlite4: expected int32 words, got {words.dtype}")
    if words.ndim != 2:
        raise ValueError(f"gemlite4: expected a 2-D (K / 8, N) array of words, got shape {words.shape}")
    per_word = 32 // _NBITS
    if words.shape[0] * per_word != in_features:
        raise ValueError(
            f"gemlite4: {words.shape[0]} rows of words hold {words.shape[0] * per_word} codes per output "
            f"feature, expected in_features = {in_features}"
        )
    unsigned = words.view(np.uint32)
    shifts = (np.arange(per_word, dtype=np.uint32) * _NBITS)[None, None, :]
    codes = (unsigned[:, :, None] >> shifts) & np.uint32(2**_NBITS - 1)  # (K/8, N, 8)
    return codes.transpose(1, 0, 2).reshape(words.shape[1], in_features).astype(np.uint8)


def _per_group(values: np.ndarray, p: PackedGemlite4, name: str) -> np.ndarray:
    """A ``(K / group_size, N)`` field repeated over its group: float64 ``(N, K)``."""
    out_features, in_features = p.shape
    groups = in_features // p.group_size
    array = np.asarray(values, dtype=np.float64)
    if array.size != groups * out_features:
        raise ValueError(
            f"gemlite4: {name} has {array.size} entries, expected (K / group_size) * N = {groups * out_features} "
            f"for shape {tuple(p.shape)}, group_size {p.group_size}"
        )
    return np.repeat(array.reshape(groups, out_features).T, p.group_size, axis=1)


def decode_parts(
    p: PackedGemlite4, device: str | torch.device | None = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, zero, scale)`` in float64, each ``(N, K)``, as gemlite stores them: ``zero`` is
    the stored field (mode 4: ``zero_fma``, already multiplied by the scale)."""
    if len(p.shape) != 2:
        raise ValueError(f"gemlite4: a layer weight is 2-D (out, in), got shape {tuple(p.shape)}")
    if p.group_mode not in GROUP_MODES or p.channel_scale_mode != 0:
        raise ValueError(
            f"gemlite4: W_group_mode {p.group_mode} with channel_scale_mode {p.channel_scale_mode} is not "
            f"decoded; known: {GROUP_MODES} with channel_scale_mode 0"
        )
    if p.elements_per_sample != 32 // _NBITS:
        raise ValueError(f"gemlite4: expected 8 codes per int32 word, got elements_per_sample {p.elements_per_sample}")
    out_features, in_features = p.shape
    if p.group_size <= 0 or in_features % p.group_size:
        raise ValueError(f"gemlite4: in_features {in_features} is not a multiple of group_size {p.group_size}")
    q = unpack_over_cols(p.packed, in_features).astype(np.float64)
    if q.shape[0] != out_features:
        raise ValueError(f"gemlite4: the words hold {q.shape[0]} output features, expected {out_features}")
    dev = torch.device("cpu" if device is None else device)
    return tuple(  # type: ignore[return-value]
        torch.as_tensor(a, device=dev) for a in (q, _per_group(p.zero, p, "zero"), _per_group(p.scale, p, "scale"))
    )


def decode(p: PackedGemlite4, device: str | torch.device | None = "cpu") -> torch.Tensor:
    """The weight in float64, ``(N, K)``: mode 3 ``(q - zero) * scale``, mode 4
    ``q * scale + zero``, each exact from the stored values."""
    q, zero, scale = decode_parts(p, device)
    return (q - zero) * scale if p.group_mode == 3 else q * scale + zero


def hqq_parts(
    p: PackedGemlite4, device: str | torch.device | None = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, zero, scale)`` in HQQ's convention ``W = (q - zero) * scale``: mode 4's zero is
    ``-zero_fma / scale`` (in float64), so checks written for HQQ's levels apply unchanged."""
    q, zero, scale = decode_parts(p, device)
    if p.group_mode == 4:
        zero = torch.where(scale != 0, -zero / torch.where(scale != 0, scale, 1.0), 0.0)
    return q, zero, scale
