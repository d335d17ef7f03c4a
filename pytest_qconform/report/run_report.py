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
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_qconform.report.atomic import write_text_atomically
from pytest_qconform.report.benchmarks import Benchmark
from pytest_qconform.report.calls import CallCoverage
from pytest_qconform.report.cells import Cell as Cell  # public API here too (__init__.py), defined in cells.py
from pytest_qconform.report.contract import Suite
from pytest_qconform.report.coverage import Coverage
from pytest_qconform.report.file_schema import REPORT_FILES
from pytest_qconform.report.records import load
from pytest_qconform.report.schema import SchemaError, parse_created, required, type_name
from pytest_qconform.report.stale_entries import StaleEntry
from pytest_qconform.report.storage import ReportsFolder

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
# The report's optional sections: absent from the file when empty.
OPTIONAL_SECTIONS: tuple[str, ...] = ("benchmarks", "coverage", "calls", "stale_known_failures")


class ReportError(ValueError):
    """A report file cannot be read: names the file and what is wrong with it."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


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
        """The file's JSON value, written through its schema version's model (``file_schema``,
        the published schema's source): a report that does not hold to the schema is refused
        here, before it is written, naming the field."""
        sections: dict[str, Any] = {
            name: list(getattr(self, name)) for name in OPTIONAL_SECTIONS if getattr(self, name)
        }
        if self.suite is not None:
            sections["suite"] = self.suite
        model = REPORT_FILES[self.schema_version].model_validate(
            {
                "schema": SCHEMA,
                "schema_version": self.schema_version,
                "created": self.created,
                "probe": self.probe,
                "cells": list(self.cells),
                **sections,
            }
        )
        data: dict[str, Any] = model.model_dump(mode="json", by_alias=True, exclude_unset=True)
        return data

    @property
    def schema_version(self) -> int:
        """The lowest schema version that holds this report's content."""
        if self.suite is not None:
            return SUITE_SINCE_VERSION
        return BENCHMARKS_SINCE_VERSION if self.benchmarks else 1

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> RunReport:
        """Validate and build: the schema and its version told apart first (an older or newer
        file is named as such), then the file read by its version's model (``file_schema``);
        raises SchemaError naming the first field that is wrong."""
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
        for section, since, what in (
            ("benchmarks", BENCHMARKS_SINCE_VERSION, "a report with benchmarks"),
            ("suite", SUITE_SINCE_VERSION, "a report with a suite"),
        ):
            if section in data and version < since:
                raise SchemaError(
                    f"report.{section}: not part of schema_version {version} (added in version {since}); "
                    f"{what} says schema_version {since}"
                )
        if version >= SUITE_SINCE_VERSION and "suite" not in data:
            raise SchemaError(
                f"report: missing field 'suite' (required since schema_version {SUITE_SINCE_VERSION}: "
                "the suite version and contract revision the run was judged against)"
            )
        if "created" in data:
            parse_created(data["created"])  # its own message, with the form it expects
        model = load(REPORT_FILES[version], data, "report")
        return cls(
            probe=model.probe.model_dump(mode="json", exclude_unset=True),
            cells=tuple(model.cells),
            created=model.created,
            source=source,
            benchmarks=tuple(getattr(model, "benchmarks", ())),
            coverage=tuple(model.coverage),
            calls=tuple(model.calls),
            stale_known_failures=tuple(model.stale_known_failures),
            suite=getattr(model, "suite", None),
        )


# ---------------------------------------------------------------- files


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
