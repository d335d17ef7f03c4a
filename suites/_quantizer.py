"""Quantizer checks shared by the quantize and weight-layout suites.

bitsandbytes-layout formats quantize each element to the nearest code after scaling by
its block's absmax: codes and absmax are compared with the reference quantizer's
(elements within fp32 rounding of a midpoint may go either way and are excluded), and
the round trip ``|w - decode(quantize(w))|`` must stay within half the code gap the
element fell into, times its block's absmax. HQQ optimizes its zero point, so there is
no reference for its scale and zero; given the stored ones, every code must be the
nearest level.
"""

from __future__ import annotations

import numpy as np
import torch
from pytest_qconform.reference import bnb4, bounds, gemlite4, hqq4
from pytest_qconform.reference.packed import PackedGemlite4

from pytest_qconform.backends.base import QuantSpec

from ._cases import reference_decode

U32 = bounds.unit_roundoff(torch.float32)


def _tie_band(scaled: torch.Tensor) -> torch.Tensor:
    """How near a midpoint between two codes a scaled value may be and still take either:
    fp32 rounding of the scaling and of the quantizer's thresholds (bitsandbytes' CUDA FP4
    quantizer compares with the literal ``0.00260417f``, 1.2e-6 relative above the midpoint
    between its codes 0 and 0.0052083, and ``0.583333f``, 5.8e-7 below another)."""
    return 8 * U32 * (1 + scaled.abs())


