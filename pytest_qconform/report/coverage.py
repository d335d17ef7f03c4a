"""What a run checked of each declared axis: per backend and operation, the axis values
and the pairs of values of two axes that instances with a verdict ran on.

Only checks that declare their axes (``qconform_axes``) contribute. An instance counts
when it ran to a verdict on the arithmetic (pass, fail, known failure); skipped and
unavailable ones checked nothing. ``nox -s matrix`` and ``qconform check`` read it back;
the project's tests use it to prove that no claimed value goes unchecked.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from itertools import combinations
from typing import Any

from pytest_qconform.report.schema import SchemaError, json_object, required, string, type_name
from pytest_qconform.vocabulary import Verdict

CHECKED_VERDICTS = (Verdict.PASS, Verdict.FAIL, Verdict.KNOWN_FAILURE)


@dataclass(frozen=True)
class Coverage:
    """The axis values and value pairs one backend's operation was checked at."""

    backend: str
    operation: str
    instances: int
    values: dict[str, tuple[str, ...]]
    pairs: tuple[tuple[str, str, str, str], ...]  # (axis, value, other axis, other value), axis < other axis
    claimed: dict[str, tuple[str, ...]]  # every value the backend claims on each axis, for these checks

    @property
    def unchecked(self) -> dict[str, tuple[str, ...]]:
        """Claimed values no instance with a verdict ran on, per axis (empty when none)."""
        missing = {
            axis: tuple(v for v in found if v not in self.values.get(axis, ())) for axis, found in self.claimed.items()
        }
        return {axis: found for axis, found in missing.items() if found}

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "operation": self.operation,
            "instances": self.instances,
            "values": {axis: list(found) for axis, found in sorted(self.values.items())},
            "claimed": {axis: list(found) for axis, found in sorted(self.claimed.items())},
            "unchecked": {axis: list(found) for axis, found in sorted(self.unchecked.items())},
            "pairs": [list(pair) for pair in self.pairs],
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "coverage") -> Coverage:
        data = json_object(data, where)
        instances = required(data, "instances", where)
        if isinstance(instances, bool) or not isinstance(instances, int) or instances < 0:
            raise SchemaError(f"{where}.instances: expected a non-negative integer, got {type_name(instances)}")
        values = _labels(data, "values", where)
        claimed = _labels(data, "claimed", where)
        pairs = required(data, "pairs", where)
        if not isinstance(pairs, list) or not all(
            isinstance(p, list) and len(p) == 4 and all(isinstance(v, str) for v in p) for p in pairs
        ):
            raise SchemaError(f"{where}.pairs: expected a JSON array of [axis, value, axis, value] arrays")
        return cls(
            string(data, "backend", where, nonempty=True),
            string(data, "operation", where, nonempty=True),
            instances,
            values,
            tuple(tuple(p) for p in pairs),
            claimed,
        )


def _labels(data: Any, key: str, where: str) -> dict[str, tuple[str, ...]]:
    found = json_object(required(data, key, where), f"{where}.{key}")
    for axis, labels in found.items():
        if not isinstance(labels, list) or not all(isinstance(v, str) for v in labels):
            raise SchemaError(f"{where}.{key}.{axis}: expected a JSON array of strings")
    return {axis: tuple(labels) for axis, labels in found.items()}


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
