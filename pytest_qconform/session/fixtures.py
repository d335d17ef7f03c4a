"""Fixtures the suites use; registered by the plugin only when ``--qconform`` is given."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from pytest_qconform.backends.base import Backend
from pytest_qconform.hardware.targets import Target
from pytest_qconform.reference.comparative import Comparison
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4
from pytest_qconform.session import outcomes, state
from pytest_qconform.vocabulary import Verdict


@pytest.fixture(scope="session")
def qconform_probe(request: pytest.FixtureRequest):
    """The run's probe (hardware, software, backend statuses)."""
    return state.probe(request.config)


@pytest.fixture
def qtarget(request: pytest.FixtureRequest) -> Target:
    """The device this test instance is for; skipped with the reason when it is absent."""
    target: Target = request.param
    if target.skip_reason:  # another device's instance makes no cell; absent hardware's is skipped
        outcomes.declare(request.node.user_properties, None if target.other_device else Verdict.SKIPPED)
        pytest.skip(target.skip_reason)
    return target


@pytest.fixture
def qdevice(qtarget: Target) -> torch.device:
    assert qtarget.torch_device is not None
    return torch.device(qtarget.torch_device)


@pytest.fixture
def qbackend(request: pytest.FixtureRequest) -> Backend:
    """The backend under test, built once per session; unavailable ones skip with the reason.
    Every quantization it makes is checked against its input (``input_checked``), except in
    a benchmark, whose timings must be the library's alone."""
    backend = state.backend(request.config, request.param)
    available = backend.availability()
    if not available.available:
        outcomes.declare(request.node.user_properties, Verdict.UNAVAILABLE)
        pytest.skip(f"{outcomes.UNAVAILABLE_PREFIX} {backend.name}: {available.reason}")
    if "qbench" in request.fixturenames:
        return backend
    from pytest_qconform.cases.input_checked import InputCheckedBackend

    return InputCheckedBackend(backend, request.getfixturevalue("qcheck"))  # type: ignore[return-value]


@pytest.fixture(scope="session")
def qprofile(request: pytest.FixtureRequest) -> str:
    """The run's hypothesis profile name ("ci" or "thorough"): suites size their fixed
    (non-hypothesis) cases by it, keeping the heavy ones for ``thorough``."""
    return request.config.getoption("qconform_profile") or request.config.getini("qconform_profile")


@pytest.fixture
def qbench(request: pytest.FixtureRequest, qtarget: Target):
    """The benchmark harness (``pytest_qconform.benchmark.harness.Harness``) for this case; skipped
    with the reason unless the run is ``--benchmark-only`` (and, on the CPU, unless
    ``--qconform-bench-shapes=small``), so a plain ``--qconform`` run times nothing."""
    from pytest_qconform.benchmark import harness as bench

    reason = bench.skip_reason(request.config, qtarget)
    if reason:
        pytest.skip(reason)
    return bench.Harness(request.config, request.node, qtarget)


