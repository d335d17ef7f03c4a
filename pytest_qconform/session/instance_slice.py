"""A reproducible slice of a run's instances: ``--qconform-slice=N/M`` runs part N of M.

The ``thorough`` profile is the nightly one: every triple of each check's axes and ten
times the draws, minutes on a GPU and more than a CPU job's time. A CPU job can still run
part of it every day (``1/10``), so that over days the whole of it is reached, and a GPU
runner can split it into calls that each fit a time limit (``1/3``, ``2/3``, ``3/3``): the
M parts hold every instance once, each the instances whose hash of the key and the test id
falls in it. The same key and the same tree give the same parts on every machine and every
pytest-xdist worker (a ``sha256``, not Python's salted ``hash``); the key defaults to the UTC
date, so the next day gives others. ``@KEY`` fixes the key (``--qconform-slice=1/10@2026-11-28``
replays that day's part, and runs split across midnight keep one key), and the summary
says how many instances ran of how many, and the key to replay them.

Until revision 11 ``N/M`` kept N of every M instances, so ``2/3`` held ``1/3`` as well (issue
53's H200 runs of 2026-11-28 and 2026-11-29 ran instances twice that way); parts that
partition the run are what splitting a run needs, and ``1/M`` means the same either way.
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
class Part:
    """Part ``number`` of ``of`` parts, chosen by ``key`` (empty: today's UTC date)."""

    number: int
    of: int
    key: str = ""

    def keyed(self) -> Part:
        return self if self.key else Part(self.number, self.of, datetime.datetime.now(datetime.UTC).date().isoformat())

    def __str__(self) -> str:
        return f"{self.number}/{self.of}" + (f"@{self.key}" if self.key else "")


def parse(text: str) -> Part:
    """An argparse ``type``: ``N/M`` or ``N/M@KEY`` with 0 < N <= M."""
    part, _, key = text.strip().partition("@")
    number, slash, of = part.partition("/")
    try:
        if not slash:
            raise ValueError
        value = Part(int(number), int(of), key.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected N/M or N/M@KEY (e.g. 1/10), got {text!r}") from None
    if not 0 < value.number <= value.of:
        raise argparse.ArgumentTypeError(f"expected 0 < N <= M in N/M, got {text!r}")
    return value


parse.__name__ = "value"  # argparse names the type in its message


@dataclass(frozen=True)
class InstanceSlice:
    """What the slice kept, for the summary line."""

    part: Part
    ran: int
    collected: int

    def line(self) -> str:
        return (
            f"qconform: slice {self.part.number}/{self.part.of} of key {self.part.key}: ran {self.ran} "
            f"of {self.collected} instances, {self.collected - self.ran} deselected "
            f"(the same slice again: --qconform-slice={self.part})"
        )


def kept(part: Part, nodeid: str) -> bool:
    """Whether the part holds the test ``nodeid``: its hash with the key, modulo ``of``, is
    ``number - 1``."""
    digest = hashlib.sha256(f"{part.key}\n{nodeid}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % part.of == part.number - 1


def select(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Keep the slice's instances of ``items`` (in place); the rest are deselected."""
    given = config.getoption("qconform_slice", None)
    if given is None:
        return
    part = given.keyed()
    chosen = [kept(part, item.nodeid) for item in items]
    keep = [item for item, chose in zip(items, chosen, strict=True) if chose]
    drop = [item for item, chose in zip(items, chosen, strict=True) if not chose]
    found = InstanceSlice(part, len(keep), len(items))
    config.stash[SLICE] = found
    workeroutput = getattr(config, "workeroutput", None)  # set on a pytest-xdist worker
    if workeroutput is not None:
        workeroutput[_WORKER_KEY] = {"part": str(part), "ran": found.ran, "collected": found.collected}
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def from_worker(config: pytest.Config, workeroutput: dict[str, Any]) -> None:
    """On the pytest-xdist controller: a worker's slice (every worker collects the same one)."""
    found = workeroutput.get(_WORKER_KEY)
    if found is not None and SLICE not in config.stash:
        config.stash[SLICE] = InstanceSlice(parse(found["part"]), found["ran"], found["collected"])
