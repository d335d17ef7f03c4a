"""How the processes a session starts beside itself (the Triton warm-up, inductor's vector-ISA
check) yield the CPU: ``nice`` 10, so that the session's own processes (its start-up,
pytest-xdist's workers, their tests) get the cores first and the background work the
cycles they leave (the first H100 test started at 23-26 s instead of 28 s, docs/run-times.md)."""

from __future__ import annotations

import os
from collections.abc import Callable

NICENESS = 10


def _lower_priority() -> None:
    os.nice(NICENESS)


def yield_the_cpu() -> Callable[[], None] | None:
    """``preexec_fn`` for ``subprocess.Popen`` of a background process (None off POSIX)."""
    return _lower_priority if os.name == "posix" else None
