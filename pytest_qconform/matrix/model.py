"""Merge many runners' reports into one compatibility matrix (the data: rows, columns,
entries, superseded and simulated reports). The CLI that writes it is ``matrix``.

Rows are (backend, operation, format, dtype), columns are targets (``target``): a GPU's
arch, or a CPU's machine and the vector ISA torch dispatched to (``x86_64 (AVX2)``). The merge never
hides evidence: a report replaced by a newer one of the same machine and versions is
listed as superseded, runs that disagree on a cell show the disagreement instead of
one of them, and simulated-probe reports (nothing was computed) are excluded with a
note. Reports without cells (a ``--benchmark-only`` run, a selection that matched
nothing) are left out, and listed as empty: they would otherwise supersede their
machine's conformance report with nothing.

Reports of different backend versions on one arch are all counted: each entry shows the
verdicts of the newest backend version that covered it (``versions.version_key``) and
keeps every version's verdict in ``Entry.history``, from which ``matrix_versions`` reads
floors and regressions. A cell that only versions older than the newest one tested on its
column covered (a cell the suites no longer make, or one the newest run left out) is no
current verdict: it is listed in ``Matrix.retired`` instead of shown as the column's word
(an old 0.49.2 report's failures once read as the newest verdicts of 129 cells). Reports older than ``max_age_days`` are counted and listed as
stale. Output is deterministic (the only clock is ``now``, which only decides staleness)
so regenerating an unchanged matrix changes no bytes in the repository.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_qconform.report.cells import VERDICTS
from pytest_qconform.report.run_report import RunReport
from pytest_qconform.report.storage import ReportsFolder
from pytest_qconform.report.versions import backend_version, version_key
from pytest_qconform.vocabulary import CellKey, Verdict


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
    # Every counted run's (backend version, verdict, source), oldest version first, the
    # older versions' runs included: ``verdicts`` holds only the newest version's.
    history: tuple[tuple[str | None, str, str], ...] = ()
    # The newest version's worst ratio to torch's own dense op (``worst_comparative_ratio``,
    # contract revision 8); None where no run compared one.
    worst_comparative_ratio: float | None = None

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
class Retired:
    """A cell that only older versions of its backend covered on a column: ``version`` is the
    newest that did, ``newest`` the newest version tested on that column."""

    row: CellKey
    column: str
    version: str | None
    newest: str | None


@dataclass(frozen=True)
class Matrix:
    """The merged result. ``entries`` maps (row, arch) to an Entry; missing means no run covered it."""

    rows: tuple[CellKey, ...]
    columns: tuple[str, ...]  # targets (``target``), in ``natural_key`` order
    entries: dict[tuple[CellKey, str], Entry]
    runs: tuple[RunReport, ...]
    superseded: tuple[Supersession, ...]
    simulated: tuple[RunReport, ...]
    empty: tuple[RunReport, ...] = ()  # reports with no judged cell (none, or only not-claimed ones): not merged
    stale: tuple[RunReport, ...] = ()  # counted reports older than max_age_days
    max_age_days: float | None = None
    column_archs: dict[str, str] = field(default_factory=dict)  # each column's arch (its hardware marker)
    retired: tuple[Retired, ...] = ()  # cells only older backend versions than the column's newest covered
    # (older report, its backends whose cells a newer report of the same machine and version replaced, newer report)
    partly_superseded: tuple[tuple[str, tuple[str, ...], str], ...] = ()

    def entry(self, row: CellKey, arch: str) -> Entry | None:
        """The entry of ``row`` in the column ``arch`` (a target: ``sm90``, ``x86_64 (AVX2)``)."""
        return self.entries.get((row, arch))

    def arch_of(self, column: str) -> str:
        """The arch (``x86_64``) of a column (``x86_64 (AVX2)``): its ``-m`` marker, its facts."""
        return self.column_archs.get(column, column)


# ---------------------------------------------------------------- merging


def natural_key(text: str) -> tuple[Any, ...]:
    """``sm80 < sm90 < sm100``: digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _backend_versions(report: RunReport) -> tuple[tuple[str, str | None], ...]:
    return tuple(sorted((name, status.get("version")) for name, status in report.probe["backends"].items()))


