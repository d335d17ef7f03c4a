"""``--qconform-record-kernel-calls FILE``: the calls a run makes to our kernels' entry
points, written as the warm-up's call log (``kernel_calls``), in one process or under
pytest-xdist.

Why under xdist too: the log must be a default GPU run's calls, and that run takes about
100 s on 15 workers where one process takes the sum of their times (about 17 minutes on an
H200). Each worker records its own calls and hands them to the controller with its
``workeroutput`` when its session ends (the way pytest-xdist returns a worker's results);
the controller writes one log: the workers' calls interleaved by position, so that calls
made early in the run stay early in the log (the warm-up replays it in order, and the first
tests need the first kernels), each distinct call once. Which worker ran which test varies
from run to run, so the order of a log recorded under xdist does too; the calls in it do not.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from qconform_triton_nf4 import kernel_calls

WORKER_OUTPUT_KEY = "qconform_kernel_calls"
PLUGIN_NAME = "qconform-kernel-call-recording"


def _worker_number(worker_id: str) -> int:
    """``gw12`` -> 12 (workers in their numeric order, not ``gw1, gw10, gw2``)."""
    digits = "".join(ch for ch in worker_id if ch.isdigit())
    return int(digits) if digits else 0


class Recording:
    """The recorder of this process, and where its calls go: to ``path`` (one process, or a
    pytest-xdist controller once its workers are down), or to the controller (a worker)."""

    def __init__(self, config: pytest.Config, path: Path) -> None:
        self.path = path
        self.is_worker = hasattr(config, "workerinput")
        self.worker_calls: dict[str, list[dict]] = {}
        self.recorder = kernel_calls.Recorder().__enter__()
        if not self.is_worker:
            config.add_cleanup(self.write)

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        """A worker's calls into its ``workeroutput``, before it reports itself finished."""
        if self.is_worker:
            self.recorder.__exit__(None, None, None)
            session.config.workeroutput[WORKER_OUTPUT_KEY] = self.recorder.calls  # type: ignore[attr-defined]

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node: object, error: object) -> None:
        """A worker is down (pytest-xdist's hook, on the controller): keep its calls."""
        output = getattr(node, "workeroutput", None) or {}
        calls = output.get(WORKER_OUTPUT_KEY)
        if calls:
            self.worker_calls[node.gateway.id] = calls  # type: ignore[attr-defined]

    def write(self) -> None:
        """This process's calls, then the workers' interleaved by position, into the log."""
        self.recorder.__exit__(None, None, None)
        ordered = [self.worker_calls[w] for w in sorted(self.worker_calls, key=_worker_number)]
        for round_ in itertools.zip_longest(*ordered):
            self.recorder.merge([entry for entry in round_ if entry is not None])
        self.recorder.write(self.path)


def start(config: pytest.Config) -> None:
    """Install the recording if ``--qconform-record-kernel-calls`` names a file."""
    path = config.getoption("qconform_record_kernel_calls")
    if path:
        config.pluginmanager.register(Recording(config, Path(path)), PLUGIN_NAME)