class Checker:
    """Compares a backend's result to the reference and says, on failure, how to reproduce.

    Every comparison is judged by its error as a multiple of a bound derived from the
    arithmetic (``reference.bounds``); the worst multiple goes into the run report.
    """

    def __init__(self, item: pytest.Item) -> None:
        self._item = item
        self.context: dict[str, Any] = {}

    def describe(self, **context: Any) -> None:
        """Record what this case is (shape, seed, ...) for failure messages."""
        self.context.update(context)

    def _where(self) -> str:
        key = outcomes.case_key_of(self._item)
        parts = [key.describe() if key else "(no case key)"]
        parts += [f"{k}={v}" for k, v in sorted(self.context.items())]
        repro = dict(self._item.user_properties).get(outcomes.REPRO_PROPERTY, "")
        return " ".join(parts) + f"\n  reproduce: {repro}"

    def where(self) -> str:
        """The case's backend, format, dtype, target, described context and repro command."""
        return self._where()

    def record_multiple(self, multiple: float) -> None:
        self._item.user_properties.append((outcomes.MULTIPLE_PROPERTY, float(multiple)))

    def record_comparative(self, ratio: float) -> None:
        """A comparative ratio (``reference.comparative``) for the cell's worst, beside the multiple."""
        from pytest_qconform.report.cells import COMPARATIVE_PROPERTY

        self._item.user_properties.append((COMPARATIVE_PROPERTY, float(ratio)))

    def comparative(self, found: Comparison, what: str, *, dense_op: str = "F.linear") -> float | None:
        """Assert the backend's error is no more than ``COMPARATIVE_FACTOR`` times torch's own
        dense op's on the same decoded weights (``found``: ``reference.comparative``'s
        ``comparative_linear`` or ``comparative_ratio``), at the 90th percentile of errors
        relative to ``|x||W|^T + |b|``; record the ratio for the cell; return it (None: too
        few elements to compare, the worst-case bound alone judges). Call after ``within``:
        a result outside its bound fails with the bound's message first."""
        if found.ratio is None:
            return None
        self.record_comparative(found.ratio if found.ratio == found.ratio else float("inf"))
        if found.failed:
            raise AssertionError(
                f"{what}: within its worst-case bound, but {found.describe(dense_op)}: less accurate than the "
                "dense op on the same weights in the same dtypes (reduced-precision accumulation or products?); "
                + self._where()
            )
        return found.ratio

    def within(
        self,
        actual: torch.Tensor,
        expected: torch.Tensor,
        bound: torch.Tensor,
        what: str,
        *,
        rounding_units: torch.Tensor | None = None,
    ) -> float:
        """Assert |actual - expected| <= bound elementwise; return the worst multiple.

        Never both sides wrong: ``expected`` (float64, from the backend's stored state and
        finite inputs) holding NaN or inf means that state is not finite, a failure even
        where ``actual`` agrees. ``rounding_units``: ``actual`` is ``expected`` computed
        with round-to-nearest arithmetic, so its errors must not all point one way
        (``bounds.rounding_direction_biased``), judged by votes of independent units, an
        integer tensor naming each element's unit: its block or group for a dequantized
        weight (``suites._cases.dequantize_rounding_units``), its output column for a matmul."""
        from pytest_qconform.reference.bounds import rounding_direction_biased

        if tuple(actual.shape) != tuple(expected.shape):
            raise AssertionError(
                f"{what}: shape {tuple(actual.shape)} != reference {tuple(expected.shape)}; " + self._where()
            )
        nonfinite = ~torch.isfinite(expected)
        if bool(nonfinite.any()):
            self.record_multiple(float("inf"))
            flat = int(torch.nonzero(nonfinite.reshape(-1))[0].item())
            raise AssertionError(
                f"{what}: the float64 reference is {expected.reshape(-1)[flat].item()!r} at flat index {flat} "
                f"({int(nonfinite.sum().item())} non-finite elements) although every input is finite: the "
                "backend's stored state holds NaN or inf; " + self._where()
            )
        multiple = self._judge(actual, expected, bound, what)
        if rounding_units is not None:
            biased = rounding_direction_biased(actual, expected, rounding_units)
            if biased:
                raise AssertionError(
                    f"{what}: within its bound, but not rounded to nearest: {biased}; " + self._where()
                )
        return multiple

    def faithful(self, packed: PackedBnb4 | PackedHqq4, weight: torch.Tensor, what: str) -> None:
        """The stored state is finite and decodes within the format's quantization error of
        ``weight``, the input it was quantized from (``reference.faithful``): checked after
        every quantization a test makes, so no check trusts a state that is itself wrong."""
        from pytest_qconform.reference import faithful

        if not bool(torch.isfinite(weight).all()):
            return  # a non-finite input has no faithful quantization to check against
        nonfinite = faithful.nonfinite_stored_fields(packed)
        if nonfinite:
            self.record_multiple(float("inf"))
            raise AssertionError(
                f"{what}: the stored state holds NaN or inf in {', '.join(nonfinite)} for a "
                "finite input; " + self._where()
            )
        decoded = faithful.decode(packed, weight.device)
        # Judged, not recorded: a sanity bound, not the cell's worst multiple of an arithmetic bound.
        self._judge(
            decoded,
            weight.detach().double().reshape(decoded.shape),
            faithful.faithful_bound(packed, weight).reshape(decoded.shape),
            f"{what}: the stored state decoded against the input it was quantized from",
            record=False,
        )

    def _judge(
        self, actual: torch.Tensor, expected: torch.Tensor, bound: torch.Tensor, what: str, *, record: bool = True
    ) -> float:
        """The worst error as a multiple of ``bound`` (recorded for the cell unless told
        not to); an AssertionError naming the worst element when it exceeds 1."""
        from pytest_qconform.reference.bounds import error_multiple

        multiple = float(error_multiple(actual, expected, bound))
        if record:
            self.record_multiple(multiple if multiple == multiple else float("inf"))
        if not multiple <= 1.0:
            diff = (actual.double().to(expected.device) - expected).abs()
            diff = torch.where(torch.isnan(diff), torch.full_like(diff, float("inf")), diff)
            flat = int(torch.argmax(diff / bound.clamp_min(1e-300)).item()) if diff.numel() else 0
            raise AssertionError(
                f"{what}: error is {multiple:.3g} x its bound (worst element flat index {flat}: "
                f"got {actual.reshape(-1)[flat].item()!r}, reference {expected.reshape(-1)[flat].item()!r}, "
                f"bound {bound.reshape(-1)[flat].item():.3g}); " + self._where()
            )
        return multiple

    def equal(self, actual: Any, expected: Any, what: str) -> None:
        if actual != expected:
            raise AssertionError(f"{what}: got {actual!r}, expected {expected!r}; " + self._where())