def machine_key(report: RunReport) -> tuple[Any, ...]:
    """What makes two reports measurements of the same thing: arch, host, every version, the
    number of devices the run had (a two-GPU run's multi-device cells and a one-GPU run's
    cells are other measurements, so neither supersedes the other; reports without the
    count are one-device runs) and, on a CPU, the vector ISA torch dispatched to (AVX512 or
    AVX2: bitsandbytes' CPU kernels take other paths on each, and their known failures are
    the AVX512 machine's, so a run on one ISA does not supersede a run on the other)."""
    p = report.probe
    devices = p.get("device_count") or 1
    return (
        report.arch,
        report.host,
        p.get("torch"),
        p.get("cuda"),
        p.get("hip"),
        _backend_versions(report),
        devices,
        p.get("cpu_capability"),
    )


def device_label(probe: dict[str, Any]) -> str:
    """The device a run had; on a CPU with the vector ISA torch dispatched to, which decides
    bitsandbytes' CPU paths (and so why two CPU runs of the same versions may disagree)."""
    name = str(probe["device_name"])
    capability = probe.get("cpu_capability")
    return f"{name} ({capability})" if probe.get("device_kind") == "cpu" and capability else name


def target(report: RunReport) -> str:
    """The column a report's cells go to: what decides which code the backends ran.

    On a GPU, its arch (``sm90``): the kernels a backend launches are chosen per arch, and
    the host CPU's vector ISA (which GPU reports record too) takes no part in them. On a
    CPU, the machine and the vector ISA torch dispatched to (``x86_64 (AVX512)``,
    ``x86_64 (AVX2)``): bitsandbytes' CPU kernels take other paths on each, and its known
    failures are scoped to one (``known_failures.toml``'s ``cpu_capability``), so runs on
    two ISAs are two targets whose verdicts may differ, not runs that disagree. A CPU report
    that does not record the ISA (older than the probe's ``cpu_capability``) goes to the
    plain machine's column (``x86_64``): its ISA is unknown, so it is compared with neither.
    """
    capability = report.probe.get("cpu_capability")
    if report.probe.get("device_kind") == "cpu" and capability:
        return f"{report.arch} ({capability})"
    return report.arch


def _run_order(report: RunReport) -> tuple[Any, ...]:
    return (natural_key(target(report)), report.host, report.created_at, report.label)


def _recency(report: RunReport) -> tuple[Any, ...]:
    """Newest last: creation time, then label, then the full content (input order never decides)."""
    return (report.created_at, report.label, json.dumps(report.to_dict(), sort_keys=True))


def _machine_without_backends(report: RunReport) -> tuple[Any, ...]:
    """``machine_key`` without the backends' versions: the machine one backend's cells are of."""
    key = machine_key(report)
    return key[:5] + key[6:]


def is_stale(report: RunReport, now: _dt.datetime, max_age_days: float) -> bool:
    return now - report.created_at > _dt.timedelta(days=max_age_days)


