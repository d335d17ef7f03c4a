"""The run report: one JSON file per run, saying which cells passed on this machine.

A report is the only thing a runner hands on to the matrix, so it is written
atomically (a killed run leaves no half-written file), read strictly (a malformed or
newer file is an error that names the file and the problem, never a guess), and
versioned (``schema_version``). The schema is documented in ``docs/report-schema.md``.
Reading never evaluates or unpickles anything: it is ``json.loads`` and type checks.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from pydantic import with_config
from pydantic.dataclasses import dataclass as pydantic_dataclass
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

from pytest_qconform.report import benchmarks as benchmarks_record
from pytest_qconform.report.atomic import write_text_atomically
from pytest_qconform.report.benchmarks import Benchmark
from pytest_qconform.report.calls import CallCoverage
from pytest_qconform.report.contract import Suite
from pytest_qconform.report.coverage import Coverage
from pytest_qconform.report.records import RECORD_CONFIG, Count, Multiple, Name, Text, dump, load
from pytest_qconform.report.schema import SchemaError, parse_created, required, type_name, validate_probe
from pytest_qconform.report.stale_entries import StaleEntry
from pytest_qconform.report.storage import ReportsFolder
from pytest_qconform.vocabulary import FAILING, VERDICT_ORDER, Verdict

T = TypeVar("T")
SCHEMA = "pytest-qconform/report"
SCHEMA_VERSION = 3
# Version 2 adds the optional top-level ``benchmarks`` list; version 3 adds ``suite`` (the
# suite version and contract revision the run was judged against, ``contract``), which a
# report written now always carries. A report is written with the lowest version that holds
# its content (one without ``suite``, built in memory from an old one, keeps version 1 or 2),
# so an older release refuses a newer report with "upgrade" instead of misreading it.
READABLE_VERSIONS: tuple[int, ...] = (1, 2, 3)
BENCHMARKS_SINCE_VERSION = 2
SUITE_SINCE_VERSION = 3

# Folding precedence, worst first: a cell is as bad as its worst case. A crash or a
# timeout hides what the remaining cases would have said, so they outrank a plain
# failure; a known failure still outranks a pass (it is not a pass); any computed
# outcome outranks "skipped", and "unavailable" (the backend cannot load) says least.
# "not-claimed": a check whose declared axes the backend claims no value of (pytest_qconform.cases.axes):
# its one cell says so, and says least.
VERDICTS: tuple[str, ...] = VERDICT_ORDER
FAILING_VERDICTS: frozenset[str] = FAILING


class ReportError(ValueError):
    """A report file cannot be read: names the file and what is wrong with it."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


# ---------------------------------------------------------------- records


class CellKey(NamedTuple):
    """What names a cell, from a test's case to the matrix's row: one key, one spelling."""

    backend: str
    operation: str
    format: str
    dtype: str


@with_config(RECORD_CONFIG)
class FirstFailure(TypedDict):
    """The first failing case of a cell: its message and a command that reruns it."""

    message: Text
    repro: Text


@pydantic_dataclass(frozen=True, config=RECORD_CONFIG)
class Cell:
    """One matrix cell of one run: every test case of a (backend, operation, format, dtype), folded.

    ``worst_error_multiple`` is the worst error as a multiple of its derived bound
    (<= 1 is within bound; null where nothing was measured); ``first_failure`` carries the
    message and a repro command of the first failing case; ``reason`` explains skipped,
    unavailable, not-claimed and known-failure.
    """

    backend: Name
    operation: Name
    format: Name
    dtype: Name  # bf16, fp16, fp32, or - where no dtype applies
    verdict: Verdict
    cases: Count = 1
    worst_error_multiple: Multiple = None
    first_failure: FirstFailure | None = None
    reason: Text = ""

    @property
    def key(self) -> CellKey:
        return CellKey(self.backend, self.operation, self.format, self.dtype)


def _worst(multiples: Iterable[float | None]) -> float | None:
    """The largest multiple; NaN counts as worst of all (a NaN result is never within bound)."""
    present = [m for m in multiples if m is not None]
    if not present:
        return None
    if any(math.isnan(m) for m in present):
        return math.nan
    return max(present)


