"""A weight quantized again from a float target (PEFT's LoRA merge: dequantize, add the
adapter's delta, quantize) against that target, in float64.

Round to nearest on a grid. Every element of a 4-bit weight can hold one of 16 values,
fixed by its block's or group's stored scales:

    bitsandbytes:  g_j = code_j * absmax_b                 (j = 0..15)
    HQQ:           g_k = (k - zero_g) * scale_g            (k = 0..15)

A quantizer that rounds a target ``t`` to the nearest grid value leaves the element at
distance ``d(t) = min_j |t - g_j|``. Two things blur that in practice, each bounded here:

- the target the quantizer saw, ``t~``, is not ``t``: ``|t~ - t| <= e`` (the caller's
  ``target_error``: how PEFT computed the sum) plus the quantizer's own fp32 arithmetic
  (bitsandbytes scales by ``1/absmax`` and compares with fp32 midpoints: ``2u(|t| +
  absmax)``; HQQ evaluates ``t * scale^-1 + zero``: ``2u(|t| + (|zero| + 15)|scale|)``);
- the grid it rounded on is not quite the stored one (``sigma`` per grid value): HQQ
  rounds with fp32 ``zero`` and ``scale^-1`` and stores both in the compute dtype
  (unit roundoff ``u_c``), moving each grid value by at most
  ``2 (u + u_c)(15 + 2|zero|)|scale|``; bitsandbytes stores the fp32 absmax it used
  (sigma = 0), except with double quantization, which rounds with the fp32 absmax ``A_b``
  and stores only its 8-bit code: the stored ``S_b`` moves each grid value
  ``code_j * absmax`` by ``|code_j| |S_b - A_b| <= |S_b - A_b|``. ``A_b`` is not stored,
  but the target says where it is: the block's ``max |t~|`` over what the quantizer saw,
  so within the block's largest ``e`` of its ``max |t|`` (``quantizer_block_maxima``; exact
  for a source weight, whose error is 0: the max of values of its dtype, each exact in
  fp32). The shift is then at most ``|S_b - max |t|| + max e`` over the block, and no more
  than a correct double quantization moves an absmax (one nested code gap: a stored absmax
  further from ``A_b`` is another tensor's, and its shift is not allowed).

Then the chosen value ``g`` satisfies ``|g - t~| <= d(t~) <= d(t) + e'`` with
``e' = e + arithmetic``, and the stored one is within ``sigma`` of it, so

    |decode - t| <= d(t) + 2 e' + 2 sigma

where ``d`` is measured on the stored grid. A requantization that keeps the old scales,
drops the delta, or rounds the wrong way exceeds it.
"""

from __future__ import annotations

import numpy as np
import pytest_qconform.reference.bnb4 as bnb4
import pytest_qconform.reference.hqq4 as hqq4
import torch
from pytest_qconform.reference.bounds import _stored_dtype, unit_roundoff
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4

__all__ = [
    "block_maxima",
    "grid_values",
    "nearest_distance",
    "nested_allowance",
    "quantizer_block_maxima",
    "requantize_bound",
]

U32 = unit_roundoff(torch.float32)


def grid_values(p: PackedBnb4 | PackedHqq4, device: str | torch.device | None = "cpu") -> torch.Tensor:
    """The 16 values each element can hold, float64, shape ``(*p.shape, 16)``."""
    dev = torch.device("cpu" if device is None else device)
    if isinstance(p, PackedBnb4):
        table = torch.as_tensor(np.asarray(p.code, dtype=np.float64).reshape(-1), device=dev)
        absmax = bnb4.decode_absmax(p, dev).repeat_interleave(p.blocksize)[: p.numel]
        return (absmax.unsqueeze(-1) * table).reshape(*p.shape, table.numel())
    _, zero, scale = hqq4.decode_parts(p, dev)
    levels = torch.arange(16, dtype=torch.float64, device=dev)
    return (levels - zero.unsqueeze(-1)) * scale.unsqueeze(-1)


def nearest_distance(p: PackedBnb4 | PackedHqq4, target: torch.Tensor) -> torch.Tensor:
    """``min_j |t - g_j|`` on ``p``'s stored grid, shape ``p.shape``."""
    grid = grid_values(p, target.device)
    return (target.double().unsqueeze(-1) - grid).abs().amin(dim=-1)


