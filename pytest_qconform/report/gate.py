"""The report gate: ``python -m pytest_qconform check REPORT...``, what a CI job requires
of a run, read from its report rather than from pytest's exit code.

pytest's exit code says *that* something failed; it also says 0 when nothing was
checked (a selection that matched nothing, a backend that could not load). The gate
reads the run report and fails unless the run computed something, and what it computed
is what the job requires:

- every report must hold at least one *computed* cell (pass, fail, known-failure,
  crashed, timeout) for each backend asked for (``--backend``; default: any backend):
  a run whose cells are all ``unavailable`` or ``skipped`` checked nothing;
- ``--require no-fail`` (default): no ``fail``, ``crashed`` or ``timeout`` cell;
  ``--require pass``: every cell is ``pass`` or ``known-failure`` (an ``unavailable``
  or ``skipped`` cell is a problem too: a backend that did not load, a case that ran out
  of memory); ``--require any``: nothing beyond the other rules (for a broken backend
  whose failures spread to every operation that uses the broken one);
- ``--expect-fail CELL`` (repeatable): ``backend/operation[/format[/dtype]]``, each part a
  glob. At least one cell must match, and every matching cell must be ``fail``; matching
  cells are exempt from ``--require``. For a deliberately broken backend, a mutant, or a
  bug you track without a known-failures entry.

- ``--min-version PACKAGE=VERSION`` (repeatable): judge only cells computed with at least
  that version: PACKAGE is a backend (its library version, for its own cells) or torch,
  triton, cuda, hip or driver (every cell). A report computed with an older version is
  left out with a line saying so; when no report has a cell that meets it, the gate is
  not met ("no cell was computed with bitsandbytes >= 0.50.0"), never passed by default.

A folder given as REPORT must hold exactly one report: a folder reused across runs
holds old reports, and an old green report must not pass a run that wrote none. Give
each CI job a fresh ``--qconform-report-dir``.

Every report is read by the models the published JSON Schema is generated from
(``file_schema``) before it is judged; the first violation (where in the file, and why) is
bad input.

Exit status: 0 requirements met, 1 not met (each problem on its own line), 2 bad input
(no report, unreadable report or one that breaks the schema, bad pattern).
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import sys
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pytest_qconform.report.cells import FAILING_VERDICTS, VERDICTS, Cell
from pytest_qconform.report.run_report import ReportError, RunReport, read_report
from pytest_qconform.report.storage import NotOneReport, ReportsFolder
from pytest_qconform.report.versions import MinVersion
from pytest_qconform.vocabulary import CellKey, Verdict

PROG = "qconform check"
REQUIREMENTS: tuple[str, ...] = ("no-fail", "pass", "any")
COMPUTED_VERDICTS: frozenset[str] = frozenset(
    {Verdict.PASS, Verdict.FAIL, Verdict.KNOWN_FAILURE, Verdict.CRASHED, Verdict.TIMEOUT}
)
PASSING_VERDICTS: frozenset[str] = frozenset({Verdict.PASS, Verdict.KNOWN_FAILURE, Verdict.NOT_CLAIMED})
PATTERN_FIELDS: tuple[str, ...] = ("backend", "operation", "format", "dtype")


class GateUsageError(ValueError):
    """Bad input to the gate (no report, unreadable report, malformed pattern)."""


@dataclass(frozen=True)
class CellPattern:
    """``backend/operation[/format[/dtype]]``, each part an fnmatch glob; missing parts match anything."""

    text: str
    parts: tuple[str, ...]

    @classmethod
    def parse(cls, text: str) -> CellPattern:
        parts = tuple(text.split("/"))
        if not 2 <= len(parts) <= len(PATTERN_FIELDS) or not all(parts):
            raise GateUsageError(
                f"--expect-fail {text!r}: expected backend/operation[/format[/dtype]], each part "
                "a name or a glob, e.g. 'torch-nf4-broken/dequantize' or 'mylib/matmul/nf4-*/bf16'"
            )
        return cls(text, parts)

    def matches(self, cell: Cell) -> bool:
        return all(fnmatch.fnmatchcase(value, part) for value, part in zip(cell.key, self.parts))


def _counts(cells: Sequence[Cell]) -> str:
    """``40 pass, 2 known-failure``, worst verdict first."""
    counts = Counter(c.verdict for c in cells)
    return ", ".join(f"{n} {v}" for v, n in sorted(counts.items(), key=lambda kv: VERDICTS.index(kv[0])))


def _first_line(cell: Cell) -> str:
    detail = cell.reason or (cell.first_failure["message"] if cell.first_failure else "")
    return detail.strip().splitlines()[0] if detail.strip() else ""


def _describe(cell: Cell) -> str:
    first_line = _first_line(cell)
    return f"{'/'.join(cell.key)}: {cell.verdict}" + (f" ({first_line})" if first_line else "")


def _grouped(cells: Sequence[Cell], named: int = 3) -> list[str]:
    """One line per verdict and reason: a cell alone as ``_describe`` writes it; several as
    ``27 cells unavailable (reason): a, b, c and 24 more``, so that one missing library is
    one line, not one per cell (``--require pass`` on a CPU report named hqq-gemlite's 27)."""
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        groups.setdefault((cell.verdict, _first_line(cell)), []).append(cell)
    lines = []
    for (verdict, why), group in groups.items():
        if len(group) == 1:
            lines.append(_describe(group[0]))
            continue
        keys = ", ".join("/".join(c.key) for c in group[:named])
        more = f" and {len(group) - named} more" if len(group) > named else ""
        lines.append(f"{len(group)} cells {verdict}" + (f" ({why})" if why else "") + f": {keys}{more}")
    return lines


def problems(
    report: RunReport, backends: Sequence[str] = (), require: str = "no-fail", expect_fail: Sequence[CellPattern] = ()
) -> list[str]:
    """What in ``report`` contradicts the requirements; empty when it meets them."""
    if require not in REQUIREMENTS:
        raise GateUsageError(f"--require {require!r}: expected one of {', '.join(REQUIREMENTS)}")
    cells = [c for c in report.cells if not backends or c.backend in backends]
    found: list[str] = []
    if report.simulated:
        found.append(f"the run was simulated ({report.arch}): nothing was computed on any device")
    names: Sequence[str | None] = list(backends) or [None]
    for name in names:
        mine = [c for c in cells if name is None or c.backend == name]
        if not any(c.verdict in COMPUTED_VERDICTS for c in mine):
            who = f"backend {name!r}" if name else "any backend"
            why = _counts(mine)
            first = next((c.reason for c in mine if c.reason), "")
            found.append(
                f"nothing was checked for {who}: no computed cell "
                + (
                    f"({why}; e.g. {first})"
                    if mine
                    else "(the report has no cell for it: was it registered and selected with --qconform-backend?)"
                )
            )
    expected: set[CellKey] = set()
    for pattern in expect_fail:
        matched = [c for c in cells if pattern.matches(c)]
        if not matched:
            found.append(f"--expect-fail {pattern.text}: no cell matches")
        found += [
            f"{_describe(c)}, expected fail (--expect-fail {pattern.text})"
            for c in matched
            if c.verdict != Verdict.FAIL
        ]
        expected.update(c.key for c in matched)
    if require != "any":
        unexpected = [c for c in cells if c.key not in expected]
        found += [_describe(c) for c in unexpected if c.verdict in FAILING_VERDICTS]  # each one to fix
        if require == "pass":
            found += _grouped([c for c in unexpected if c.verdict not in PASSING_VERDICTS | FAILING_VERDICTS])
    return found


def reports_in(paths: Sequence[str | Path]) -> list[Path]:
    """Report files as given; a folder must hold exactly one run report (a fresh folder per run)."""
    files: list[Path] = []
    for given in paths:
        path = Path(given)
        if path.is_dir():
            try:
                files.append(ReportsFolder(path).the_run_report())
            except NotOneReport as exc:
                raise GateUsageError(str(exc)) from None
        elif path.is_file():
            files.append(path)
        else:
            raise GateUsageError(f"{path}: no such file or folder; pass the run's report file or its report folder")
    return files


def validated(path: Path) -> RunReport:
    """Read ``path``: the reader validates it with the models the published schema is
    generated from (``file_schema``); a ReportError names the file and the first violation
    (``report.cells[3].verdict: ...``)."""
    return read_report(path)


def meeting(report: RunReport, minimums: Sequence[MinVersion]) -> RunReport:
    """``report`` with only the cells computed with at least every version in ``minimums``."""
    if not minimums:
        return report
    kept = tuple(c for c in report.cells if all(m.met_by(report, c.backend) for m in minimums))
    return dataclasses.replace(report, cells=kept)


def _found_versions(reports: Sequence[RunReport], minimums: Sequence[MinVersion]) -> str:
    """``bitsandbytes 0.49.2 in a.json``: what the reports were computed with instead."""
    return "; ".join(
        f"{m.package} {m.found_in(r) or 'not recorded'} in {r.source or r.label}" for m in minimums for r in reports
    )


def _summary(report: RunReport, backends: Sequence[str]) -> str:
    counts = _counts([c for c in report.cells if not backends or c.backend in backends])
    return f"{report.source} ({report.arch}): {counts or 'no cells'}"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_qconform check",
        description="Require things of pytest-qconform run reports: the CI gate.",
        epilog="Exit 0: met; 1: not met; 2: bad input.",
    )
    parser.add_argument(
        "reports",
        nargs="+",
        metavar="REPORT",
        help="run report files, or folders holding exactly one (the run's --qconform-report-dir)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="NAME",
        help="judge only this backend's cells (repeatable); each must have a computed cell",
    )
    parser.add_argument(
        "--require",
        choices=REQUIREMENTS,
        default="no-fail",
        type=str.lower,
        help="no-fail (default): no fail, crashed or timeout cell; pass: every cell pass or "
        "known-failure (unavailable and skipped cells fail the gate too); any: only "
        "--expect-fail and 'something was computed'",
    )
    parser.add_argument(
        "--expect-fail",
        action="append",
        default=[],
        metavar="CELL",
        help="backend/operation[/format[/dtype]] (globs): these cells must exist and fail "
        "(repeatable); they are exempt from --require",
    )
    parser.add_argument(
        "--min-version",
        action="append",
        default=[],
        metavar="PACKAGE=VERSION",
        help="judge only cells computed with at least this version (repeatable): PACKAGE is a "
        "backend (its own cells) or torch, triton, cuda, hip, driver (every cell); fails when "
        "no cell meets it",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        patterns = [CellPattern.parse(text) for text in args.expect_fail]
        minimums = [MinVersion.parse(text) for text in args.min_version]
        reports = [validated(path) for path in reports_in(args.reports)]
    except (GateUsageError, ReportError, ValueError) as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    failed = False
    judged = [meeting(report, minimums) for report in reports]
    if minimums:
        wanted = ", ".join(m.text for m in minimums)
        for original, report in zip(reports, judged):
            if original.cells and not report.cells:
                print(
                    f"{PROG}: {original.source} ({original.arch}): left out: no cell computed with {wanted} "
                    f"({_found_versions([original], minimums)})"
                )
        reports = [report for original, report in zip(reports, judged) if report.cells or not original.cells]
        if not any(report.cells for report in reports):
            print(
                f"{PROG}: no cell was computed with {wanted} ({_found_versions(judged, minimums)}): NOT MET",
                file=sys.stderr,
            )
            return 1
    for report in reports:
        found = problems(report, args.backend, args.require, patterns)
        print(f"{PROG}: {_summary(report, args.backend)}: {'NOT MET' if found else 'ok'}")
        for line in found:
            print(f"{PROG}: {report.source}: {line}", file=sys.stderr)
        failed = failed or bool(found)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
