"""The merged matrix as the JSON the browsable page (``matrix.site``) embeds.

The page is built from the same ``Matrix`` as reports/MATRIX.md and the heatmap, never
from a second reading of the reports, and it computes nothing the model already says:
merged verdicts, summaries, floors, regressions and trends come from the model's own
functions (``summary``, ``versions``, ``trend``), serialised here; the page's script only
filters, sorts and displays.

Two parts, on purpose:

- ``runs``: each counted report as the published run report schema writes it
  (``RunReport.to_dict``, ``pytest-qconform/report``, docs/report-schema.md) less its
  ``coverage`` (the page does not show it), so a cell's detail shows the report's own
  record (cases, worst multiple, reason, first failure and its repro) and anyone can
  validate what the page holds with ``RunReport.from_dict``.
- everything merged: there is no published schema for the merged matrix yet, so this
  module serialises the model's records (``Entry``, ``SummaryEntry``, ``VersionRange``,
  ``Trend``, ``report.sections.Section``) with small explicit functions under its own name and version
  (``pytest-qconform/matrix-page``, version 1). When a merged-matrix schema is published,
  this is the module to replace.

Deterministic: the same reports give the same JSON (no clock, sorted keys), as MATRIX.md.
"""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from typing import Any

from pytest_qconform import __version__
from pytest_qconform.hardware.archs import KNOWN_ARCHS
from pytest_qconform.hardware.targets import hardware_marker_names
from pytest_qconform.matrix.heatmap import HEAT_COLORS, OTHER_COLOR, WORDS, versions_label
from pytest_qconform.matrix.known_repros import NOT_RUN_PREFIX, registry_repros, repro_for
from pytest_qconform.matrix.markdown import LEGEND_WORDS, accel_version, known_failure_text
from pytest_qconform.matrix.model import Entry, Matrix, device_label, known_archs, natural_key, target
from pytest_qconform.matrix.summary import DISAGREE, summarize
from pytest_qconform.matrix.trend import trends, verdicts_by_version
from pytest_qconform.matrix.versions import contract_revisions, other_differences, ranges
from pytest_qconform.report.cells import VERDICTS
from pytest_qconform.report.run_report import RunReport
from pytest_qconform.report.schema import multiple_to_json
from pytest_qconform.report.sections import Section
from pytest_qconform.report.tables import format_multiple
from pytest_qconform.session.options import DTYPE_NAMES, FORMATS
from pytest_qconform.vocabulary import CellKey, Verdict

PAGE_SCHEMA = "pytest-qconform/matrix-page"
PAGE_SCHEMA_VERSION = 1
# Worst first, as the heatmap colours a box: a disagreement, then the verdicts' own order.
STATE_ORDER: tuple[str, ...] = (DISAGREE, *VERDICTS)
# A verdict in the legend and the detail: MATRIX.md's legend words, shortened to fit a chip.
PAGE_WORDS: dict[str, str] = {
    Verdict.KNOWN_FAILURE: "known failure",
    Verdict.NOT_CLAIMED: "not claimed",
    DISAGREE: "runs disagree",
}


def state_of(verdicts: tuple[str, ...] | list[str]) -> str:
    """One cell's colour: its verdict when the runs agree, ``disagree`` when they do not."""
    return verdicts[0] if len(set(verdicts)) == 1 else DISAGREE


def rerun_command(row: CellKey, arch: str) -> str:
    """The narrowest ``pytest --qconform`` the options allow for a cell's checks: its arch's
    marker, its backend, its format family and its dtype (the operation has no option: the
    command runs the other operations of that backend, family and dtype too)."""
    backend, _, fmt, dtype = row
    parts = ["pytest", "--qconform"]
    if arch in hardware_marker_names():
        parts += ["-m", arch]
    parts.append(f"--qconform-backend={backend}")
    family = fmt.split("-", 1)[0]
    if family in FORMATS:
        parts.append(f"--qconform-format={family}")
    if dtype in DTYPE_NAMES:
        parts.append(f"--qconform-dtype={dtype}")
    return shlex.join(parts)


