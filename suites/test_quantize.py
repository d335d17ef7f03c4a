"""Quantize: the backend's codes and absmax against the reference quantizer's.

bitsandbytes-layout formats quantize each element to the nearest code after scaling by
its block's absmax. Elements that sit on a tie (within fp32 rounding of the midpoint of
two codes) may go either way and are excluded from the code comparison; everything else
must match exactly. The round trip ``|w - decode(quantize(w))|`` must stay within half
the code gap the element fell into, times its block's absmax.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given

from pytest_qconform.reference import bnb4, bounds
from pytest_qconform.strategies import weight_cases

from ._cases import SPECS, reference_decode, require_claim, shapes_for, spec_id

pytestmark = pytest.mark.qconform_operation("quantize")

BNB_SPECS = tuple(s for s in SPECS if s.format in ("nf4", "fp4"))
U32 = bounds.unit_roundoff(torch.float32)


def _half_gaps(table: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    """Half the width of the code interval each scaled value falls into."""
    codes = torch.sort(table).values
    gaps = torch.diff(codes)
    idx = torch.searchsorted(codes, scaled.clamp(codes[0], codes[-1]).contiguous()).clamp(1, len(codes) - 1)
    return gaps[idx - 1] / 2


def _tie_mask(table: torch.Tensor, scaled: torch.Tensor) -> torch.Tensor:
    codes = torch.sort(table).values
    midpoints = (codes[1:] + codes[:-1]) / 2
    dist = (scaled.unsqueeze(-1) - midpoints).abs().min(dim=-1).values
    return dist <= 8 * U32 * (1 + scaled.abs())


@pytest.mark.qconform_dtype("fp32")
@pytest.mark.parametrize("spec", BNB_SPECS, ids=spec_id)
def test_quantize_codes_and_absmax_match_reference(qtarget, qbackend, qdevice, qcheck, spec):
    require_claim(qbackend, qtarget, spec)

    @given(case=weight_cases(shapes_for(spec)))
    def check(case):
        qcheck.describe(**case.describe())
        weight = case.make(qdevice)
        packed = qbackend.export_packed(qbackend.quantize(weight, spec))
        ref_codes, ref_absmax = bnb4.quantize(weight.cpu(), spec.format, spec.blocksize)
        got_codes = bnb4.unpack_codes(packed.packed, case_numel := weight.numel())
        table = torch.tensor(bnb4.code_table(spec.format), dtype=torch.float64)
        flat = weight.detach().cpu().double().reshape(-1)
        block_absmax = ref_absmax.cpu().repeat_interleave(spec.blocksize)[:case_numel]
        scaled = torch.where(block_absmax > 0, flat / block_absmax.clamp_min(1e-300), torch.zeros_like(flat))
        comparable = ~_tie_mask(table, scaled)
        # Codes that decode to the same value (FP4's +0 and -0) are the same quantization.
        same_value = table[torch.as_tensor(np.asarray(got_codes, dtype=np.int64))] == \
            table[torch.as_tensor(np.asarray(ref_codes, dtype=np.int64))]
        mismatched = np.flatnonzero((~same_value & comparable).numpy())
        if mismatched.size:
            i = int(mismatched[0])
            qcheck.equal(int(got_codes[i]), int(ref_codes[i]),
                         f"quantize code of element {i} (w={flat[i].item()!r}, scaled={scaled[i].item()!r}; "
                         f"{mismatched.size} non-tie mismatches)")
        got_absmax = bnb4.decode_absmax(packed, device="cpu")
        if packed.double_quant:
            # absmax went through the 8-bit dynamic map: its code is one of the two codes
            # around the normalized value (bitsandbytes' search need not pick the nearest),
            # so the error is within the full gap of that interval.
            nested = torch.as_tensor(np.asarray(packed.nested_absmax), dtype=torch.float64)
            nested = nested.repeat_interleave(packed.nested_blocksize)[: len(ref_absmax)]
            nested_map = torch.as_tensor(np.asarray(packed.nested_code), dtype=torch.float64)
            normalized = (ref_absmax.cpu() - float(packed.offset)) / nested
            bound = nested * 2 * _half_gaps(nested_map, normalized) + 4 * U32 * ref_absmax.cpu().abs()
        else:
            bound = bounds.rounding_bound(ref_absmax.cpu(), torch.float32)
        qcheck.within(got_absmax, ref_absmax.cpu(), bound, "blockwise absmax")
        # Round trip: within half the code interval, times the stored absmax.
        decoded = reference_decode(packed, torch.device("cpu")).reshape(-1)
        stored_absmax = got_absmax.repeat_interleave(spec.blocksize)[:case_numel]
        trip_bound = (_half_gaps(table, scaled) * block_absmax + table.abs().max() * (stored_absmax - block_absmax).abs()
                      + 4 * U32 * flat.abs() + 1e-300)
        qcheck.within(decoded, flat, trip_bound, "round trip |w - decode(quantize(w))|")

    check()
