"""What a run checked of each declared axis: per backend and operation, the axis values
and the pairs of values of two axes that instances with a verdict ran on.

Only checks that declare their axes (``qconform_axes``) contribute. An instance counts
when it ran to a verdict on the arithmetic (pass, fail, known failure); skipped and
unavailable ones checked nothing. ``nox -s matrix`` and ``qconform check`` read it back;
the project's tests use it to prove that no claimed value goes unchecked.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import combinations
from typing import Any

from pydantic import computed_field, model_validator
from pydantic.dataclasses import dataclass

from pytest_qconform.report.records import RECORD_CONFIG, Count, EveryKeyWritten, Name, Text
from pytest_qconform.vocabulary import Verdict

CHECKED_VERDICTS = (Verdict.PASS, Verdict.FAIL, Verdict.KNOWN_FAILURE)


@dataclass(frozen=True, config=RECORD_CONFIG)
class Coverage(EveryKeyWritten):
    """What the checks with declared axes covered, for one backend and operation: the axis
    values and value pairs its checked instances ran on, and what the backend claims."""

    backend: Name
    operation: Name
    instances: Count  # checked instances
    values: dict[str, tuple[Text, ...]]
    pairs: tuple[tuple[Text, Text, Text, Text], ...]  # (axis, value, other axis, other value), axis < other axis
    claimed: dict[str, tuple[Text, ...]]  # every value the backend claims on each axis, for these checks

    @model_validator(mode="before")
    @classmethod
    def _unchecked_is_derived(cls, data: Any) -> Any:
        """``unchecked`` is written for readers of the file, and derived again on reading."""
        if isinstance(data, dict) and "unchecked" in data:
            return {key: value for key, value in data.items() if key != "unchecked"}
        return data

    @computed_field  # type: ignore[prop-decorator]
    @property
    def unchecked(self) -> dict[str, tuple[str, ...]]:
        """Claimed values no instance with a verdict ran on, per axis (empty when none)."""
        missing = {
            axis: tuple(v for v in found if v not in self.values.get(axis, ())) for axis, found in self.claimed.items()
        }
        return {axis: found for axis, found in missing.items() if found}


def from_cases(cases: Iterable[Any]) -> tuple[Coverage, ...]:
    """Coverage per (backend, operation) from the run's cases (``outcomes.Case``)."""
    grouped: dict[tuple[str, str], list[tuple[tuple[str, str], ...]]] = {}
    claimed: dict[tuple[str, str], dict[str, set[str]]] = {}
    for case in cases:
        if not case.axes:
            continue
        key = (case.backend, case.operation)
        grouped.setdefault(key, [])
        for axis, labels in case.claimed:
            claimed.setdefault(key, {}).setdefault(axis, set()).update(labels)
        if case.verdict in CHECKED_VERDICTS:
            grouped[key].append(case.axes)
    found = []
    for (backend, operation), rows in sorted(grouped.items()):
        values: dict[str, set[str]] = {}
        pairs: set[tuple[str, str, str, str]] = set()
        for row in rows:
            for axis, value in row:
                values.setdefault(axis, set()).add(value)
            pairs.update((a, va, b, vb) for (a, va), (b, vb) in combinations(sorted(row), 2))
        claims = claimed.get((backend, operation), {})
        found.append(
            Coverage(
                backend,
                operation,
                len(rows),
                {a: tuple(sorted(v)) for a, v in values.items()},
                tuple(sorted(pairs)),
                {a: tuple(sorted(v)) for a, v in claims.items()},
            )
        )
    return tuple(found)