def _known(reason: str) -> dict[str, Any]:
    """A known failure's reason split for display: what, the link, the registry entry."""
    text = reason.removeprefix(NOT_RUN_PREFIX)
    entry = text.rsplit(" [", 1)[1].rstrip("]") if text.endswith("]") and " [" in text else ""
    what, link = known_failure_text(text)
    return {
        "what": what,
        "link": link.split(" ")[0] if link.startswith("http") else "",  # the page links http(s) only
        "link_text": link,
        "entry": entry,
        "not_run": reason.startswith(NOT_RUN_PREFIX),
    }


def _repros(row: CellKey, arch: str, entry: Entry, cells: dict[str, Any], repros: dict[str, str]) -> list[dict]:
    """The commands a reader can run for this cell, the most precise first: the first
    failing case's (stored in the report), the known failure's (the registry), then the
    cell's checks re-run (``rerun_command``). ``arch``: the column's arch (``x86_64`` for the
    column ``x86_64 (AVX2)``), whose marker the rerun takes."""
    found: list[dict[str, str]] = []
    for source in entry.sources:
        cell = cells.get(source)
        if cell is not None and cell.first_failure and cell.first_failure.get("repro"):
            found.append({"kind": "failure", "source": source, "command": cell.first_failure["repro"]})
            break
    for source, reason in zip(entry.sources, entry.reasons):
        command = repro_for(reason, repros)
        if command is not None:
            found.append({"kind": "known-failure", "source": source, "command": command})
            break
    found.append({"kind": "rerun", "source": "", "command": rerun_command(row, arch)})
    return found


def _run(run: RunReport, stale: bool) -> dict[str, Any]:
    report = run.to_dict()
    report.pop("coverage", None)
    probe = run.probe
    versions = {
        name: (status.get("version") if status.get("available") else "unavailable")
        for name, status in sorted(probe["backends"].items())
    }
    return {
        "label": run.label,
        "arch": target(run),  # the column it counts in
        "host": run.host,
        "created": run.created,
        "stale": stale,
        "device": device_label(probe) if "device_name" in probe else "",
        "torch": str(probe.get("torch") or "-"),
        "triton": str(probe.get("triton") or "-"),
        "accelerator": accel_version(probe),
        "backends": versions,
        "suite": run.suite.label if run.suite else "no contract revision (a report older than schema version 3)",
        "report": report,
    }


def _options(matrix: Matrix) -> dict[str, list[str]]:
    """The filters' choices. Formats as prefixes at each ``-``: ``nf4`` covers every NF4
    format, ``nf4-b128`` its blocksize-128 ones (``-dq`` included), then each full name."""
    names = {row[2] for row in matrix.rows}
    formats = {"-".join(name.split("-")[: i + 1]) for name in names - {"-"} for i in range(len(name.split("-")))}
    versions = {
        f"{row[0]} {version}"
        for (row, _), entry in matrix.entries.items()
        for version, _, _ in entry.history
        if version
    }
    return {
        "arch": list(matrix.columns),
        "backend": sorted({row[0] for row in matrix.rows}, key=natural_key),
        "operation": sorted({row[1] for row in matrix.rows}, key=natural_key),
        "format": sorted(formats, key=natural_key) + (["-"] if "-" in names else []),
        "dtype": sorted({row[3] for row in matrix.rows}, key=natural_key),
        "version": sorted(versions, key=natural_key),
        "state": [s for s in STATE_ORDER if any(state_of(e.verdicts) == s for e in matrix.entries.values())],
    }


