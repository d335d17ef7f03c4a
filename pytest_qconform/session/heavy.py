"""Where the heavy checks go in the collection: at the heads of the pytest-xdist workers'
first shares, in turn.

Why: a ``qconform_heavy`` instance runs a model (a workload, 2-9 s) or compiles one (10-33 s
each on the H100 host).
pytest-xdist's ``worksteal`` (and ``load``) hands each worker a contiguous share of the
collection first (the i-th of n shares, ``len(pending) // workers_left`` items each) and
steals from the tail of a queue, so a test at the head of a share stays with that worker.
With every heavy instance at the front of the collection, all of them were in the first
worker's share: on the H100 one worker compiled the four compiled workloads one after
another (80 s, the end of the run) while the other seven had run out of work at 93-96 s
(docs/run-times.md, contract revision 6). So the k-th heavy instance leads share
``k mod n``; in one process they simply go first. The tails of the shares, which idle
workers steal from, are then quick checks: a worker keeps the test it runs and the next, so
workloads left at the end of the collection had ended the CPU's main job with one worker
running three of them for 7 s while the other waited.
"""

from __future__ import annotations

import itertools

import pytest

MARKER = "qconform_heavy"


def is_heavy(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None


def first_shares(count: int, workers: int) -> list[int]:
    """The sizes of the shares pytest-xdist hands ``workers`` idle workers out of ``count``
    pending items (``WorkStealingScheduling.check_schedule``)."""
    sizes, remaining = [], count
    for i in range(workers):
        size = remaining // (workers - i)
        sizes.append(size)
        remaining -= size
    return sizes


def place_heavy(items: list[pytest.Item], workers: int) -> None:
    """Reorder ``items`` in place: heavy instances first (one process), or each at the head
    of one worker's first share, in collection order; the rest keep their order."""
    heavy = [item for item in items if is_heavy(item)]
    if not heavy:
        return
    rest = [item for item in items if not is_heavy(item)]
    if workers <= 1:
        items[:] = heavy + rest
        return
    leads: list[list[pytest.Item]] = [[] for _ in range(workers)]
    for k, item in enumerate(heavy):
        leads[k % workers].append(item)
    others = iter(rest)
    ordered: list[pytest.Item] = []
    for lead, size in zip(leads, first_shares(len(items), workers), strict=True):
        ordered += lead
        ordered += itertools.islice(others, max(0, size - len(lead)))
    ordered += others
    items[:] = ordered


def workers(config: pytest.Config) -> int:
    """How many pytest-xdist workers share the collection (1 in a process of its own)."""
    workerinput = getattr(config, "workerinput", None)
    return int(workerinput.get("workercount", 1)) if workerinput else 1