def fold_cell(cells: Iterable[Cell]) -> Cell:
    """Fold the cells of many test cases with one (backend, operation, format, dtype) into one.

    Verdict: the first of ``VERDICTS`` present (crashed > timeout > fail > known-failure >
    pass > skipped > unavailable). Cases: summed. Worst multiple: the maximum (NaN wins).
    First failure: that of the first cell, in the given order, that carries one. Reason:
    that of the first cell whose verdict is the folded verdict.
    """
    cells = list(cells)
    if not cells:
        raise ValueError("fold_cell needs at least one cell")
    key = cells[0].key
    for cell in cells[1:]:
        if cell.key != key:
            raise ValueError(f"fold_cell: cannot fold {cell.key} into {key}; group cells by key first")
    verdict = min((cell.verdict for cell in cells), key=VERDICTS.index)
    failure = next((cell.first_failure for cell in cells if cell.first_failure is not None), None)
    reason = next(cell.reason for cell in cells if cell.verdict == verdict)
    return Cell(
        *key,
        verdict=verdict,
        cases=sum(cell.cases for cell in cells),
        worst_error_multiple=_worst(cell.worst_error_multiple for cell in cells),
        first_failure=failure,
        reason=reason,
    )


@dataclass(frozen=True)
class RunReport:
    """One run: the probe (what hardware and software), its cells, its benchmarks (only
    from ``--benchmark-only`` runs) and when (UTC).

    ``source`` is where the report was read from (empty for one built in memory); it is
    not part of the file and not part of equality.
    """

    probe: dict[str, Any]
    cells: tuple[Cell, ...]
    created: str
    source: str = field(default="", compare=False)
    benchmarks: tuple[Benchmark, ...] = ()
    coverage: tuple[Coverage, ...] = ()  # what each declared axis was checked at (coverage.py)
    calls: tuple[CallCoverage, ...] = ()  # what the call-site oracle judged in workloads (calls.py)
    stale_known_failures: tuple[StaleEntry, ...] = ()  # entries that marked no collected test (stale_entries.py)
    suite: Suite | None = None  # what judged the run (contract.py); None in reports older than version 3

    @property
    def arch(self) -> str:
        return str(self.probe["arch"])

    @property
    def host(self) -> str:
        return str(self.probe["host"])

    @property
    def simulated(self) -> bool:
        return bool(self.probe.get("simulated", False))

    @property
    def created_at(self) -> _dt.datetime:
        return parse_created(self.created)

    @property
    def label(self) -> str:
        """A short, machine-independent name: the file name, else arch-host-created."""
        return Path(self.source).name if self.source else f"{self.arch}-{self.host}-{self.created}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": self.schema_version,
            "created": self.created,
            "probe": dict(self.probe),
            "cells": [dump(cell) for cell in self.cells],
        }
        if self.benchmarks:
            data["benchmarks"] = [dump(entry) for entry in self.benchmarks]
        if self.coverage:
            data["coverage"] = [dump(entry) for entry in self.coverage]
        if self.calls:
            data["calls"] = [dump(entry) for entry in self.calls]
        if self.stale_known_failures:
            data["stale_known_failures"] = [dump(entry) for entry in self.stale_known_failures]
        if self.suite is not None:
            data["suite"] = dump(self.suite)
        return data

    @property
    def schema_version(self) -> int:
        """The lowest schema version that holds this report's content."""
        if self.suite is not None:
            return SUITE_SINCE_VERSION
        return BENCHMARKS_SINCE_VERSION if self.benchmarks else 1

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> RunReport:
        """Validate and build; raises SchemaError naming the first field that is wrong."""
        if not isinstance(data, dict):
            raise SchemaError(f"top level: expected a JSON object, got {type_name(data)}")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise SchemaError(f"schema is {schema!r}, expected {SCHEMA!r}: not a pytest-qconform run report")
        version = required(data, "schema_version", "report")
        if isinstance(version, bool) or not isinstance(version, int):
            raise SchemaError(f"report.schema_version: expected an integer, got {type_name(version)} {version!r}")
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"schema_version {version} is newer than this pytest-qconform reads "
                f"(version {SCHEMA_VERSION}); upgrade pytest-qconform to read it"
            )
        if version not in READABLE_VERSIONS:
            raise SchemaError(
                f"unknown schema_version {version}; this pytest-qconform reads version "
                f"{' or '.join(map(str, READABLE_VERSIONS))}"
            )
        created = required(data, "created", "report")
        parse_created(created)
        probe = validate_probe(required(data, "probe", "report"))
        raw_cells = required(data, "cells", "report")
        if not isinstance(raw_cells, list):
            raise SchemaError(f"report.cells: expected a JSON array, got {type_name(raw_cells)}")
        cells = tuple(load(Cell, cell, f"cells[{i}]") for i, cell in enumerate(raw_cells))
        benchmarks: tuple[Benchmark, ...] = ()
        if "benchmarks" in data:
            if version < BENCHMARKS_SINCE_VERSION:
                raise SchemaError(
                    f"report.benchmarks: not part of schema_version {version} (added in version "
                    f"{BENCHMARKS_SINCE_VERSION}); a report with benchmarks says schema_version "
                    f"{BENCHMARKS_SINCE_VERSION}"
                )
            raw = data["benchmarks"]
            if not isinstance(raw, list):
                raise SchemaError(f"report.benchmarks: expected a JSON array, got {type_name(raw)}")
            benchmarks = tuple(benchmarks_record.read(entry, f"benchmarks[{i}]") for i, entry in enumerate(raw))
        # Optional in every version: a reader that ignores them loses nothing else.
        coverage = _optional_array(data, "coverage", lambda entry, where: load(Coverage, entry, where))
        calls = _optional_array(data, "calls", lambda entry, where: load(CallCoverage, entry, where))
        stale = _optional_array(data, "stale_known_failures", lambda entry, where: load(StaleEntry, entry, where))
        suite = None
        if "suite" in data:
            if version < SUITE_SINCE_VERSION:
                raise SchemaError(
                    f"report.suite: not part of schema_version {version} (added in version "
                    f"{SUITE_SINCE_VERSION}); a report with a suite says schema_version "
                    f"{SUITE_SINCE_VERSION}"
                )
            suite = load(Suite, data["suite"], "report.suite")
        elif version >= SUITE_SINCE_VERSION:
            raise SchemaError(
                f"report: missing field 'suite' (required since schema_version {SUITE_SINCE_VERSION}: "
                "the suite version and contract revision the run was judged against)"
            )
        return cls(
            probe=probe,
            cells=cells,
            created=created,
            source=source,
            benchmarks=benchmarks,
            coverage=coverage,
            calls=calls,
            stale_known_failures=stale,
            suite=suite,
        )


