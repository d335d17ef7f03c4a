"""Whether a backend's stored state is faithful to the weight it was quantized from.

The other checks decode the backend's *own* bytes: right for layout, but a stored scale,
absmax or zero that is itself NaN or inf decodes to NaN on both sides and compares equal.
So whatever quantizes is also judged against its *input*: the stored floats must be
finite, and the decoded weight must lie within the format's quantization error of the
input, a bound computed from the input alone (never from the stored state).

bitsandbytes layout (NF4, FP4). Block ``b`` of the flattened input has ``A_b = max |w|``.
Quantizing to the nearest code of the table ``T`` (values in [-1, 1]) after scaling by
``A_b`` errs by at most half the widest gap of ``T``, ``g = max diff(sort(T)) / 2``
(NF4: 0.152, FP4: 0.167), times ``A_b``. The stored absmax ``S_b`` may differ from ``A_b``:
plain, by its float32 rounding; double quantized, ``S_b - mean(A)`` goes through the
8-bit map in nested groups of ``nested_blocksize``, so by at most the widest gap of that
map times the group's ``max |A_b - mean(A)|`` (the search need not pick the nearest of
the two codes around a value, hence the full gap), plus float32 roundings. Since every
``|T| <= 1``, a wrong absmax moves a decoded value by at most ``|S_b - A_b|``:

    |w_i - decode_i| <= g A_b + D_b + 8 u32 A_b,   D_b = 0 (plain) or gap_map * max_group |A - mean(A)|

HQQ (affine, optimized zero point). HQQ's optimizer minimizes an l_p error with
``p < 1``, which tolerates large errors on a few elements, so no tight per-element bound
holds; but every decoded value of a group must stay within that group's input range
widened by the range itself: ``|w_i - decode_i| <= max_g w - min_g w`` (a scale or zero
that is inf, NaN, or off by a factor fails it). A gemlite conversion of an HQQ layer keeps
HQQ's groups and is held to the same bound.
"""

from __future__ import annotations

from typing import TypeAlias

import numpy as np
import torch
from pytest_qconform.reference import bnb4, gemlite4, hqq4
from pytest_qconform.reference.formats import code_table
from pytest_qconform.reference.packed import PackedBnb4, PackedGemlite4, PackedHqq4

Packed: TypeAlias = PackedBnb4 | PackedHqq4 | PackedGemlite4

__all__ = ["decode", "faithful_bound", "nonfinite_stored_fields"]

_U32 = 2.0**-24


def nonfinite_stored_fields(p: Packed) -> list[str]:
    """The names of the stored floating-point fields that hold NaN or inf."""
    if isinstance(p, PackedBnb4):
        fields = {
            "absmax": p.absmax,
            "nested_absmax": p.nested_absmax,
            "nested_code": p.nested_code,
            "offset": None if p.offset is None else np.asarray([p.offset]),
        }
    else:
        fields = {"scale": p.scale, "zero": p.zero}
    found = []
    for name, values in fields.items():
        if values is None:
            continue
        array = np.asarray(values)
        if array.dtype.kind == "f" and not np.isfinite(array.astype(np.float64)).all():
            found.append(f"{name} ({int((~np.isfinite(array.astype(np.float64))).sum())} of {array.size})")
    return found


def _widest_gap(table: np.ndarray | list[float]) -> float:
    values = np.sort(np.asarray(table, dtype=np.float64).reshape(-1))
    return float(np.diff(values).max())


def _bnb4_bound(p: PackedBnb4, weight: torch.Tensor) -> torch.Tensor:
    w = weight.detach().to(torch.float64).reshape(-1)
    numel, blocksize = w.numel(), p.blocksize
    nblocks = -(-numel // blocksize)
    padded = torch.zeros(nblocks * blocksize, dtype=torch.float64, device=w.device)
    padded[:numel] = w.abs()
    block_absmax = padded.reshape(nblocks, blocksize).amax(dim=1)
    absmax_error = torch.zeros_like(block_absmax)
    if p.double_quant and p.nested_blocksize:
        groups = -(-nblocks // p.nested_blocksize)
        spread = torch.zeros(groups * p.nested_blocksize, dtype=torch.float64, device=w.device)
        spread[:nblocks] = (block_absmax - block_absmax.mean()).abs()
        group_spread = spread.reshape(groups, p.nested_blocksize).amax(dim=1)
        gap = _widest_gap(p.nested_code) if p.nested_code is not None else 2.0
        absmax_error = (gap * group_spread).repeat_interleave(p.nested_blocksize)[:nblocks]
    half_gap = _widest_gap(code_table(p.quant_type)) / 2
    per_block = half_gap * block_absmax + absmax_error + 8 * _U32 * block_absmax
    return per_block.repeat_interleave(blocksize)[:numel].reshape(p.shape)


def _hqq4_bound(p: PackedHqq4 | PackedGemlite4, weight: torch.Tensor) -> torch.Tensor:
    """HQQ's group range; a gemlite conversion keeps HQQ's groups (axis 1)."""
    rows, cols = hqq4.grouped_shape(tuple(p.shape), p.group_size, p.axis)
    grouped = weight.detach().to(torch.float64).reshape(rows, cols)
    spread = grouped.amax(dim=p.axis, keepdim=True) - grouped.amin(dim=p.axis, keepdim=True)
    return spread.expand(rows, cols).reshape(tuple(p.shape))


def faithful_bound(p: Packed, weight: torch.Tensor) -> torch.Tensor:
    """Per element, how far ``decode(p)`` may be from ``weight`` (the quantizer's input), in
    float64 on the weight's device; derived from the input alone (module docstring)."""
    if tuple(weight.shape) != tuple(p.shape) and weight.numel() != int(np.prod(p.shape)):
        raise ValueError(
            f"faithful_bound: weight of shape {tuple(weight.shape)} for a stored state of shape {tuple(p.shape)}"
        )
    if isinstance(p, PackedBnb4):
        return _bnb4_bound(p, weight)
    return _hqq4_bound(p, weight)


def decode(p: Packed, device: torch.device | str) -> torch.Tensor:
    """The float64 decoding of ``p`` (any layout)."""
    if isinstance(p, PackedBnb4):
        return bnb4.decode(p, device=device)
    if isinstance(p, PackedGemlite4):
        return gemlite4.decode(p, device=device)
    return hqq4.decode(p, device=device)