def _overview(matrix: Matrix) -> list[dict[str, Any]]:
    """The heatmap's boxes (``summary``): one per backend, operation and arch."""
    summary = summarize(matrix)
    by_operation = {(r.arch, r.backend, r.operation): r for r in ranges(matrix, by_operation=True)}
    out = []
    for backend, operation in summary.rows:
        for arch in summary.columns:
            found = summary.entry((backend, operation), arch)
            if found is None:
                continue
            versions = by_operation.get((arch, backend, operation))
            out.append(
                {
                    "backend": backend,
                    "operation": operation,
                    "arch": arch,
                    "state": found.worst,
                    "counts": [list(c) for c in found.counts],
                    "worst_text": (
                        "" if found.worst_judged_multiple is None else format_multiple(found.worst_judged_multiple)
                    ),
                    "versions": versions_label(versions),
                    "regressed": bool(versions is not None and versions.regressions),
                }
            )
    return out


def _entries(matrix: Matrix, repros: dict[str, str]) -> list[dict[str, Any]]:
    """One per (row, arch) the model has: its merged state and worst multiple, the counted runs
    (indexes into ``runs``), every version's verdict, the known failure and the repros."""
    run_index: dict[str, int] = {}
    for i, run in enumerate(matrix.runs):
        run_index.setdefault(run.label, i)
    cells_of = {run.label: {cell.key: cell for cell in run.cells} for run in reversed(matrix.runs)}
    row_index = {row: i for i, row in enumerate(matrix.rows)}
    out = []
    for (row, arch), entry in sorted(matrix.entries.items(), key=lambda kv: (row_index[kv[0][0]], kv[0][1])):
        cells = {source: cells_of[source][row] for source in {h[2] for h in entry.history} if row in cells_of[source]}
        known = next(
            (_known(r) for v, r in zip(entry.verdicts, entry.reasons) if v == Verdict.KNOWN_FAILURE and r), None
        )
        worst = entry.worst_error_multiple
        out.append(
            {
                "row": row_index[row],
                "arch": arch,
                "state": state_of(entry.verdicts),
                "multiple": multiple_to_json(worst),
                "multiple_text": "" if worst is None else format_multiple(worst),
                "runs": [[run_index[s], v] for s, v in zip(entry.sources, entry.verdicts)],
                "history": [
                    [version, verdict, run_index[source], format_multiple(cells[source].worst_error_multiple)]
                    for version, verdict, source in entry.history
                ],
                "by_version": [[version, verdict] for version, verdict in verdicts_by_version(entry)],
                "known": known,
                "repros": _repros(row, matrix.arch_of(arch), entry, cells, repros),
            }
        )
    return out


def _versions(matrix: Matrix, row_index: dict[CellKey, int]) -> list[dict[str, Any]]:
    """MATRIX.md's Versions table (``versions.ranges``), with the regressed cells themselves."""
    return [
        {
            "arch": r.arch,
            "backend": r.backend,
            "versions": [str(v) for v in r.versions],
            "floor": r.floor,
            "works_from": r.floor_text() + (f" ({r.failing_below} cells fail below)" if r.floor else ""),
            "regressions": r.regressions_text(),
            "regressed_cells": [[row_index[g.row], g.good, g.bad, g.verdict] for g in r.regressions],
            "failing_newest": r.failing_newest,
            "known_newest": r.known_newest,
            "other_differences": list(other_differences(matrix, r.arch, r.backend)),
        }
        for r in ranges(matrix)
        if r.compared
    ]


def _trend(matrix: Matrix, row_index: dict[CellKey, int]) -> list[dict[str, Any]]:
    """``trend.trends``: per version the counts; per kind of change (fail -> pass) its cells."""
    return [
        {
            "arch": t.arch,
            "backend": t.backend,
            "versions": [str(v) for v in t.versions],
            "counts": [[list(c) for c in per_version] for per_version in t.counts],
            "other_differences": list(other_differences(matrix, t.arch, t.backend)),
            # [transition, cells, [[row, [[version, verdict], ...]], ...]]
            "transitions": [
                [
                    list(transition),
                    n,
                    [
                        [row_index[c.row], [[str(v), verdict] for v, verdict in c.said]]
                        for c in t.changed
                        if c.transition == transition
                    ],
                ]
                for transition, n in t.transitions()
            ],
        }
        for t in trends(matrix)
    ]


