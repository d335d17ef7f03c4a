"""Typed session state in ``config.stash`` (no module globals: xdist workers and repeated
in-process runs each get their own)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from pytest_qconform.backends.base import Backend
from pytest_qconform.hardware.probe import Probe
from pytest_qconform.hardware.targets import Target
from pytest_qconform.session.outcomes import Case

PROBE = pytest.StashKey[Probe]()
TARGETS = pytest.StashKey[tuple[Target, ...]]()
BACKEND_FACTORIES = pytest.StashKey[dict[str, Callable[[], Backend]]]()  # the backends under test
# Every registered backend, selected or not: one not under test can still serve as an
# interop partner (bitsandbytes as the source of the bytes another backend must read).
REGISTERED_FACTORIES = pytest.StashKey[dict[str, Callable[[], Backend]]]()
BACKENDS = pytest.StashKey[dict[str, Backend]]()
CASES = pytest.StashKey[dict[str, Case]]()
REPORT_PATH = pytest.StashKey[str | None]()
# The backend check a pytest-xdist controller has not run yet (setup.start_session), else None.
PENDING_BACKEND_CHECK = pytest.StashKey[Callable[[], None] | None]()
# What the session did to this process' malloc (session.allocator); unset in a pytest-xdist controller.
ALLOCATOR = pytest.StashKey[str]()


def probe(config: pytest.Config) -> Probe:
    """The machine and the selected backends' availability (checked now if not yet)."""
    pending = config.stash.get(PENDING_BACKEND_CHECK, None)
    if pending is not None:
        pending()
    return config.stash[PROBE]


def hardware(config: pytest.Config) -> Probe:
    """The machine only: its backends may not be checked yet (``probe`` checks them)."""
    return config.stash[PROBE]


def available(config: pytest.Config, name: str) -> bool:
    """Whether backend ``name`` is under test and can run here; builds that backend only."""
    return under_test(config, name) and backend(config, name).availability().available


def backend(config: pytest.Config, name: str) -> Backend:
    """The session's one instance of backend ``name`` (built on first use), under test or
    only registered (an interop partner).

    A factory or ``availability()`` that raises (a conftest backend whose constructor
    fails, say) does not stop the session: the backend becomes unavailable, with the
    exception as the reason, and its tests skip while the others run.
    """
    built = config.stash.setdefault(BACKENDS, {})
    if name not in built:
        factories = config.stash[BACKEND_FACTORIES]
        built[name] = _build(name, factories[name] if name in factories else config.stash[REGISTERED_FACTORIES][name])
    return built[name]


def under_test(config: pytest.Config, name: str) -> bool:
    """Whether backend ``name`` is selected in this run (not only an interop partner)."""
    return name in config.stash[BACKEND_FACTORIES]


def _build(name: str, factory: Callable[[], Backend]) -> Backend:
    from pytest_qconform.backends.registry import UnavailableBackend

    try:
        made = factory()
        made.availability()
    except Exception as exc:
        lines = str(exc).strip().splitlines()
        return UnavailableBackend(
            name, f"could not be built: {type(exc).__name__}: {lines[0] if lines else '(no message)'}"
        )
    return made