def merge(
    reports: Iterable[RunReport], *, max_age_days: float | None = None, now: _dt.datetime | None = None
) -> Matrix:
    """Merge reports (in any order) into a Matrix; see the module docstring for the rules.
    ``max_age_days``: reports created longer ago than this before ``now`` (default: the
    current time) are listed as stale; None lists none."""
    real: list[RunReport] = []
    simulated: list[RunReport] = []
    empty: list[RunReport] = []
    for report in reports:
        if all(cell.verdict == Verdict.NOT_CLAIMED for cell in report.cells):
            # e.g. a --benchmark-only run (its cells, if any, say only what a backend does not
            # claim): no conformance evidence to merge, and it must not supersede a run that has
            empty.append(report)
            continue
        (simulated if report.simulated else real).append(report)

    newest: dict[tuple[Any, ...], list[RunReport]] = {}
    for report in real:
        newest.setdefault(machine_key(report), []).append(report)
    counted: list[RunReport] = []
    superseded: list[Supersession] = []
    for group in newest.values():
        # Newest last; the full content breaks ties so input order never decides.
        group.sort(key=_recency)
        counted.append(group[-1])
        superseded.extend(Supersession(old, group[-1]) for old in group[:-1])
    counted.sort(key=_run_order)
    superseded.sort(key=lambda s: (_run_order(s.old), s.new.label))
    simulated.sort(key=_run_order)

    # A backend's cells count from the newest counted report of the same machine and the same
    # version of that backend: an older report differing only in another backend's version
    # (gemlite carried to one run, not to the next) still counts for that other backend alone.
    newest_for_backend: dict[tuple[Any, ...], RunReport] = {}
    for report in sorted(counted, key=_recency):
        for backend in {cell.backend for cell in report.cells}:
            newest_for_backend[(_machine_without_backends(report), backend, backend_version(report, backend))] = report
    partly: dict[tuple[str, str], list[str]] = {}
    per_cell: dict[tuple[CellKey, str], list[tuple[str, Any, str, str, str | None, Any]]] = {}
    for report in counted:
        for cell in report.cells:
            newer = newest_for_backend[
                (_machine_without_backends(report), cell.backend, backend_version(report, cell.backend))
            ]
            if newer is not report:
                backends = partly.setdefault((report.label, newer.label), [])
                if cell.backend not in backends:
                    backends.append(cell.backend)
                continue
            per_cell.setdefault((cell.key, target(report)), []).append(
                (
                    cell.verdict,
                    cell.worst_error_multiple,
                    report.label,
                    cell.reason,
                    backend_version(report, cell.backend),
                    cell.worst_comparative_ratio,
                )
            )
    newest_on_column: dict[tuple[str, str], str | None] = {}  # (column, backend): its newest version there
    for report in counted:
        for backend in {cell.backend for cell in report.cells}:
            version, slot = backend_version(report, backend), (target(report), backend)
            if slot not in newest_on_column or version_key(version) > version_key(newest_on_column[slot]):
                newest_on_column[slot] = version
    entries: dict[tuple[CellKey, str], Entry] = {}
    retired: list[Retired] = []
    for key, found in per_cell.items():
        newest_here = newest_on_column[(key[1], key[0][0])]
        covered = max((f[4] for f in found), key=version_key)
        # A run that could not load the backend (no version) says nothing of one: never retired.
        if covered is not None and version_key(covered) < version_key(newest_here):
            retired.append(Retired(key[0], key[1], covered, newest_here))
            continue
        history = tuple(
            sorted(((f[4], f[0], f[2]) for f in found), key=lambda h: (version_key(h[0]), VERDICTS.index(h[1]), h[2]))
        )
        newest_version = max(version_key(f[4]) for f in found)
        current = sorted(
            (f for f in found if version_key(f[4]) == newest_version), key=lambda f: (VERDICTS.index(f[0]), f[2])
        )
        multiples = [f[1] for f in current if f[1] is not None]
        worst = None
        if multiples:
            worst = math.nan if any(math.isnan(m) for m in multiples) else max(multiples)
        ratios = [f[5] for f in current if isinstance(f[5], float) and not math.isnan(f[5])]
        entries[key] = Entry(
            tuple(f[0] for f in current),
            tuple(f[2] for f in current),
            worst,
            tuple(f[3] for f in current),
            history,
            max(ratios) if ratios else None,
        )

    rows = tuple(sorted({row for row, _ in entries}))
    column_archs = {target(r): r.arch for r in counted}
    columns = tuple(sorted(column_archs, key=natural_key))
    now = now or _dt.datetime.now(_dt.UTC)
    stale = tuple(r for r in counted if max_age_days is not None and is_stale(r, now, max_age_days))
    empty.sort(key=_run_order)
    return Matrix(
        rows,
        columns,
        entries,
        tuple(counted),
        tuple(superseded),
        tuple(simulated),
        tuple(empty),
        stale,
        max_age_days,
        column_archs,
        tuple(sorted(retired, key=lambda r: (natural_key(r.column), r.row))),
        tuple((old, tuple(sorted(backends)), new) for (old, new), backends in sorted(partly.items())),
    )


def known_archs() -> tuple[str, ...]:
    """The archs the project knows about (``pytest_qconform.hardware.archs``)."""
    from pytest_qconform.hardware.archs import KNOWN_ARCHS

    return tuple(KNOWN_ARCHS)


def find_report_files(paths: Sequence[str | os.PathLike[str]]) -> list[Path]:
    """Files as given; of a folder, what its layout says the matrix reads (``ReportsFolder``:
    every ``*.json`` but the benchmark runs'). Sorted, each file once."""
    found: dict[Path, Path] = {}
    for given in paths:
        path = Path(given)
        if path.is_dir():
            candidates = ReportsFolder(path).matrix_inputs()
        elif path.is_file():
            candidates = [path]
        else:
            raise MatrixError(f"{path}: no such file or folder; pass report files or folders of them")
        for candidate in candidates:
            found.setdefault(candidate.resolve(), candidate)
    return sorted(found.values())