def _notes(matrix: Matrix) -> dict[str, Any]:
    """What MATRIX.md's notes say about the reports: not run yet, superseded, simulated, empty,
    stale, different contract revisions."""
    run_archs = {run.arch for run in matrix.runs}
    revisions = contract_revisions(matrix.runs)
    return {
        "not_run_yet": [a for a in sorted(known_archs(), key=natural_key) if a not in run_archs],
        "superseded": [[s.old.label, s.old.created, s.new.label] for s in matrix.superseded],
        "simulated": [[r.label, target(r), r.created] for r in matrix.simulated],
        "empty": [[r.label, target(r), r.created, len(r.benchmarks)] for r in matrix.empty],
        "stale": [[r.label, target(r), r.created] for r in matrix.stale],
        "max_age_days": matrix.max_age_days,
        "contract_revisions": (
            [[rev, labels] for rev, labels in sorted(revisions.items(), key=lambda kv: -1 if kv[0] is None else kv[0])]
            if len(revisions) > 1
            else []
        ),
    }


def _section(section: Section, run_archs: set[str]) -> dict[str, Any]:
    """A section with its rows for the archs without a run, each with the arch's facts."""
    rows = []
    for found in section.without_runs(run_archs):
        facts = KNOWN_ARCHS.get(found.arch)
        rows.append(
            {
                "arch": found.arch,
                "kind": facts.kind if facts else "?",
                "family": facts.family if facts else "?",
                "wave": facts.wave_size if facts else None,
                "held": found.held,
                "status": found.status,
            }
        )
    return {
        "backend": section.backend,
        "source": section.source,
        "title": section.title,
        "explanation": section.explanation,
        "archs": rows,
    }


def page_data(matrix: Matrix, sections: Sequence[Section] = (), repros: dict[str, str] | None = None) -> dict:
    """Everything the page shows, as JSON-ready data (see the module docstring).
    ``sections``: what tools other than runs know (``report.sections``), shown for archs without a run.
    ``repros``: known-failure reason -> repro (default: the packaged registry's)."""
    stale = {id(run) for run in matrix.stale}
    row_index = {row: i for i, row in enumerate(matrix.rows)}
    run_archs = {run.arch for run in matrix.runs}
    return {
        "schema": PAGE_SCHEMA,
        "schema_version": PAGE_SCHEMA_VERSION,
        "generator": f"pytest-qconform {__version__}",
        "legend": {
            "order": list(STATE_ORDER),
            "colors": {**{s: HEAT_COLORS[s] for s in STATE_ORDER}, "other": OTHER_COLOR},
            "words": {s: PAGE_WORDS.get(s, s) for s in STATE_ORDER},  # the legend's and the detail's
            "meaning": {s: LEGEND_WORDS.get(s, s) for s in STATE_ORDER},  # the legend's tooltips
            "short": {s: WORDS[s] for s in STATE_ORDER},  # inside a grid cell, as the heatmap writes them
            "failing": [Verdict.CRASHED, Verdict.TIMEOUT, Verdict.FAIL, DISAGREE],
        },
        "columns": list(matrix.columns),
        "rows": [list(row) for row in matrix.rows],
        "entries": _entries(matrix, registry_repros() if repros is None else repros),
        "runs": [_run(run, id(run) in stale) for run in matrix.runs],
        "options": _options(matrix),
        "overview": _overview(matrix),
        "versions": _versions(matrix, row_index),
        "trend": _trend(matrix, row_index),
        "sections": [_section(section, run_archs) for section in sections],
        "notes": _notes(matrix),
    }
