"""Known-failure entries that marked no collected test in this run (``report/stale_entries.py``
says why that matters): said in the run's summary and kept in its report.

An entry is judged only where it could have matched: its backend is under test and loads,
its version range holds that version, its arch and CPU capability are this run's, its profile
(if it names one: an entry for instances only ``thorough`` draws) is this run's, and its check
ran (some collected test of its backend has a matching operation: a run of one suite file
judges the entries of that file's checks only). An entry that covered a test marked by an
earlier entry is not stale. A run narrowed by ``-k``,
``--qconform-format``, ``--qconform-dtype`` or ``--qconform-slice`` judges none: it leaves out instances an
entry may be written for.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import pytest

from pytest_qconform.report.records import dump, load
from pytest_qconform.report.stale_entries import StaleEntry
from pytest_qconform.session import state


class Entry(Protocol):
    """What this module reads of a known failure (``known_failures.KnownFailure``, which imports
    this module to report its stale entries)."""

    @property
    def backend(self) -> str: ...

    @property
    def arch(self) -> str: ...

    @property
    def check(self) -> str: ...

    @property
    def reason(self) -> str: ...

    @property
    def cpu_capability(self) -> str: ...

    @property
    def profile(self) -> str: ...

    @property
    def source(self) -> str: ...

    def covers_version(self, version: str | None) -> bool: ...

    def covers_check(self, operation: str) -> bool: ...


STALE = pytest.StashKey[tuple[StaleEntry, ...]]()
_WORKER_KEY = "qconform_stale_known_failures"  # pytest-xdist: the workers collect, the controller reports


def _narrowed(config: pytest.Config) -> bool:
    return bool(
        config.getoption("keyword", "")
        or config.getoption("qconform_format", None)
        or config.getoption("qconform_dtype", None)
        or config.getoption("qconform_slice", None)
    )


def find(
    config: pytest.Config, entries: Sequence[Entry], matched: set[int], ran: set[tuple[str, str]]
) -> tuple[StaleEntry, ...]:
    """The entries (by index into ``entries``, ``matched`` those that marked a test) that could
    have matched here and did not. ``ran``: (backend, operation) of every collected test."""
    if _narrowed(config):
        return ()
    import fnmatch

    probe = state.probe(config)
    markers = {m for m in (probe.device_kind, probe.arch, probe.family) if m}
    profile = config.getoption("qconform_profile") or str(config.getini("qconform_profile")).strip().lower()
    stale = []
    for i, entry in enumerate(entries):
        status = probe.backend(entry.backend)
        if i in matched or status is None or not status.available or not state.under_test(config, entry.backend):
            continue
        if not entry.covers_version(status.version):
            continue
        if entry.arch != "*" and entry.arch not in markers:
            continue
        if entry.profile != "*" and entry.profile != profile:
            continue
        if entry.cpu_capability != "*" and not fnmatch.fnmatchcase(probe.cpu_capability or "", entry.cpu_capability):
            continue
        if not any(backend == entry.backend and entry.covers_check(operation) for backend, operation in ran):
            continue
        stale.append(StaleEntry(entry.source, entry.backend, entry.check, entry.reason))
    return tuple(stale)


def remember(config: pytest.Config, stale: tuple[StaleEntry, ...]) -> None:
    """Keep them for the summary and the report; a pytest-xdist worker hands them on."""
    config.stash[STALE] = stale
    workeroutput = getattr(config, "workeroutput", None)
    if workeroutput is not None:
        workeroutput[_WORKER_KEY] = [dump(entry) for entry in stale]


def from_worker(config: pytest.Config, workeroutput: dict[str, Any]) -> None:
    """On the controller, which collects nothing: every worker collected the same tests."""
    found = workeroutput.get(_WORKER_KEY)
    if found is not None and STALE not in config.stash:
        config.stash[STALE] = tuple(load(StaleEntry, entry, "stale_known_failures") for entry in found)


def summary_line(stale: tuple[StaleEntry, ...]) -> str:
    """``qconform: 2 known-failure entries marked no collected test (stale? ...): a, b``; empty when none."""
    if not stale:
        return ""
    return (
        f"qconform: {len(stale)} known-failure entr{'y' if len(stale) == 1 else 'ies'} for this run's backends "
        f"and device marked no collected test (stale or mistyped: remove or fix them): "
        + "; ".join(entry.line() for entry in stale)
    )
