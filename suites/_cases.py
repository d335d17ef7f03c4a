"""What the suites are parametrized over, and the claim checks shared by every suite.

Suites test every claim a backend makes and nothing else: a combination a backend does
not claim is skipped with a ``not claimed:`` reason, which the report leaves out of the
matrix. Tolerances never appear here: they come from ``pytest_qconform.reference.bounds``.
"""

from __future__ import annotations

from typing import TypeAlias

import torch
from pytest_qconform.reference import bnb4, faithful, gemlite4, hqq4
from pytest_qconform.reference.bounds import weight_error  # noqa: F401  (the suites' kernel weight error)
from pytest_qconform.reference.packed import PackedBnb4, PackedGemlite4, PackedHqq4

from pytest_qconform.backends.base import Backend, Capabilities, QuantSpec
from pytest_qconform.cases.axes import (
    ROWS_LADDER,
    spec_id,  # noqa: F401  (the suites' instance ids)
)
from pytest_qconform.cases.claims import target_device, unclaimed
from pytest_qconform.hardware.targets import Target
from pytest_qconform.session.outcomes import skip_not_claimed
from pytest_qconform.vocabulary import DtypeLabel

Packed: TypeAlias = PackedBnb4 | PackedHqq4 | PackedGemlite4  # every layout export_packed returns
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)

# The weight every route a backend declares by rows takes (test_matmul_every_route, and the
# multi-device checks of a matmul): fused small-batch kernels take over where the weight's
# rows are long, and the Triton rows kernel needs K a multiple of 256, which the
# weight_shape axis (K <= 256) never reaches. N is not a multiple of 4: a partial last group
# of rows. On a GPU, K = 1024 also makes the tensor-core kernel split K over programs and add
# their sums in a second kernel (a weight this narrow leaves the GPU idle otherwise); the
# interpreter runs one program, so the CPU keeps K = 256 (its run time grows with K).
SMALL_BATCH_SHAPES = {"cuda": (10, 1024), "cpu": (10, 256)}

# The rows ladder's weight (``axes.ROWS_LADDER``: 2^k - 1, 2^k, 2^k + 1 up to 65537 rows):
# the route check's CPU weight, on every device. K = 256 is a multiple of the Triton rows
# kernel's 256 and of every block and group up to it, so every route a backend has takes it;
# narrow, so that 65537 rows stay cheap (an x of 16.8 M elements).
LADDER_SHAPE = (10, 256)
# The ladder runs as two checks. Its rungs up to 2^12 + 1 are in every default run. Those above
# are on a CPU the larger part of the ladder's time (the float64 reference and bound of x, 0.1-0.6
# s an instance at 8191-65537 rows: 38 of the forward ladder's 47 s of test time on the 2-core
# machine for three backends), so they are ``large`` (``qconform_large_on(*SIZES_LARGE_ON)``:
# opt-in, -m large or --qconform-large).
LADDER_SPLIT = 2**12 + 1
# The target kinds on which the sizes' checks beyond the default run's budget (the ladder's top,
# K = 14336, N = 151936's dequantize and gradients) are ``large``: every kind. In the H200's
# default run they were ~90 s of its ~1070 s of test time over 15 workers, whose wall time was
# then 125 s against its 90 s budget (2026-11-28); the ``large`` run's time is in
# docs/run-times.md (docs/running.md, "Sizes real runs reach").
SIZES_LARGE_ON: tuple[str, ...] = ("cpu", "cuda", "rocm")
LADDER_LOW: tuple[int, ...] = tuple(r for r in ROWS_LADDER if r <= LADDER_SPLIT)
LADDER_TOP: tuple[int, ...] = tuple(r for r in ROWS_LADDER if r > LADDER_SPLIT)
# The widths real calls reach, each on a weight narrow in the other dimension: an MLP's down
# projection of a 7-8B model (Mistral 7B, Llama 3 8B: K = 14336) at N = 10, and Qwen2's
# vocabulary (N = 151936, past 2^17) at the lm_head check's K = 64 (9.7 M elements).
LONG_K_SHAPE = (10, 14336)
WIDE_N_SHAPE = (151936, 64)
# A QLoRA batch of 8 x 8192 tokens through that down projection in one call: 65536 rows at
# K = 14336, where a grid's row dimension and the K loop meet (each was reached alone). Its
# activation is 7.5 GB in float64, so the check is a GPU's: ``large`` there, and not claimed
# on a CPU (``prefill_at_long_k_rows``).
PREFILL_ROWS = 65536
# Rows judged at once of such a call: its float64 reference and bound a slice at a time (a
# 4096-row slice of x is 0.47 GiB in float64), so that instances on several workers fit one
# GPU (the whole call judged at once took 50 GiB, and four workers' ran out of an H200's memory).
PREFILL_JUDGED_ROWS = 4096