# ---------------------------------------------------------------- files


def _optional_array(data: Mapping[str, Any], key: str, from_dict: Callable[[Any, str], T]) -> tuple[T, ...]:
    """The records of an optional top-level array (``key``), each read by ``from_dict``; () when absent."""
    if key not in data:
        return ()
    raw = data[key]
    if not isinstance(raw, list):
        raise SchemaError(f"report.{key}: expected a JSON array, got {type_name(raw)}")
    return tuple(from_dict(entry, f"{key}[{i}]") for i, entry in enumerate(raw))


def write_report(report: RunReport, folder: Path) -> Path:
    """Write ``report`` atomically into ``folder`` (created if needed), under the name the
    folder's layout gives it (``storage.ReportsFolder``); returns its path."""
    text = json.dumps(report.to_dict(), indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    path = ReportsFolder(Path(folder)).new_report_path(report.arch, report.host, report.created_at)
    write_text_atomically(path, text)
    return path


def _reject_constant(name: str) -> Any:
    raise SchemaError(f"{name} is not valid JSON (write non-finite multiples as the strings 'inf'/'nan')")


def read_report(path: str | os.PathLike[str]) -> RunReport:
    """Read and validate one report; any problem is a ReportError naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ReportError(path, f"cannot read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(path, f"not UTF-8 text (byte {exc.start}): not a run report") from exc
    if not text.strip():
        raise ReportError(path, "empty file: not a run report (a run killed before writing leaves none)")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        # Truncated: the parser choked on nothing, on half a literal or half a number.
        rest = text[exc.pos :].rstrip()
        truncated = (
            exc.msg.startswith("Unterminated string")
            or re.fullmatch(r"[-+.eE0-9]*", rest) is not None
            or any(literal.startswith(rest) for literal in ("true", "false", "null"))
        )
        what = "truncated JSON" if truncated else "not valid JSON"
        raise ReportError(
            path,
            f"{what} ({exc.msg}: line {exc.lineno} column {exc.colno}); "
            "regenerate it with pytest --qconform or remove it",
        ) from exc
    except SchemaError as exc:
        raise ReportError(path, str(exc)) from exc
    try:
        return RunReport.from_dict(data, source=str(path))
    except SchemaError as exc:
        raise ReportError(path, str(exc)) from exc