def block_maxima(p: PackedBnb4, values: torch.Tensor) -> torch.Tensor:
    """Each of ``p``'s blocks' maximum of ``values`` (non-negative, ``p.shape``), float64: of
    ``|w|``, the absmax a quantizer computes (exact: the max of values of ``w``'s dtype)."""
    flat = values.detach().double().reshape(-1)
    pad = (-flat.numel()) % p.blocksize
    return torch.nn.functional.pad(flat, (0, pad)).reshape(-1, p.blocksize).amax(dim=1)


def quantizer_block_maxima(
    p: PackedBnb4, target: torch.Tensor, target_error: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Where the fp32 block maxima ``A_b`` a double-quantized state's quantizer rounded with
    lie (module docstring): each block's ``max |t|`` and the most ``A_b`` may differ from it,
    the block's largest ``target_error``; float64, one value a block."""
    return block_maxima(p, target.abs()), block_maxima(p, target_error.abs().expand(target.shape))


def nested_allowance(p: PackedBnb4, used: torch.Tensor, slack: torch.Tensor) -> torch.Tensor:
    """How far a correct double-quantization may decode each absmax from the quantizer's
    ``A_b``, wherever ``A_b`` lies within ``slack`` of ``used``: one nested code gap around
    its normalized value, times its group's nested absmax (``bnb4.nested_absmax_bound``). A
    stored absmax further away is not this target's, so the shift it brings is not allowed."""
    dev = used.device
    n = used.numel()
    nested = torch.as_tensor(np.asarray(p.nested_absmax, np.float64), device=dev).reshape(-1)
    nested = nested.repeat_interleave(int(p.nested_blocksize))[:n]
    table = torch.as_tensor(np.asarray(p.nested_code, np.float64), device=dev).reshape(-1)
    inverse = torch.where(nested > 0, 1 / nested.clamp_min(1e-300), torch.zeros_like(nested))
    centered = used - float(p.offset)
    return torch.stack(
        [
            bnb4.nested_absmax_bound(nested, table, (centered + side * slack) * inverse, used + slack)
            for side in (-1, 0, 1)
        ]
    ).amax(dim=0)


def _arithmetic_and_shift(
    p: PackedBnb4 | PackedHqq4, target: torch.Tensor, target_error: torch.Tensor, u: float
) -> tuple[torch.Tensor, torch.Tensor]:
    t = target.double().abs()
    if isinstance(p, PackedBnb4):
        stored = bnb4.decode_absmax(p, target.device)
        used, slack = stored, torch.zeros_like(stored)
        shift = torch.zeros_like(stored)
        if p.double_quant:
            used, slack = quantizer_block_maxima(p, target, target_error)
            shift = torch.minimum((stored - used).abs() + slack, nested_allowance(p, used, slack))
        per_element = lambda blocks: blocks.repeat_interleave(p.blocksize)[: p.numel].reshape(p.shape)  # noqa: E731
        return 2 * u * (t + per_element(used + slack)), per_element(shift)
    _, zero, scale = hqq4.decode_parts(p, target.device)
    u_c = max(unit_roundoff(_stored_dtype(p.meta.get(key, "float32"))) for key in ("zero_dtype", "scale_dtype"))
    span = (15 + zero.abs()) * scale.abs()
    return 2 * u * (t + span), 2 * (u + u_c) * (15 + 2 * zero.abs()) * scale.abs()


def requantize_bound(
    p: PackedBnb4 | PackedHqq4,
    target: torch.Tensor,
    target_error: torch.Tensor,
    quantizer_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Bound on ``|decode(p) - target|`` for ``p`` quantized from ``target`` (float64,
    ``p.shape``), known to within ``target_error`` as the quantizer saw it:
    ``d(t) + 2 (e + arithmetic) + 2 sigma`` (module docstring). ``quantizer_dtype``: the dtype
    the quantizer computes in (fp32; HQQ's optimizer on a GPU works in fp16), whose unit
    roundoff ``u`` its arithmetic and its rounding of the grid carry. A double-quantized
    bitsandbytes-layout state's grid is the one its quantizer rounded on, the target's block
    maxima (``quantizer_block_maxima``), shifted to the stored absmax."""
    arithmetic, shift = _arithmetic_and_shift(p, target, target_error, unit_roundoff(quantizer_dtype))
    return nearest_distance(p, target) + 2 * (target_error.double().abs() + arithmetic) + 2 * shift