def prefill_at_long_k_rows(device: torch.device) -> int:
    """``PREFILL_ROWS`` on a GPU; on a CPU the check is not claimed (skipped with the reason)."""
    if device.type == "cpu":
        skip_not_claimed(
            f"{PREFILL_ROWS} rows at K = {LONG_K_SHAPE[1]} are checked on a GPU (the float64 activation alone is "
            f"{PREFILL_ROWS * LONG_K_SHAPE[1] * 8 / 2**30:.1f} GiB)"
        )
    return PREFILL_ROWS


def row_slices(rows: int, judged_rows: int | None) -> list[tuple[int, int, str]]:
    """``(first, stop, where)`` of a call's ``rows`` judged ``judged_rows`` at a time (its
    float64 reference and bound a slice each); one slice, ``where`` empty, when
    ``judged_rows`` is None or covers them."""
    if judged_rows is None or judged_rows >= rows:
        return [(0, rows, "")]
    return [
        (first, min(first + judged_rows, rows), f", rows {first}..{min(first + judged_rows, rows) - 1} of {rows}")
        for first in range(0, rows, judged_rows)
    ]


def claimed_real_sizes(caps: Capabilities, spec: QuantSpec) -> tuple[tuple[int, int], ...]:
    """``LONG_K_SHAPE`` and ``WIDE_N_SHAPE`` where the backend claims them: no wider than its
    ``max_out_features`` (an interpreted backend's), K a multiple of HQQ's group."""
    return tuple(
        (n, k)
        for n, k in (LONG_K_SHAPE, WIDE_N_SHAPE)
        if (caps.max_out_features is None or n <= caps.max_out_features)
        and (spec.format != "hqq4" or k % spec.blocksize == 0)
    )


def dtype_id(dtype: torch.dtype) -> str:
    """The dtype's label in node ids and failure messages (the report's vocabulary)."""
    return DtypeLabel.of(dtype).value


def require_claim(
    backend: Backend,
    target: Target,
    spec: QuantSpec | None = None,
    dtype: torch.dtype | None = None,
    *,
    backward: bool = False,
    serialize: bool = False,
    out: str | None = None,
    explicit_absmax: bool = False,
    orientation: str | None = None,
    compiled: str | None = None,
    captured: str | None = None,
    dequantize: bool = False,
) -> Capabilities:
    """The backend's capabilities on the target, or a ``not claimed`` skip."""
    caps = backend.capabilities(target_device(target))
    problems = unclaimed(
        caps,
        target,
        spec,
        dtype,
        backward=backward,
        serialize=serialize,
        out=out,
        explicit_absmax=explicit_absmax,
        orientation=orientation,
        compiled=compiled,
        captured=captured,
        dequantize=dequantize,
    )
    if problems:
        skip_not_claimed(f"{backend.name} does not claim {', '.join(problems)}")
    return caps


def reference_decode(packed: Packed, device: torch.device) -> torch.Tensor:
    """The float64 decoding of a backend's own bytes."""
    return faithful.decode(packed, device)


def block_ids(packed: Packed) -> torch.Tensor:
    """The independent units of a dequantized weight's rounding (``Checker.within``), per
    element, shape ``packed.shape``: blocks that decode to the same absmax (HQQ: groups
    with the same scale and zero) share their rounding errors, so each distinct scale is
    one unit."""
    if isinstance(packed, PackedGemlite4):
        _, zero, scale = gemlite4.decode_parts(packed)
        _, unit = torch.unique(torch.stack([zero.reshape(-1), scale.reshape(-1)], dim=1), dim=0, return_inverse=True)
        return unit.reshape(tuple(packed.shape))
    if isinstance(packed, PackedBnb4):
        per_block = bnb4.decode_absmax(packed).unsqueeze(1)
        element_block = torch.arange(packed.numel) // packed.blocksize
    else:
        _, zero, scale = hqq4.decode_parts(packed)
        rows, cols = hqq4.grouped_shape(tuple(packed.shape), packed.group_size, packed.axis)
        flat = torch.arange(rows * cols)
        element_block = flat // cols if packed.axis == 1 else flat % cols
        first = torch.zeros(int(element_block.max()) + 1, dtype=torch.long).scatter_(0, element_block, flat)
        per_block = torch.stack([zero.reshape(-1)[first], scale.reshape(-1)[first]], dim=1)
    _, unit = torch.unique(per_block, dim=0, return_inverse=True)
    return unit[element_block].reshape(tuple(packed.shape))


