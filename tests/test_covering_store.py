"""The packaged covering arrays (pytest_qconform/cases/covering_store.py, written and checked
by record_covering_arrays.py): answered from the
store only where the store holds this very question under the current constraints, and the
store current for this machine's default collection."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import torch

from pytest_qconform.cases import axes, covering_store

ROOT = Path(__file__).resolve().parents[1]
VALUES = {"dtype": (torch.bfloat16, torch.float16, torch.float32), "rows": (1, 128, 300), "x_rank": (2, 3)}


def _store_with(tmp_path: Path, items, strength: int, rows, fingerprint: str | None = None) -> Path:
    key = covering_store.question_key(items, strength, ())
    path = tmp_path / "store.json"
    arrays = {key: covering_store.encode(items, rows)}
    path.write_text(json.dumps({"fingerprint": fingerprint or covering_store.fingerprint(), "arrays": arrays}))
    return path


def test_a_stored_answer_round_trips_through_indices(tmp_path, monkeypatch):
    items = tuple(VALUES.items())
    rows = axes._build_covering_rows(dict(items), 2, ())
    path = _store_with(tmp_path, items, 2, rows)
    monkeypatch.setattr(covering_store, "_packaged_answers", lambda: covering_store.read(path))
    assert covering_store.stored_rows(items, 2, ()) == rows


def test_a_stored_question_is_not_built(tmp_path, monkeypatch):
    """The point of the store: covertable is not asked a question it answers."""
    items = tuple(VALUES.items())
    rows = axes._build_covering_rows(dict(items), 2, ())
    path = _store_with(tmp_path, items, 2, rows)
    monkeypatch.setattr(covering_store, "_packaged_answers", lambda: covering_store.read(path))

    def refuse(*args):
        raise AssertionError("built a question the store answers")

    monkeypatch.setattr(axes, "_build_covering_rows", refuse)
    axes._covering_rows_of.cache_clear()
    try:
        assert axes.covering_rows(dict(items), 2) == rows
    finally:
        axes._covering_rows_of.cache_clear()


def test_another_question_or_strength_is_built(tmp_path, monkeypatch):
    items = tuple(VALUES.items())
    path = _store_with(tmp_path, items, 2, axes._build_covering_rows(dict(items), 2, ()))
    monkeypatch.setattr(covering_store, "_packaged_answers", lambda: covering_store.read(path))
    assert covering_store.stored_rows(items, 3, ()) is None
    other = tuple({**VALUES, "rows": (1, 128)}.items())
    assert covering_store.stored_rows(other, 2, ()) is None


def test_a_store_under_another_fingerprint_answers_nothing(tmp_path):
    """axes.py's constraints or covertable changed: every stored answer is void."""
    items = tuple(VALUES.items())
    path = _store_with(tmp_path, items, 2, axes._build_covering_rows(dict(items), 2, ()), fingerprint="0" * 20)
    assert covering_store.read(path) == {}
    path.write_text("not json")
    assert covering_store.read(path) == {}


def test_without_the_constraints_source_no_answer_is_trusted(tmp_path, monkeypatch):
    items = tuple(VALUES.items())
    path = _store_with(tmp_path, items, 2, axes._build_covering_rows(dict(items), 2, ()))
    monkeypatch.setattr(covering_store, "AXES_SOURCE", tmp_path / "missing.py")
    assert covering_store.read(path) == {}


def test_an_unstable_question_has_no_key():
    class Opaque:
        pass

    assert covering_store.question_key((("axis", (Opaque(),)),), 2, ()) is None


def _check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pytest_qconform.cases.record_covering_arrays", "check", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_packaged_store_holds_this_machines_default_collection():
    """Stale (axes.py, covertable or a claim changed): ``nox -s covering-arrays``. A fresh
    build of every question this machine's default run asks must equal its stored answer."""
    result = _check()
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]


def test_the_check_fails_on_a_store_with_wrong_answers(tmp_path):
    """The check can fail: stored answers with a row dropped are named as differing. Every
    answer of more than one row loses one, since the store holds other machines' questions
    too (a GPU's), which this machine's check does not ask."""
    data = json.loads(covering_store.STORE_PATH.read_text())
    for key, rows in data["arrays"].items():
        if len(rows) > 1:
            data["arrays"][key] = rows[1:]
    altered = tmp_path / "altered.json"
    altered.write_text(json.dumps(data))
    result = _check("--store", str(altered))
    assert result.returncode == 1
    assert re.search(r" 0 of \d+ questions missing, [1-9]\d* answered differently", result.stdout), result.stdout
