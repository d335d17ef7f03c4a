"""Check what a downstream ``pytest --qconform`` run concluded, from its run report.

The exit code of pytest says *that* something failed; the report says *which cell*.
The ``downstream`` nox session uses this to require, for the correct example backend,
that every cell passed, and for the broken one, that its planted bug shows up as
failing cells of the operation it breaks (dequantize), not as a crash or a skip.

Usage::

    python check_report.py REPORT_DIR --backend torch-nf4 --all-pass
    python check_report.py REPORT_DIR --backend torch-nf4-broken --fails-in dequantize

Exit 0 when the report says what was required, 1 (with what differs) when not, 2 when
there is no single readable report in REPORT_DIR.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path
from typing import Sequence

from pytest_qconform.report import Cell, ReportError, RunReport, format_arch_table, read_report


def single_report(folder: Path) -> RunReport:
    """The one run report in ``folder``; a run writes exactly one, so none or several is an error."""
    found = sorted(folder.glob("*.json"))
    if len(found) != 1:
        raise ReportError(folder, f"expected exactly one run report (*.json), found {len(found)}: "
                                  "run pytest --qconform with a fresh --qconform-report-dir")
    return read_report(found[0])


def problems(cells: Sequence[Cell], backend: str, all_pass: bool, fails_in: Sequence[str]) -> list[str]:
    """What in ``cells`` contradicts the requirement; empty when the report is as required."""
    mine = [cell for cell in cells if cell.backend == backend]
    if not mine:
        return [f"no cells for backend {backend!r}: was it registered and selected (--qconform-backend)?"]
    found: list[str] = []
    if all_pass:
        found += [f"{'/'.join(cell.key)}: {cell.verdict} {cell.reason or cell.first_failure or ''}".rstrip()
                  for cell in mine if cell.verdict != "pass"]
    for operation in fails_in:
        cells_of = [cell for cell in mine if cell.operation == operation]
        if not cells_of:
            found.append(f"no {operation} cells for backend {backend!r}")
        found += [f"{'/'.join(cell.key)}: {cell.verdict}, expected fail" for cell in cells_of
                  if cell.verdict != "fail"]
    return found


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="check_report.py", description=__doc__.splitlines()[0])
    parser.add_argument("report_dir", type=Path, help="the --qconform-report-dir of the run")
    parser.add_argument("--backend", required=True, help="the backend whose cells to check")
    parser.add_argument("--all-pass", action="store_true", help="require every cell of the backend to pass")
    parser.add_argument("--fails-in", action="append", default=[], metavar="OPERATION",
                        help="require every cell of this operation to fail (repeatable)")
    args = parser.parse_args(argv)
    if not args.all_pass and not args.fails_in:
        parser.error("say what to require: --all-pass and/or --fails-in OPERATION")
    try:
        report = single_report(args.report_dir)
    except ReportError as exc:
        print(f"check_report: error: {exc}", file=sys.stderr)
        return 2
    counts = Counter(cell.verdict for cell in report.cells if cell.backend == args.backend)
    print(f"check_report: {args.backend}: " + ", ".join(f"{n} {v}" for v, n in sorted(counts.items())))
    found = problems(report.cells, args.backend, args.all_pass, args.fails_in)
    if found:
        print(format_arch_table(report))
    for line in found:
        print(f"check_report: {report.source}: {line}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
