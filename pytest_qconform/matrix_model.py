"""Merge many runners' reports into one compatibility matrix (the data: rows, columns,
entries, superseded and simulated reports). The CLI that writes it is ``matrix``.

Rows are (backend, operation, format, dtype), columns are archs. The merge never
hides evidence: a report replaced by a newer one of the same machine and versions is
listed as superseded, runs that disagree on a cell show the disagreement instead of
one of them, and simulated-probe reports (nothing was computed) are excluded with a
note. Reports without cells (a ``--benchmark-only`` run, a selection that matched
nothing) are left out: they would otherwise supersede their machine's conformance
report with nothing. Output is deterministic (no clock, stable order) so regenerating
an unchanged matrix changes no bytes in the repository.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from pytest_qconform.report import VERDICTS, RunReport

FALLBACK_ARCHS: tuple[str, ...] = ("gfx1200", "gfx1201", "gfx1100", "gfx942", "gfx90a", "sm90", "sm80")

RowKey = tuple[str, str, str, str]


class MatrixError(ValueError):
    """A matrix output cannot be produced; the message names the file and what to do."""


@dataclass(frozen=True)
class Entry:
    """What the counted runs of one arch say about one row.

    ``verdicts`` holds one verdict per run (worst first), so a disagreement is visible
    as more than one distinct value; ``sources`` names the runs in the same order.
    """

    verdicts: tuple[str, ...]
    sources: tuple[str, ...]
    worst_error_multiple: float | None
    reasons: tuple[str, ...] = ()  # each run's cell reason, in the same order (why skipped, known failure...)

    @property
    def agreed(self) -> bool:
        return len(set(self.verdicts)) == 1

    @property
    def runs(self) -> int:
        return len(self.verdicts)


@dataclass(frozen=True)
class Supersession:
    """An older report that no longer counts, and the newer one of the same machine that does."""

    old: RunReport
    new: RunReport


@dataclass(frozen=True)
class Matrix:
    """The merged result. ``entries`` maps (row, arch) to an Entry; missing means no run covered it."""

    rows: tuple[RowKey, ...]
    columns: tuple[str, ...]
    entries: dict[tuple[RowKey, str], Entry]
    runs: tuple[RunReport, ...]
    superseded: tuple[Supersession, ...]
    simulated: tuple[RunReport, ...]

    def entry(self, row: RowKey, arch: str) -> Entry | None:
        return self.entries.get((row, arch))


# ---------------------------------------------------------------- merging


def natural_key(text: str) -> tuple[Any, ...]:
    """``sm80 < sm90 < sm100``: digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _backend_versions(report: RunReport) -> tuple[tuple[str, str | None], ...]:
    return tuple(sorted((name, status.get("version")) for name, status in report.probe["backends"].items()))


def machine_key(report: RunReport) -> tuple[Any, ...]:
    """What makes two reports measurements of the same thing: arch, host and every version."""
    p = report.probe
    return (report.arch, report.host, p.get("torch"), p.get("cuda"), p.get("hip"), _backend_versions(report))


def _run_order(report: RunReport) -> tuple[Any, ...]:
    return (natural_key(report.arch), report.host, report.created_at, report.label)


def merge(reports: Iterable[RunReport]) -> Matrix:
    """Merge reports (in any order) into a Matrix; see the module docstring for the rules."""
    real: list[RunReport] = []
    simulated: list[RunReport] = []
    for report in reports:
        if not report.cells:
            continue  # e.g. a --benchmark-only run: no conformance evidence to merge, nor to supersede with
        (simulated if report.simulated else real).append(report)

    newest: dict[tuple[Any, ...], list[RunReport]] = {}
    for report in real:
        newest.setdefault(machine_key(report), []).append(report)
    counted: list[RunReport] = []
    superseded: list[Supersession] = []
    for group in newest.values():
        # Newest last; the full content breaks ties so input order never decides.
        group.sort(key=lambda r: (r.created_at, r.label, json.dumps(r.to_dict(), sort_keys=True)))
        counted.append(group[-1])
        superseded.extend(Supersession(old, group[-1]) for old in group[:-1])
    counted.sort(key=_run_order)
    superseded.sort(key=lambda s: (_run_order(s.old), s.new.label))
    simulated.sort(key=_run_order)

    per_cell: dict[tuple[RowKey, str], list[tuple[str, Any, str, str]]] = {}
    for report in counted:
        for cell in report.cells:
            per_cell.setdefault((cell.key, report.arch), []).append(
                (cell.verdict, cell.worst_error_multiple, report.label, cell.reason))
    entries: dict[tuple[RowKey, str], Entry] = {}
    for key, found in per_cell.items():
        found.sort(key=lambda item: (VERDICTS.index(item[0]), item[2]))
        multiples = [m for _, m, _, _ in found if m is not None]
        worst = None
        if multiples:
            worst = math.nan if any(math.isnan(m) for m in multiples) else max(multiples)
        entries[key] = Entry(tuple(f[0] for f in found), tuple(f[2] for f in found), worst,
                             tuple(f[3] for f in found))

    rows = tuple(sorted({row for row, _ in entries}))
    columns = tuple(sorted({r.arch for r in counted}, key=natural_key))
    return Matrix(rows, columns, entries, tuple(counted), tuple(superseded), tuple(simulated))


def known_archs() -> tuple[str, ...]:
    """The archs the project knows about (``pytest_qconform.archs``), else a fixed list."""
    try:
        from pytest_qconform.archs import KNOWN_ARCHS
    except ImportError:
        return FALLBACK_ARCHS
    return tuple(KNOWN_ARCHS)


def find_report_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; folders scanned recursively for ``*.json`` (sorted, each file once)."""
    found: dict[Path, Path] = {}
    for given in paths:
        path = Path(given)
        if path.is_dir():
            candidates = sorted(p for p in path.rglob("*.json") if p.is_file())
        elif path.is_file():
            candidates = [path]
        else:
            raise MatrixError(f"{path}: no such file or folder; pass report files or folders of them")
        for candidate in candidates:
            found.setdefault(candidate.resolve(), candidate)
    return sorted(found.values())
