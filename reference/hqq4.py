"""HQQ 4-bit affine format: unpack HQQ's ``4bit_u8`` bytes and decode.

Grouping (hqq ``Quantizer.quantize``, hqq 0.2.x core/quantize.py): the weight of shape
``shape`` (numel divisible by ``group_size``) is reshaped, in C order, to

    axis = 1:  Q of shape (numel // group_size, group_size)   one group per ROW
    axis = 0:  Q of shape (group_size, numel // group_size)   one group per COLUMN

and reduced along ``axis``, so ``scale`` and ``zero`` have shape ``(R, 1)`` for axis 1 and
``(1, C)`` for axis 0 (R, C = the rows and columns of Q). Each entry of Q is a 4-bit
integer ``q`` in 0..15, and the weight is

    W = ((q - zero) * scale).reshape(shape)

hqq evaluates ``(q - zero) * scale`` in the layer's compute dtype (two roundings; ``q``
itself is exact there); the reference evaluates it exactly in float64 from the stored
scale and zero (``scale`` is stored already inverted, as a multiplier).

Packing ``4bit_u8`` (hqq core/bitpack.py ``BitPack.pack_4bit_u8``): Q's ROWS are split
into halves, ``packed = (Q[:R/2] << 4) | Q[R/2:]``, a uint8 array of shape ``(R/2, C)``:
the high nibble of packed row ``r`` is Q's row ``r`` and the low nibble Q's row
``r + R/2``. (This is not the interleaving bitsandbytes uses.)
"""

from __future__ import annotations

import numpy as np
import torch
from pytest_qconform.reference.packed import PackedHqq4

__all__ = ["decode", "decode_parts", "group_parts", "grouped_shape", "per_group_and_value", "unpack_4bit_u8"]


def grouped_shape(shape: tuple[int, ...], group_size: int, axis: int) -> tuple[int, int]:
    """The (rows, columns) of HQQ's grouped tensor Q for a weight of ``shape``."""
    numel = int(np.prod(shape)) if shape else 1
    if axis not in (0, 1):
        raise ValueError(f"HQQ axis must be 0 or 1, got {axis}")
    if group_size <= 0 or numel % group_size:
        raise ValueError(f"HQQ needs numel {numel} (shape {tuple(shape)}) divisible by group_size {group_size}")
    groups = numel // group_size
    return (groups, group_size) if axis == 1 else (group_size, groups)


def unpack_4bit_u8(packed: np.ndarray) -> np.ndarray:
    """HQQ's ``4bit_u8`` bytes ``(R/2, C)`` -> the 4-bit values ``(R, C)`` as uint8:
    rows ``[0, R/2)`` from the high nibbles, rows ``[R/2, R)`` from the low nibbles."""
    data = np.asarray(packed)
    if data.dtype != np.uint8:
        raise ValueError(
            f"unpack_4bit_u8: expected uint8 bytes, got {data.dtype} (a view_as_float "
            "W_q must be viewed back as uint8 first)"
        )
    if data.ndim != 2:
        raise ValueError(f"unpack_4bit_u8: expected a 2-D (R/2, C) array, got shape {data.shape}")
    return np.concatenate([data >> 4, data & 0x0F], axis=0).astype(np.uint8)


def _per_group(values: np.ndarray, rows: int, cols: int, axis: int, name: str) -> np.ndarray:
    """scale/zero as a float64 column (axis 1) or row (axis 0) broadcasting over Q."""
    flat = np.asarray(values, dtype=np.float64).reshape(-1)
    groups = rows if axis == 1 else cols
    if flat.size != groups:
        raise ValueError(
            f"HQQ {name} has {flat.size} entries, expected one per group ({groups}) "
            f"for axis {axis} on a ({rows}, {cols}) grouped tensor"
        )
    return flat.reshape(rows, 1) if axis == 1 else flat.reshape(1, cols)