def dequantize_rounding_units(packed: Packed, dtype: torch.dtype) -> torch.Tensor | None:
    """The rounding-direction vote's units for a dequantize into ``dtype``: ``block_ids``, or
    None where no partition of the elements gives independent votes. A double-quantized
    absmax decoded in fp32 carries two fp32 roundings that its whole block shares, as large
    as the fp32 output's own rounding: a block's errors then follow its absmax's rounding and,
    code by code, the product's (FP4's 1/3-family codes round their fp32 products toward zero
    most of the time in correct arithmetic). Bit-identical to ``fp32(code * fp32 absmax)``,
    triton-nf4's fp4-b128-dq into fp32 voted 82% of 77 blocks toward zero (a normal weight,
    seed 11087; on an H200 and in the CPU's interpreter, issue 53), and bitsandbytes' own
    fp4-b1024-dq 86% of 220 decoded values away from zero. The bound still holds every
    element; into bf16 or fp16 the output's rounding, 2^16 and 2^13 times larger, decides
    each element's direction, and the blocks vote (tests/test_suite_helpers.py)."""
    if isinstance(packed, PackedBnb4) and packed.double_quant and dtype == torch.float32:
        return None
    return block_ids(packed)


def distinct_scales(packed: Packed) -> int:
    """How many distinct scales the weight decodes with (``block_ids``' units): each is
    rounded once where the backend decodes it, and every block sharing it shares that
    rounding. bitsandbytes' absmax is counted without expanding it to every element."""
    if isinstance(packed, PackedBnb4):
        return int(torch.unique(bnb4.decode_absmax(packed)).numel())
    return int(block_ids(packed).max().item()) + 1


def has_distinct_at_least(values: torch.Tensor, count: int) -> bool:
    """Whether ``values`` hold at least ``count`` distinct values. A prefix's distinct
    values are the whole's too, so the first ``16 * count`` and ``64 * count`` values are
    counted first, and the whole only where they fall short. Why: ``torch.unique`` sorts,
    and sorting an lm_head-width weight (151936 x 64, float64) whole took 1.3-2 s of a check
    (a cProfile of bitsandbytes' and HQQ's suites: 12.6 of their 187 s); its first
    16 x 151936 values hold far more than 151936 distinct magnitudes."""
    flat = values.reshape(-1)
    for length in (16 * count, 64 * count):
        if length >= flat.numel():
            break
        if torch.unique(flat[:length]).numel() >= count:
            return True
    return torch.unique(flat).numel() >= count


def weight_row_units(w: torch.Tensor) -> torch.Tensor:
    """Each output column's rounding unit for a matmul ``x W^T``: its weight row, where columns
    whose decoded weight rows are equal share one. Their dot products are one computation
    on the same inputs, which errs the same way in each, so they are one vote, not many. An
    HQQ ax0 weight whose first half is zero (``zero_blocks``) decodes its first 32 of 64 rows
    to the same row (each group spans both halves, and its zero decodes to the group's
    offset): 33 units, not 64 (an H200's fp32 gemv voted 81% of 64 columns toward zero,
    2026-11-29; tests/test_suite_helpers.py)."""
    return torch.unique(w.detach().cpu(), dim=0, return_inverse=True)[1]


def packed_dequantize_bound(packed: Packed, exact: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per-element bound for a dequantized value (derivations in reference.bounds).

    bitsandbytes-layout: ``code * absmax`` in fp32, the absmax itself decoded from its
    double quantization when present, then rounded to the output dtype. HQQ:
    ``(W_q - zero) * scale`` in the layer's compute dtype (2 operations), then rounded;
    gemlite's conversion of it: the same, or one fma (``reference.gemlite4``).
    """
    from pytest_qconform.reference import bounds

    if isinstance(packed, PackedBnb4):
        return bounds.bnb4_dequantize_bound(packed, dtype, device=exact.device)
    if isinstance(packed, PackedGemlite4):
        return bounds.gemlite4_dequantize_bound(packed, dtype, device=exact.device)
    return bounds.hqq4_dequantize_bound(packed, dtype, device=exact.device)
