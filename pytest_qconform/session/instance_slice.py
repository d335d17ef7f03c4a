"""A reproducible slice of a run's instances: ``--qconform-slice=1/10`` keeps a tenth.

The ``thorough`` profile is the nightly one: every triple of each check's axes and ten
times the draws, minutes on a GPU and more than a CPU job's time. A CPU job can still run
part of it every day, so that over days the whole of it is reached: the slice keeps the
instances whose hash of the day and the test id falls in its fraction. The same day and
the same tree give the same slice on every machine and every pytest-xdist worker (a
``sha256``, not Python's salted ``hash``); the next day gives another. ``@KEY`` fixes the key
(``--qconform-slice=1/10@2026-11-28`` replays that day's slice), and the summary says how many
instances ran of how many, and the key to replay them.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
from dataclasses import dataclass
from typing import Any

import pytest

SLICE = pytest.StashKey["InstanceSlice"]()
_WORKER_KEY = "qconform_instance_slice"  # pytest-xdist: the workers collect, the controller prints


@dataclass(frozen=True)
class Fraction:
    """``kept`` of every ``of`` instances, chosen by ``key`` (empty: today's UTC date)."""

    kept: int
    of: int
    key: str = ""

    def keyed(self) -> Fraction:
        return (
            self if self.key else Fraction(self.kept, self.of, datetime.datetime.now(datetime.UTC).date().isoformat())
        )

    def __str__(self) -> str:
        return f"{self.kept}/{self.of}" + (f"@{self.key}" if self.key else "")


def parse(text: str) -> Fraction:
    """An argparse ``type``: ``N/M`` or ``N/M@KEY`` with 0 < N <= M."""
    fraction, _, key = text.strip().partition("@")
    kept, slash, of = fraction.partition("/")
    try:
        if not slash:
            raise ValueError
        value = Fraction(int(kept), int(of), key.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N/M or N/M@KEY (e.g. 1/10), got {text!r}") from None
    if not 0 < value.kept <= value.of:
        raise argparse.ArgumentTypeError(f"expected 0 < N <= M in N/M, got {text!r}")
    return value


parse.__name__ = "value"  # argparse names the type in its message


@dataclass(frozen=True)
class InstanceSlice:
    """What the slice kept, for the summary line."""

    fraction: Fraction
    ran: int
    collected: int

    def line(self) -> str:
        return (
            f"qconform: slice {self.fraction.kept}/{self.fraction.of} of key {self.fraction.key}: ran {self.ran} "
            f"of {self.collected} instances, {self.collected - self.ran} deselected "
            f"(the same slice again: --qconform-slice={self.fraction})"
        )


def kept(fraction: Fraction, nodeid: str) -> bool:
    """Whether the slice keeps the test ``nodeid``: its hash with the key, modulo ``of``."""
    digest = hashlib.sha256(f"{fraction.key}\n{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % fraction.of < fraction.kept


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the slice's instances of ``items`` (in place); the rest are deselected."""
    given = config.getoption("qconform_slice", None)
    if given is None:
        return
    fraction = given.keyed()
    chosen = [kept(fraction, item.nodeid) for item in items]
    keep = [item for item, chose in zip(items, chosen, strict=True) if chose]
    drop = [item for item, chose in zip(items, chosen, strict=True) if not chose]
    found = InstanceSlice(fraction, len(keep), len(items))
    config.stash[SLICE] = found
    workeroutput = getattr(config, "workeroutput", None)  # set on a pytest-xdist worker
    if workeroutput is not None:
        workeroutput[_WORKER_KEY] = {"fraction": str(fraction), "ran": found.ran, "collected": found.collected}
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def from_worker(config: pytest.Config, workeroutput: dict[str, Any]) -> None:
    """On the pytest-xdist controller: a worker's slice (every worker collects the same one)."""
    found = workeroutput.get(_WORKER_KEY)
    if found is not None and SLICE not in config.stash:
        config.stash[SLICE] = InstanceSlice(parse(found["fraction"]), found["ran"], found["collected"])
