"""What a guest plugin may ask of a ``--qconform`` session (public API).

A backend's own pytest plugin (ours: qconform-triton-nf4's warm-up) runs beside the core's
and needs a few facts of the session: the probed machine, whether its backend is under test
and can run here, and how to start a background process that yields the CPU to the tests.
It asks here, never the session's stash (``state``, internal), so that the session can keep
its state as it likes.
"""

from __future__ import annotations

import pytest

from pytest_qconform.hardware.probe import Probe
from pytest_qconform.session import state
from pytest_qconform.session.background import yield_the_cpu

__all__ = ["backend_available", "machine", "yield_the_cpu"]


def machine(config: pytest.Config) -> Probe:
    """The machine the session probed (from ``pytest_configure`` on, after the core's; its
    backends may not be checked yet: a pytest-xdist controller checks them once its workers run)."""
    return state.hardware(config)


def backend_available(config: pytest.Config, name: str) -> bool:
    """Whether backend ``name`` is under test in this session and can run here (builds that
    backend only)."""
    return state.available(config, name)
