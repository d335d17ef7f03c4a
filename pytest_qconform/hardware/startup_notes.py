"""Warnings and log messages that libraries emit while the session probes them.

Importing torch's and the backends' modules prints deprecation warnings and log lines
(14 ``torch.jit.script_method`` DeprecationWarnings from HQQ's imports, bitsandbytes'
"Failed to load CPU gemm_4bit_forward from kernels-community") before pytest's header,
where they look like errors of the run. ``captured()`` records them instead: they go
into the probe (each backend's ``notes`` in the run report) and the header sums them up
in one line. Nothing is dropped: a note keeps the category, the place and the message.
"""

from __future__ import annotations

import logging
import warnings
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

MAX_LINE = 240


class _Collect(logging.Handler):
    def __init__(self, into: list[str]) -> None:
        super().__init__(logging.WARNING)
        self.into = into

    def emit(self, record: logging.LogRecord) -> None:
        self.into.append(f"log {record.levelname} {record.name}: {record.getMessage()}")


@contextmanager
def captured() -> Iterator[list[str]]:
    """Record warnings and WARNING+ log records raised inside the block, one string each."""
    notes: list[str] = []
    handler = _Collect(notes)
    root = logging.getLogger()
    root.addHandler(handler)  # a handler present: logging's last-resort stderr printer stays quiet
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield notes
    finally:
        root.removeHandler(handler)
    where = lambda w: f"{Path(w.filename).parent.name}/{Path(w.filename).name}:{w.lineno}"  # noqa: E731
    notes.extend(f"{w.category.__name__} ({where(w)}): {str(w.message).strip()}" for w in caught)


def _short(note: str) -> str:
    """``DeprecationWarning: `torch.jit.script_method` is deprecated...``: no place, one line, 70 characters."""
    head, _, message = note.partition(": ")
    text = f"{head.split(' (')[0]}: {message.splitlines()[0] if message else ''}"
    return text if len(text) <= 70 else text[:67] + "..."


def one_line(notes_by_source: dict[str, tuple[str, ...]]) -> str | None:
    """``start-up: 15 notes while loading (hqq 14, bitsandbytes 1): 14x DeprecationWarning ...``, or None."""
    total = sum(len(notes) for notes in notes_by_source.values())
    if not total:
        return None
    sources = ", ".join(f"{name} {len(notes)}" for name, notes in notes_by_source.items() if notes)
    counts = Counter(_short(note) for notes in notes_by_source.values() for note in notes)
    distinct = "; ".join(f"{n}x {note}" if n > 1 else note for note, n in counts.most_common())
    line = f"start-up: {total} warning(s) while loading ({sources}; kept in the probe's notes): {distinct}"
    return line if len(line) <= MAX_LINE else line[: MAX_LINE - 3] + "..."
