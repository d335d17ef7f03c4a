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
  ``code_j * absmax`` by ``|code_j| |S_b - A_b| <= |S_b - A_b|``. The caller who knows
  ``A_b`` passes it (``quantizer_absmax``); without it a double-quantized state is refused.

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

__all__ = ["grid_values", "nearest_distance", "requantize_bound"]

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


def _arithmetic_and_shift(
    p: PackedBnb4 | PackedHqq4, target: torch.Tensor, u: float, quantizer_absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    t = target.double().abs()
    if isinstance(p, PackedBnb4):
        stored = bnb4.decode_absmax(p, target.device)
        if p.double_quant and quantizer_absmax is None:
            raise ValueError(
                "requantize: a double-quantized absmax needs the fp32 absmax the quantizer rounded with "
                "(quantizer_absmax): it stored only its 8-bit code"
            )
        used = stored if quantizer_absmax is None else quantizer_absmax.to(stored.device, torch.float64).reshape(-1)
        per_element = lambda blocks: blocks.repeat_interleave(p.blocksize)[: p.numel].reshape(p.shape)  # noqa: E731
        return 2 * u * (t + per_element(used)), per_element((stored - used).abs())
    _, zero, scale = hqq4.decode_parts(p, target.device)
    u_c = max(unit_roundoff(_stored_dtype(p.meta.get(key, "float32"))) for key in ("zero_dtype", "scale_dtype"))
    span = (15 + zero.abs()) * scale.abs()
    return 2 * u * (t + span), 2 * (u + u_c) * (15 + 2 * zero.abs()) * scale.abs()


def requantize_bound(
    p: PackedBnb4 | PackedHqq4,
    target: torch.Tensor,
    target_error: torch.Tensor,
    quantizer_dtype: torch.dtype = torch.float32,
    quantizer_absmax: torch.Tensor | None = None,
) -> torch.Tensor:
    """Bound on ``|decode(p) - target|`` for ``p`` quantized from ``target`` (float64,
    ``p.shape``), known to within ``target_error`` as the quantizer saw it:
    ``d(t) + 2 (e + arithmetic) + 2 sigma`` (module docstring). ``quantizer_dtype``: the dtype
    the quantizer computes in (fp32; HQQ's optimizer on a GPU works in fp16), whose unit
    roundoff ``u`` its arithmetic and its rounding of the grid carry. ``quantizer_absmax``: for
    a double-quantized bitsandbytes-layout state, the per-block fp32 absmax the quantizer
    rounded with (required there: it is not stored)."""
    arithmetic, shift = _arithmetic_and_shift(p, target, unit_roundoff(quantizer_dtype), quantizer_absmax)
    return nearest_distance(p, target) + 2 * (target_error.double().abs() + arithmetic) + 2 * shift
