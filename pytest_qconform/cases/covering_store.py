"""Covering arrays answered from a packaged store before covertable is asked.

Why: every pytest-xdist worker builds the same covering arrays while it collects (109-119
distinct questions a run, 2-3 s of each worker's start on the H200, where 15 workers start
at once; docs/run-times.md), and no worker runs a test before the last one has collected.
An array depends only on its question (the axes' claimed values, the strength, the joint
axes), on the constraints between axes (``axes.py``) and on covertable's version. So the
store keys each answer by a hash of its question, under a fingerprint of ``axes.py`` and
covertable's version; an answer is trusted only while both are unchanged, and a question
the store lacks is built as before. Results never depend on the store: a stored answer is
the rows covertable gave for that very question.

Rows are stored as indices into each axis' value tuple, so any value (a dtype, a shape)
round-trips. ``record_covering_arrays`` writes and checks the store.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Any

STORE_PATH = Path(__file__).with_name("covering_arrays.json")
AXES_SOURCE = Path(__file__).with_name("axes.py")

Items = tuple[tuple[str, tuple[Any, ...]], ...]
IndexRows = list[list[int]]


def fingerprint() -> str:
    """What decides every answer besides its question: the constraints and covertable."""
    try:
        covertable = importlib.metadata.version("covertable")
    except importlib.metadata.PackageNotFoundError:
        covertable = "absent"
    try:
        source = AXES_SOURCE.read_bytes()
    except OSError:  # an install without sources (byte code only): no answer can be trusted
        return "no axes.py source"
    digest = hashlib.sha256(source)
    digest.update(f"\0covertable {covertable}".encode())
    return digest.hexdigest()[:20]


def question_key(items: Items, strength: int, jointly: tuple[str, ...]) -> str | None:
    """A hash of the question's text, or None where its text is not stable across
    processes (a value whose repr names a memory address)."""
    text = repr((items, strength, jointly))
    if " at 0x" in text:
        return None
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def read(path: Path) -> dict[str, IndexRows]:
    """A store's answers under the current fingerprint; none when it is missing or stale."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if data.get("fingerprint") != fingerprint():
        return {}
    return data.get("arrays", {})


@functools.cache
def _packaged_answers() -> dict[str, IndexRows]:
    return read(STORE_PATH)


def stored_rows(items: Items, strength: int, jointly: tuple[str, ...]) -> list[dict[str, Any]] | None:
    """The stored covering array of this question, as rows of values, or None."""
    key = question_key(items, strength, jointly)
    answer = _packaged_answers().get(key) if key is not None else None
    if answer is None:
        return None
    names = [name for name, _ in items]
    values = dict(items)
    return [{name: values[name][i] for name, i in zip(names, row)} for row in answer]


def encode(items: Items, rows: list[dict[str, Any]]) -> IndexRows:
    """Rows of values as rows of indices into each axis' values."""
    values = dict(items)
    return [[values[name].index(row[name]) for name, _ in items] for row in rows]
