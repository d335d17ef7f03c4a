"""The oracle never trusts the stored state: the stored state against the input it was
quantized from, a non-finite reference, and errors that all point one way."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bnb4, bounds, faithful, hqq4
from pytest_qconform.reference.packed import PackedHqq4


def _weight(seed: int = 0, shape=(64, 128), scale: float = 1.0) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * scale


@pytest.mark.parametrize("fmt", ("nf4", "fp4"))
@pytest.mark.parametrize("blocksize", (64, 128, 1024))
def test_reference_quantization_is_faithful(fmt: str, blocksize: int) -> None:
    w = _weight()
    packed = bnb4.encode(w, fmt, blocksize)
    assert faithful.nonfinite_stored_fields(packed) == []
    error = (bnb4.decode(packed) - w.double()).abs()
    assert bool((error <= faithful.faithful_bound(packed, w)).all())


def test_an_absmax_off_by_half_is_not_faithful() -> None:
    w = _weight()
    packed = bnb4.encode(w, "nf4", 64)
    wrong = dataclasses.replace(packed, absmax=packed.absmax * np.float32(1.5))
    error = (bnb4.decode(wrong) - w.double()).abs()
    assert bool((error > faithful.faithful_bound(wrong, w)).any())


def test_an_inf_stored_field_is_named() -> None:
    w = _weight()
    packed = bnb4.encode(w, "nf4", 64)
    absmax = packed.absmax.copy()
    absmax[3] = np.inf
    assert faithful.nonfinite_stored_fields(dataclasses.replace(packed, absmax=absmax)) == ["absmax (1 of 128)"]


def test_hqq_state_decoding_outside_the_group_range_is_not_faithful() -> None:
    w = _weight(shape=(16, 64))
    rows, cols = hqq4.grouped_shape((16, 64), 64, 1)
    grouped = w.double().reshape(rows, cols)
    lo, hi = grouped.amin(dim=1, keepdim=True), grouped.amax(dim=1, keepdim=True)
    scale = ((hi - lo) / 15).numpy()
    zero = (-lo / torch.from_numpy(scale)).numpy()
    q = torch.clamp(torch.round(grouped / torch.from_numpy(scale) + torch.from_numpy(zero)), 0, 15).to(torch.uint8)
    packed_bytes = ((q[: rows // 2] << 4) | q[rows // 2 :]).numpy()
    good = PackedHqq4((16, 64), 64, 1, packed_bytes, scale.astype(np.float32), zero.astype(np.float32))
    assert bool(((hqq4.decode(good) - w.double()).abs() <= faithful.faithful_bound(good, w)).all())
    bad = dataclasses.replace(good, scale=good.scale * np.float32(3))
    assert bool(((hqq4.decode(bad) - w.double()).abs() > faithful.faithful_bound(bad, w)).any())


def _matmul_outputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    x = _weight(seed, (8, 256)).double()
    w = _weight(seed + 1, (96, 256)).double()
    return x @ w.T, torch.arange(96)


def test_round_to_nearest_is_not_biased() -> None:
    exact, columns = _matmul_outputs()
    assert bounds.rounding_direction_biased(exact.to(torch.bfloat16), exact, columns) is None


def test_truncation_toward_zero_is_biased() -> None:
    exact, columns = _matmul_outputs()
    truncated = (exact.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    message = bounds.rounding_direction_biased(truncated, exact, columns)
    assert message is not None and "toward zero" in message


def test_too_few_units_are_not_judged() -> None:
    exact, _ = _matmul_outputs()
    truncated = (exact.float().view(torch.int32) & -65536).view(torch.float32).to(torch.bfloat16)
    assert bounds.rounding_direction_biased(truncated, exact, torch.zeros(96, dtype=torch.long)) is None
