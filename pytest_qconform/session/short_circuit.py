"""After a backend crashes or times out, its remaining cells of that operation end at once.

A backend that kills the process or hangs in one test almost always does so in every
test that reaches the same code: without this, each of them costs a worker restart or
a full ``--timeout`` (a hanging matmul under ``--timeout=600`` holds a runner for hours).
So after the first ``crashed`` or ``timeout`` case of a backend, the rule of
``--qconform-after-crash`` decides which of its remaining tests are not run but end at
once with the same verdict, saying ``after an earlier crash in <test>``:

- ``operation`` (default): the same backend's remaining tests of the same matrix
  operation (a hang in matmul ends its other matmul cases, not its dequantize ones);
- ``backend``: every remaining test of that backend;
- ``continue``: none; every test runs and takes its own crash or timeout.

The other backends are never affected. Under pytest-xdist the controller sees a dead
worker's crash; it appends the trip to a small JSON-lines file that every worker reads
before each test (the path travels in ``workerinput``), so a restarted worker knows.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import pytest

from pytest_qconform.session import outcomes
from pytest_qconform.session.options import AFTER_CRASH_RULES as RULES
from pytest_qconform.vocabulary import Verdict

DEFAULT_RULE = RULES[0]
_WORKER_KEY = "qconform_trips_file"


class ShortCircuit:
    """A plugin object, on the controller and on every worker."""

    def __init__(self, config: pytest.Config) -> None:
        self.rule = config.getoption("qconform_after_crash") or DEFAULT_RULE
        self.trips: dict[tuple[str, ...], dict[str, str]] = {}
        self.path: Path | None = None
        workerinput = getattr(config, "workerinput", None)
        if workerinput is not None:
            found = workerinput.get(_WORKER_KEY)
            self.path = Path(found) if found else None
        elif config.pluginmanager.hasplugin("xdist") and self.rule != "continue":
            folder = Path(tempfile.mkdtemp(prefix="qconform-trips-"))
            config.add_cleanup(lambda: shutil.rmtree(folder, ignore_errors=True))
            self.path = folder / "trips.jsonl"

    def _key(self, backend: str, operation: str) -> tuple[str, ...]:
        return (backend,) if self.rule == "backend" else (backend, operation)

    @pytest.hookimpl(optionalhook=True)
    def pytest_configure_node(self, node) -> None:  # pytest-xdist, controller: hand the file to each worker
        if self.path is not None:
            node.workerinput[_WORKER_KEY] = str(self.path)

    def trip(self, case: outcomes.Case) -> None:
        """Record a crashed or timeout case: the first of its key trips it. (A case this ended
        at once has a key already tripped, or one that device_loss.py ends in its place.)"""
        if self.rule == "continue" or case.verdict not in outcomes.SHORT_CIRCUIT_CAUSES:
            return
        key = self._key(case.backend, case.operation)
        if key in self.trips:
            return
        trip = {"backend": case.backend, "operation": case.operation, "verdict": case.verdict, "nodeid": case.nodeid}
        self.trips[key] = trip
        if self.path is not None:
            with open(self.path, "a", encoding="utf-8") as handle:  # one short line: an atomic append
                handle.write(json.dumps(trip) + "\n")

    def _tripped(self, backend: str, operation: str) -> dict[str, str] | None:
        key = self._key(backend, operation)
        if key not in self.trips and self.path is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                trip = json.loads(line)
                self.trips.setdefault(self._key(trip["backend"], trip["operation"]), trip)
        return self.trips.get(key)

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_call(self, item: pytest.Item) -> None:
        if self.rule == "continue":
            return
        key = outcomes.case_key_of(item)
        if key is None:
            return
        trip = self._tripped(key.backend, key.operation)
        if trip is None:
            return
        scope = (
            f"{key.backend}'s remaining tests"
            if self.rule == "backend"
            else f"{key.backend}'s remaining {key.operation} tests"
        )
        outcomes.short_circuit(
            item,
            Verdict(trip["verdict"]),
            trip["nodeid"],
            f"not run: {scope} end at once (--qconform-after-crash={self.rule}; 'continue' runs them)",
        )