def _groups(p: PackedHqq4) -> tuple[np.ndarray, int, int]:
    """Q's 4-bit values ``(R, C)`` as uint8, with R and C, after checking the record."""
    if p.packing != "4bit_u8":
        raise ValueError(f"hqq4.decode knows the '4bit_u8' packing only, got {p.packing!r}")
    rows, cols = grouped_shape(tuple(p.shape), p.group_size, p.axis)
    if rows % 2:
        raise ValueError(
            f"HQQ 4bit_u8 splits Q's {rows} rows into halves: an odd row count cannot be "
            f"packed (shape {tuple(p.shape)}, group_size {p.group_size}, axis {p.axis})"
        )
    data = np.asarray(p.packed)
    if data.dtype != np.uint8:
        data = np.ascontiguousarray(data).view(np.uint8)
    if data.size != rows // 2 * cols:
        raise ValueError(
            f"HQQ packed has {data.size} bytes, expected (R/2) * C = {rows // 2 * cols} for "
            f"shape {tuple(p.shape)}, group_size {p.group_size}, axis {p.axis}"
        )
    return unpack_4bit_u8(data.reshape(rows // 2, cols)), rows, cols


def decode_parts(
    p: PackedHqq4, device: str | torch.device | None = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, zero, scale)`` in float64, each of the weight's shape (zero and scale repeated
    over their group): the stored values the weight is computed from, which the error
    bound of a lower-precision evaluation needs as well as the decoding."""
    q_u8, rows, cols = _groups(p)
    q = q_u8.astype(np.float64)
    scale = _per_group(p.scale, rows, cols, p.axis, "scale")
    zero = _per_group(p.zero, rows, cols, p.axis, "zero")
    dev = torch.device("cpu" if device is None else device)
    q_t, zero_t, scale_t = (
        torch.as_tensor(np.broadcast_to(a, (rows, cols)).copy(), device=dev).reshape(tuple(p.shape))
        for a in (q, zero, scale)
    )
    return q_t, zero_t, scale_t


def group_parts(
    p: PackedHqq4, device: str | torch.device | None = "cpu"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(q, zero, scale)`` in float64 per group and value: ``q`` the 16 values 0..15 and
    ``zero``, ``scale`` one per group, shaped to broadcast to ``[groups, 16]``. Whatever is
    computed elementwise from an element's ``q``, zero and scale (the decoding, its error
    bounds) is computed on that table and read out per element (``per_group_and_value``)."""
    rows, cols = grouped_shape(tuple(p.shape), p.group_size, p.axis)
    dev = torch.device("cpu" if device is None else device)
    scale = torch.as_tensor(_per_group(p.scale, rows, cols, p.axis, "scale").reshape(-1, 1), device=dev)
    zero = torch.as_tensor(_per_group(p.zero, rows, cols, p.axis, "zero").reshape(-1, 1), device=dev)
    q = torch.arange(16, dtype=torch.float64, device=dev).unsqueeze(0)
    return q, zero, scale


def per_group_and_value(p: PackedHqq4, table: torch.Tensor) -> torch.Tensor:
    """Each element's entry of ``table`` (``[groups, 16]``: a value for every group and
    4-bit value), shape ``p.shape``."""
    q_u8, _, _ = _groups(p)
    return _read_out(p, q_u8, table)


def _read_out(p: PackedHqq4, q_u8: np.ndarray, table: torch.Tensor) -> torch.Tensor:
    rows, cols = q_u8.shape
    groups = rows if p.axis == 1 else cols
    if tuple(table.shape) != (groups, 16):
        raise ValueError(f"per_group_and_value: table of shape {tuple(table.shape)}, expected ({groups}, 16)")
    index = torch.as_tensor(q_u8, device=table.device).long()
    out = torch.gather(table, 1, index) if p.axis == 1 else torch.gather(table.T, 0, index)
    return out.reshape(tuple(p.shape))


def decode(p: PackedHqq4, device: str | torch.device | None = "cpu") -> torch.Tensor:
    """The weight in float64, shape ``p.shape``: ``((Q - zero) * scale).reshape(shape)``."""
    q_u8, _, _ = _groups(p)
    q, zero, scale = group_parts(p, device)
    return _read_out(p, q_u8, (q - zero) * scale)
