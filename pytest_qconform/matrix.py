"""Merge many runners' reports into one compatibility matrix, and the CLI that writes it.

Rows are (backend, operation, format, dtype), columns are archs. The merge never
hides evidence: a report replaced by a newer one of the same machine and versions is
listed as superseded, runs that disagree on a cell show the disagreement instead of
one of them, and simulated-probe reports (nothing was computed) are excluded with a
note. Reports without cells (a ``--benchmark-only`` run, a selection that matched
nothing) are left out: they would otherwise supersede their machine's conformance
report with nothing. Output is deterministic (no clock, stable order) so regenerating
an unchanged matrix changes no bytes in the repository.

CLI: ``python -m pytest_qconform.matrix [PATHS...] [--readme README.md]
[--out reports/MATRIX.md] [--png reports/matrix.png] [--step-summary] [--ignore-invalid]``:
the README and the step summary get the summary (``matrix_summary``, one screen), the
``--out`` file the full per-cell table as well (``matrix_markdown``), the PNG the summary
heatmap (``heatmap``).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Sequence

from pytest_qconform import compile_report
from pytest_qconform.atomic import write_text_atomically
from pytest_qconform.report import VERDICTS, ReportError, RunReport, read_report

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


# ---------------------------------------------------------------- CLI


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_qconform.matrix",
        description="Merge pytest-qconform run reports into the compatibility matrix.")
    parser.add_argument("paths", nargs="*", default=["reports/"], metavar="PATH",
                        help="report files or folders scanned recursively for *.json (default: reports/)")
    parser.add_argument("--readme", type=Path,
                        help="replace the text between the qconform-matrix markers here with the summary")
    parser.add_argument("--out", type=Path, help="write the summary and the full per-cell matrix to this file")
    parser.add_argument("--png", type=Path, help="write the summary heatmap PNG here (needs matplotlib)")
    parser.add_argument("--step-summary", action="store_true",
                        help="append the summary to the file named by $GITHUB_STEP_SUMMARY")
    parser.add_argument("--ignore-invalid", action="store_true",
                        help="skip malformed report files with a warning instead of failing")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success, 2 with a one-line error naming the file on any bad input."""
    args = _parser().parse_args(argv)
    prog = "qconform matrix"
    try:
        files = find_report_files(args.paths)
        reports = []
        compiled = None
        for path in files:
            if compile_report.is_results_file(path):  # the compile check's results, not a run
                compiled = compile_report.read_results(path)
                continue
            try:
                reports.append(read_report(path))
            except ReportError as exc:
                if not args.ignore_invalid:
                    print(f"{prog}: error: bad report {exc}", file=sys.stderr)
                    return 2
                print(f"{prog}: warning: skipping bad report {exc}", file=sys.stderr)
        summary_file = os.environ.get("GITHUB_STEP_SUMMARY") if args.step_summary else None
        if args.step_summary and not summary_file:
            raise MatrixError("--step-summary: $GITHUB_STEP_SUMMARY is not set (it is set inside GitHub Actions); "
                              "drop the option to run elsewhere")
        from pytest_qconform.matrix_markdown import readme_markdown, to_markdown, update_readme

        matrix = merge(reports)
        markdown = to_markdown(matrix, compiled)
        summary = readme_markdown(matrix, compiled)
        written = []
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(args.out, markdown)
            written.append(str(args.out))
        if args.readme:
            update_readme(args.readme, summary)
            written.append(str(args.readme))
        if args.png:
            try:
                from pytest_qconform.heatmap import render_heatmap

                render_heatmap(matrix, args.png)
            except ImportError as exc:
                raise MatrixError(f"{args.png}: cannot draw the heatmap: {exc}; "
                                  "install matplotlib (pip install 'pytest-qconform[matrix]')") from exc
            written.append(str(args.png))
        if summary_file:
            with open(summary_file, "a", encoding="utf-8") as handle:
                handle.write("## qconform compatibility matrix\n\n" + summary)
            written.append(summary_file)
    except (MatrixError, compile_report.CompileReportError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not written:
        sys.stdout.write(markdown)
    print(f"{prog}: merged {len(matrix.runs)} report(s) from {len(files)} file(s) "
          f"({len(matrix.superseded)} superseded, {len(matrix.simulated)} simulated excluded)"
          + (f" -> {', '.join(written)}" if written else ""), file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
