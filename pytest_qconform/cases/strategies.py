"""Hypothesis settings profiles (and, below, the input strategies the suites compose).

Profiles are registered here, centrally, and chosen by ``--qconform-profile``:
``ci`` keeps the default run short on a 2-core CPU runner, ``thorough`` is for nightly
runners. Both derandomize nothing: the seed is printed on failure for reproduction.
"""

from __future__ import annotations

from typing import Any

from hypothesis import HealthCheck, Phase, settings

PROFILE_SETTINGS: dict[str, dict[str, Any]] = {
    # ci: 3 random draws on top of each instance's listed example (the instances are a
    # covering array of the check's axes, so the draws add breadth, not coverage: they vary
    # seeds and magnitudes, never a value that selects a code path).
    "ci": dict(
        max_examples=3,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ],
        print_blob=True,
        derandomize=True,
        # No shrinking on CI: the derandomized first failure is already reproducible,
        # and shrinking a failing backend costs tens of seconds per cell.
        phases=(Phase.explicit, Phase.reuse, Phase.generate),
    ),
    "thorough": dict(
        max_examples=60,
        deadline=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.function_scoped_fixture,
            HealthCheck.differing_executors,
        ],
        print_blob=True,
    ),
}


def fewer_examples(divisor: int = 3) -> settings:
    """The loaded profile with ``1 / divisor`` of its examples (at least one): for checks
    whose every example costs a second or more on a 2-core CPU runner, or whose path axes
    multiply their instances (each instance then draws ``1 / divisor`` as often, so the
    check's draws stay about as many in all: ``ci`` 1 where it draws 3 elsewhere,
    ``thorough`` 20 of 60). Call it inside the test, after the profile is loaded."""
    loaded = settings()  # a copy of the loaded profile
    return settings(loaded, max_examples=max(1, loaded.max_examples // divisor))


def load_profile(name: str, database: str | None = None) -> None:
    """Register every profile under ``qconform-<name>`` and load the chosen one.

    ``database``: a folder for hypothesis' example database, or None for none. With one,
    every failing example is saved there and replayed first by every later run that
    finds the folder (CI keeps it between runs), so ``derandomize`` is turned off: a
    database and derandomization exclude each other in hypothesis, and with the failures
    replayed, draws that differ per run add coverage instead of repeating it.
    """
    if name not in PROFILE_SETTINGS:
        raise ValueError(f"unknown qconform profile {name!r}; choose one of {', '.join(PROFILE_SETTINGS)}")
    from hypothesis.database import DirectoryBasedExampleDatabase

    for profile, kwargs in PROFILE_SETTINGS.items():
        if database is not None:
            kwargs = {**kwargs, "derandomize": False, "database": DirectoryBasedExampleDatabase(database)}
        else:
            kwargs = {**kwargs, "database": None}
        settings.register_profile(f"qconform-{profile}", **kwargs)
    settings.load_profile(f"qconform-{name}")


# ---------------------------------------------------------------------------
# Input strategies
# ---------------------------------------------------------------------------
import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

# The weight shapes and value distributions are axes (``axes.WEIGHT_SHAPES``, ``axes.DISTRIBUTIONS``):
# kernels specialize on them. Defined there: a pytest-xdist controller, which draws nothing,
# imports the axes but not hypothesis.
from pytest_qconform.cases.axes import DISTRIBUTIONS, WEIGHT_SHAPES  # noqa: E402

SEEDS = st.integers(0, 2**31 - 1)
FP16_MAX = 65504.0


@dataclass(frozen=True)
class WeightCase:
    """A reproducible weight: shape, value distribution and seed (printed on failure)."""

    shape: tuple[int, ...]
    distribution: str
    seed: int

    def make(self, device: torch.device | str = "cpu") -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed)
        numel = 1
        for n in self.shape:
            numel *= n
        w = torch.randn(numel, generator=gen, dtype=torch.float64)
        half = numel // 2
        if self.distribution == "heavy_tailed":  # Student-t with 2 degrees of freedom
            chi2 = torch.randn(2, numel, generator=gen, dtype=torch.float64).pow(2).sum(0) / 2
            w = w / chi2.sqrt().clamp_min(1e-3)
        elif self.distribution == "outliers":  # 1% of weights 100x larger
            mask = torch.rand(numel, generator=gen, dtype=torch.float64) < 0.01
            w = torch.where(mask, w * 100, w)
        elif self.distribution == "zero_blocks":  # the first half is whole all-zero blocks
            w[:half] = 0
        elif self.distribution == "constant_blocks":
            w[:half] = 0.375
        elif self.distribution == "subnormal_small":  # fp16 subnormals are below 6.1e-5
            w = w * 1e-6
        elif self.distribution == "near_fp16_max":
            w = w / w.abs().max().clamp_min(1e-30) * (FP16_MAX * 0.9)
        return w.to(torch.float32).reshape(self.shape).to(device)

    def describe(self) -> dict[str, object]:
        return {"shape": self.shape, "distribution": self.distribution, "seed": self.seed}


def weight_cases(
    shapes: tuple[tuple[int, ...], ...] = WEIGHT_SHAPES, distributions: tuple[str, ...] = DISTRIBUTIONS
) -> st.SearchStrategy[WeightCase]:
    """Weights of drawn seeds, each of one of ``shapes`` and ``distributions``. A check whose
    paths depend on the shape or distribution passes one of each, its axes' values."""
    return st.builds(WeightCase, st.sampled_from(shapes), st.sampled_from(distributions), SEEDS)


@dataclass(frozen=True)
class ActivationCase:
    """Activation layout for matmul: leading dims, and how the tensor is laid out in memory."""

    leading: tuple[int, ...]  # (1,) gemv; (16,) small batch; (2, 5) batch x sequence
    layout: str  # "contiguous" | "transposed" | "sliced" | "offset" (axes.X_LAYOUTS)
    seed: int

    def make(self, k: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        """The activation in ``dtype`` on ``device``, laid out as ``layout`` there: the view is
        taken after the conversion, which would otherwise copy it into a fresh contiguous
        tensor (a sliced or offset view would then reach a backend as such only in fp32 on
        the CPU)."""
        gen = torch.Generator().manual_seed(self.seed)
        shape = (*self.leading, k)
        numel = 1
        for n in shape:
            numel *= n

        def placed(values: torch.Tensor) -> torch.Tensor:
            return values.to(dtype=dtype, device=device)

        if self.layout == "transposed":  # a non-contiguous view with the same values layout-agnostic
            return placed(torch.randn(*reversed(shape), generator=gen)).permute(*reversed(range(len(shape))))
        if self.layout == "sliced":  # every other column of a wider tensor
            return placed(torch.randn(*self.leading, 2 * k, generator=gen))[..., ::2]
        if self.layout == "offset":  # contiguous, but one element into its storage: vector loads misalign
            return placed(torch.randn(numel + 1, generator=gen))[1:].reshape(shape)
        return placed(torch.randn(*shape, generator=gen))

    def describe(self) -> dict[str, object]:
        return {"x_leading": self.leading, "x_layout": self.layout, "x_seed": self.seed}


def activation_leading(rows: int, rank: int) -> tuple[int, ...]:
    """The leading dims of an activation of ``rows`` rows (an ``x_rank`` axis value): ``(rows,)``
    as a matrix; as batch x sequence, the most nearly square split with the batch the
    smaller: 1 x 1 for a decode step, 1 x 17 for a prime count, 15 x 20 for 300 rows."""
    if rank == 2:
        return (rows,)
    if rank != 3:
        raise ValueError(f"activations of rank 2 or 3 are checked, not {rank}")
    batch = max(d for d in range(1, math.isqrt(rows) + 1) if rows % d == 0)
    return (batch, rows // batch)


def activation_cases(leading: tuple[int, ...], layout: str) -> st.SearchStrategy[ActivationCase]:
    """Activations of the instance's leading dims and layout (its axes' values: rows, rank,
    ``x_layout``), of drawn values (the seed)."""
    return st.builds(ActivationCase, st.just(tuple(leading)), st.just(layout), SEEDS)


def listed_weight(shape: tuple[int, ...], distribution: str) -> WeightCase:
    """The weight of an instance's shape and distribution (its axes' values) that it runs
    before hypothesis' random draws of other seeds: fixed, so that a failure of the listed
    case reproduces without hypothesis."""
    index = DISTRIBUTIONS.index(distribution)
    return WeightCase(tuple(shape), distribution, seed=1009 + index)


def with_examples(examples: list[dict]):
    """Decorate a ``@given`` function with an ``@example`` for each keyword dict, in order."""
    from hypothesis import example

    def decorate(test):
        for kwargs in reversed(examples):
            test = example(**kwargs)(test)
        return test

    return decorate