@pytest.fixture
def qcheck(request: pytest.FixtureRequest) -> Checker:
    return Checker(request.node)


@pytest.fixture
def qwatch(request: pytest.FixtureRequest, qcheck: Checker):
    """``pytest_qconform.watch.watch`` bound to this test: ``with qwatch(model) as oracle:``
    judges every sampled call of the model's quantized layers (default: the layers of the
    run's backends under test that load here; or pass ``backends`` as ``watch`` takes them).
    The calls go into the run report (its ``calls`` section, under this test's operation)
    and their worst multiple into the cell; a failed call fails the test, with the
    backend, format, dtype and the command that reproduces it."""
    from contextlib import contextmanager

    from pytest_qconform.report.calls import CALLS_PROPERTY
    from pytest_qconform.watch import WatchFailure, watch
    from pytest_qconform.watch.oracle import FIRST_CALLS, CallOracle

    config = request.config

    def record(oracle: CallOracle) -> None:
        request.node.user_properties.append((CALLS_PROPERTY, oracle.summary()))
        if oracle.verdicts:
            qcheck.record_multiple(float(oracle.worst_multiple or 0.0))
        if oracle.worst_comparative is not None:
            qcheck.record_comparative(oracle.worst_comparative)

    @contextmanager
    def watching(model: torch.nn.Module, backends: Any = None, *, first_calls: int = FIRST_CALLS):
        if backends is None:
            backends = [
                state.backend(config, name)
                for name in sorted(config.stash[state.BACKEND_FACTORIES].keys())
                if state.available(config, name)
            ]
        try:
            with watch(model, backends, first_calls=first_calls, on_detach=record) as oracle:
                yield oracle
        except WatchFailure as exc:
            raise AssertionError(f"{exc}\n  {qcheck.where()}") from None

    return watching


class Partners:
    """Other registered backends, by name, for interop checks between backends, without the
    suites importing any backend. A partner need not be under test: a run of only your
    backend still reads bitsandbytes' bytes when bitsandbytes is installed, using it as a
    byte source (its own cells are not run; ``under_test`` says whether they are)."""

    def __init__(self, config: pytest.Config, item: pytest.Item) -> None:
        self._config = config
        self._item = item  # whose skip an unavailable partner under test declares

    def __call__(self, name: str) -> Backend:
        """Backend ``name``; skips when it is not registered or cannot load here (an ``unavailable``
        cell when it is under test, none when it would only have been the byte source)."""
        if name not in self._config.stash[state.REGISTERED_FACTORIES]:
            outcomes.skip_not_claimed(f"interop partner {name} is not registered in this run")
        other = state.backend(self._config, name)
        available = other.availability()
        if not available.available:
            if not self.under_test(name):  # no byte source in this environment: nothing to check, no cell
                outcomes.skip_not_claimed(
                    f"interop partner {name} cannot load here "
                    f"({available.reason}); install it to check this backend's reading of its bytes"
                )
            outcomes.declare(self._item.user_properties, Verdict.UNAVAILABLE)
            pytest.skip(f"{outcomes.UNAVAILABLE_PREFIX} interop partner {name}: {available.reason}")
        return other

    def under_test(self, name: str) -> bool:
        return state.under_test(self._config, name)


@pytest.fixture
def qbackend_named(request: pytest.FixtureRequest) -> Partners:
    """Another registered backend by name (``qbackend_named("bitsandbytes")``), under test or not."""
    return Partners(request.config, request.node)
