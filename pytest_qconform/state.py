"""Typed session state in ``config.stash`` (no module globals: xdist workers and repeated
in-process runs each get their own)."""
from __future__ import annotations

from typing import Callable

import pytest

from pytest_qconform.backends.base import Backend
from pytest_qconform.outcomes import Case
from pytest_qconform.probe import Probe
from pytest_qconform.targets import Target

PROBE = pytest.StashKey[Probe]()
TARGETS = pytest.StashKey["tuple[Target, ...]"]()
BACKEND_FACTORIES = pytest.StashKey["dict[str, Callable[[], Backend]]"]()
BACKENDS = pytest.StashKey["dict[str, Backend]"]()
CASES = pytest.StashKey["dict[str, Case]"]()
REPORT_PATH = pytest.StashKey["str | None"]()


def probe(config: pytest.Config) -> Probe:
    return config.stash[PROBE]


def backend(config: pytest.Config, name: str) -> Backend:
    """The session's one instance of backend ``name`` (built on first use)."""
    built = config.stash.setdefault(BACKENDS, {})
    if name not in built:
        built[name] = config.stash[BACKEND_FACTORIES][name]()
    return built[name]