def _tie_mask(table: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    codes = torch.sort(table).values
    midpoints = (codes[1:] + codes[:-1]) / 2
    dist = (scaled.unsqueeze(-1) - midpoints).abs().min(dim=-1).values
    return dist <= _tie_band(scaled)


def round_trip_bound(
    table: torch.Tensor,
    flat: torch.Tensor,
    scaled: torch.Tensor,
    block_absmax: torch.Tensor,
    stored_absmax: torch.Tensor,
) -> torch.Tensor:
    """``|w - decode(quantize(w))|`` at most: half the code interval the scaled value fell
    into, widened by the tie band the code check allows (a value that near a midpoint may
    take the code on its far side), times its block's absmax; the stored absmax' own error
    times the largest code; fp32 rounding of the decode. The tie band was missing here
    once: an H200's CUDA FP4 quantizer stored 0 for a weight 1.000001 x past the midpoint
    (its threshold literal, ``_tie_band``), which the code check called a tie and this bound
    refused by 1.0000x (thorough, 2026-11-29; tests/test_suite_helpers.py)."""
    return (
        (bnb4.half_gaps(table, scaled) + _tie_band(scaled)) * block_absmax
        + table.abs().max() * (stored_absmax - block_absmax).abs()
        + 4 * U32 * flat.abs()
        + 1e-300
    )


def check_codes_and_absmax(qbackend, qcheck, spec: QuantSpec, weight: torch.Tensor, quantized=None):
    """The backend's codes and absmax for ``weight`` against the reference quantizer's
    (ties excluded), and the round trip within half a code gap. ``quantized``: the
    backend's state for ``weight`` if already made. Returns the packed state."""
    packed = qbackend.export_packed(quantized or qbackend.quantize(weight, spec))
    ref_codes, ref_absmax = bnb4.quantize(weight.cpu(), spec.format, spec.blocksize)
    got_codes = bnb4.unpack_codes(packed.packed, case_numel := weight.numel())
    table = torch.tensor(bnb4.code_table(spec.format), dtype=torch.float64)
    flat = weight.detach().cpu().double().reshape(-1)
    block_absmax = ref_absmax.cpu().repeat_interleave(spec.blocksize)[:case_numel]
    scaled = torch.where(block_absmax > 0, flat / block_absmax.clamp_min(1e-300), torch.zeros_like(flat))
    comparable = ~_tie_mask(table, scaled)
    # Codes that decode to the same value (FP4's +0 and -0) are the same quantization.
    same_value = (
        table[torch.as_tensor(np.asarray(got_codes, dtype=np.int64))]
        == table[torch.as_tensor(np.asarray(ref_codes, dtype=np.int64))]
    )
    mismatched = np.flatnonzero((~same_value & comparable).numpy())
    if mismatched.size:
        i = int(mismatched[0])
        qcheck.equal(
            int(got_codes[i]),
            int(ref_codes[i]),
            f"quantize code of element {i} (w={flat[i].item()!r}, scaled={scaled[i].item()!r}; "
            f"{mismatched.size} non-tie mismatches)",
        )
    got_absmax = bnb4.decode_absmax(packed, device="cpu")
    if packed.double_quant:
        nested = torch.as_tensor(np.asarray(packed.nested_absmax), dtype=torch.float64)
        nested = nested.repeat_interleave(packed.nested_blocksize)[: len(ref_absmax)]
        nested_map = torch.as_tensor(np.asarray(packed.nested_code), dtype=torch.float64)
        normalized = (ref_absmax.cpu() - float(packed.offset)) / nested
        bound = bnb4.nested_absmax_bound(nested, nested_map, normalized, ref_absmax.cpu())
        # The worst block's normalized value and the nested code stored for it, in the message: a
        # known failure is scoped by that condition (the CPU quantizer's smallest codes, issue 53).
        worst = int(torch.argmax((got_absmax.double() - ref_absmax.cpu()).abs() / bound.clamp_min(1e-300)))
        scale = float(nested[worst]) or 1.0  # one block: its nested absmax is 0, and so its code
        stored = (float(got_absmax[worst]) - float(packed.offset)) / scale
        what = f"blockwise absmax (double-quantized; worst block {worst}: normalized {float(normalized[worst]):.4g} stored as nested code {stored:.4g})"
    else:
        bound = bounds.rounding_bound(ref_absmax.cpu(), torch.float32)
        what = "blockwise absmax"
    qcheck.within(got_absmax, ref_absmax.cpu(), bound, what)
    # Round trip: within half the code interval, times the stored absmax.
    decoded = reference_decode(packed, torch.device("cpu")).reshape(-1)
    stored_absmax = got_absmax.repeat_interleave(spec.blocksize)[:case_numel]
    trip_bound = round_trip_bound(table, flat, scaled, block_absmax, stored_absmax)
    qcheck.within(decoded, flat, trip_bound, "round trip |w - decode(quantize(w))|")
    return packed


def check_hqq_nearest_levels(
    qbackend, qcheck, spec: QuantSpec, weight: torch.Tensor, device: torch.device, quantized=None
):
    """HQQ's codes for ``weight`` against the nearest level of its own stored scale and
    zero, ``clamp(round(w / scale + zero), 0, 15)``, outside a band around the rounding
    ties as wide as the stored scale's and zero's rounding to the compute dtype (and to
    fp16, in which HQQ optimizes on a GPU) can move a level. Returns the packed state."""
    dtype = weight.dtype
    packed = qbackend.export_packed(quantized or qbackend.quantize(weight, spec))
    # a gemlite conversion: its stored zero in HQQ's convention (reference.gemlite4.hqq_parts)
    codes, zero, scale = gemlite4.hqq_parts(packed) if isinstance(packed, PackedGemlite4) else hqq4.decode_parts(packed)
    levels = weight.cpu().double() / scale + zero
    u = max(
        bounds.unit_roundoff(dtype), bounds.unit_roundoff(torch.float16 if device.type == "cuda" else torch.float32)
    )
    band = 4 * u * (levels.abs() + zero.abs()) + 2**-18
    nearest = levels.round().clamp(0, 15)
    tie = (levels - levels.floor() - 0.5).abs() <= band
    wrong = ((codes != nearest) & ~tie).nonzero()
    if wrong.numel():
        i = tuple(int(v) for v in wrong[0])
        qcheck.equal(
            int(codes[i]),
            int(nearest[i]),
            f"HQQ code of element {i} (w={weight[i].item()!r}, "
            f"level w/scale+zero={levels[i].item()!r}; {wrong.shape[0]} non-tie mismatches)",
        )
    qcheck.record_multiple(0.0)
    return packed


def check_source_quantization(qbackend, qcheck, spec: QuantSpec, weight: torch.Tensor, device: torch.device, quantized):
    """The backend's bytes for ``weight`` are its quantization (the truth from outside the
    bytes, which a decoding of the bytes alone cannot see): against the reference quantizer
    for bitsandbytes' layout, the nearest levels of the stored scale and zero for HQQ.
    Returns the packed state."""
    if spec.format == "hqq4":
        return check_hqq_nearest_levels(qbackend, qcheck, spec, weight, device, quantized=quantized)
    return check_codes_and_absmax(qbackend, qcheck, spec, weight, quantized=quantized)
