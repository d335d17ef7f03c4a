"""Write and check the packaged covering arrays (``covering_store``).

``python -m pytest_qconform.cases.record_covering_arrays write`` (``nox -s covering-arrays``)
records every question this machine's default and ``thorough`` collections ask, each
answered by a fresh build, and merges them into the store; a GPU asks other questions (its
claims differ), so a run there adds those. ``check`` says whether every question of this
machine's default collection is stored with the answer a fresh build gives
(tests/test_covering_store.py runs it). Each runs in a process of its own: it records what
``axes`` builds during an in-process collection.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any
from unittest import mock

import pytest

from pytest_qconform.cases import axes, covering_store


def record(pytest_args: list[str]) -> dict[str, covering_store.IndexRows]:
    """Every question a ``--collect-only`` session with ``pytest_args`` asks, answered by a
    fresh build (the store is not read), by key."""
    answers: dict[str, covering_store.IndexRows] = {}
    build = axes._build_covering_rows

    def recording_build(values: dict[str, tuple[Any, ...]], strength: int, jointly: Any) -> list[dict[str, Any]]:
        rows = build(values, strength, jointly)
        items = tuple(values.items())
        key = covering_store.question_key(items, strength, tuple(jointly))
        if key is not None:
            answers[key] = covering_store.encode(items, rows)
        return rows

    axes._covering_rows_of.cache_clear()
    with (
        mock.patch.object(covering_store, "stored_rows", return_value=None),
        mock.patch.object(axes, "_build_covering_rows", recording_build),
    ):
        code = pytest.main(["--qconform", "--collect-only", "-q", "-p", "no:cacheprovider", *pytest_args])
    axes._covering_rows_of.cache_clear()
    if code not in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        raise SystemExit(f"record_covering_arrays: the collection {pytest_args} failed ({code!r})")
    return answers


PROFILES = (["--qconform-profile=ci"], ["--qconform-profile=thorough"])


def write(path: Path = covering_store.STORE_PATH) -> int:
    """Record this machine's questions (both profiles) and merge them into the store."""
    answers: dict[str, covering_store.IndexRows] = {}
    for args in PROFILES:
        answers.update(record(args))
    kept = covering_store.read(path)  # this fingerprint's answers: another machine's questions too
    merged = {**kept, **answers}
    payload = {"fingerprint": covering_store.fingerprint(), "arrays": dict(sorted(merged.items()))}
    path.write_text(json.dumps(payload, separators=(",", ":")) + "\n")
    print(f"record_covering_arrays: {len(answers)} questions recorded here, {len(merged)} stored in {path}")
    return 0


def check(path: Path = covering_store.STORE_PATH) -> int:
    """0 when every question of this machine's default collection is stored with the answer
    a fresh build gives; else 1, naming how many are missing or differ."""
    fresh = record(list(PROFILES[0]))
    stored = covering_store.read(path)
    missing = [key for key in fresh if key not in stored]
    differing = [key for key in fresh if key in stored and stored[key] != fresh[key]]
    if missing or differing:
        print(
            f"record_covering_arrays: {len(missing)} of {len(fresh)} questions missing, {len(differing)} answered "
            f"differently in {path}; refresh it: nox -s covering-arrays (on a GPU too)"
        )
        return 1
    print(f"record_covering_arrays: all {len(fresh)} questions of this machine's default collection are stored")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("action", choices=("write", "check"))
    parser.add_argument(
        "--store", type=Path, default=covering_store.STORE_PATH, help="the store's file (default: the packaged one)"
    )
    args = parser.parse_args(argv)
    return write(args.store) if args.action == "write" else check(args.store)


if __name__ == "__main__":
    sys.exit(main())
