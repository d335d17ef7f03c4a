"""The matrix CLI: merge run reports (``matrix_model``) and write the README's table
(``readme_table``), the full table (``matrix_markdown``), the heatmap (``heatmap``), the
browsable page (``site``) and the step summary.

CLI: ``python -m pytest_qconform.matrix.cli [PATHS...] [--readme README.md]
[--out reports/MATRIX.md] [--png reports/matrix.png] [--site reports/site/index.html]
[--step-summary] [--ignore-invalid] [--max-age-days N]``:
the README gets the compact table (a row per backend, a column per target), the step summary
the summary (``matrix_summary``, one screen), the
``--out`` file the full per-cell table as well (``matrix_markdown``), the PNG the summary
heatmap (``heatmap``), the ``--site`` file the page (all of it, filterable, one HTML file). Stale reports (older than ``--max-age-days``) and empty reports (zero
cells) are printed as warnings and written in the notes; reports of different contract
revisions are written in the notes. Nothing is merged silently.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from pytest_qconform.matrix.markdown import readme_markdown, to_markdown, update_readme
from pytest_qconform.matrix.model import Entry, Matrix, MatrixError, find_report_files, merge
from pytest_qconform.matrix.readme_table import readme_table
from pytest_qconform.matrix.site import write_site
from pytest_qconform.report.atomic import write_text_atomically
from pytest_qconform.report.run_report import ReportError, read_report
from pytest_qconform.report.sections import SectionError, is_section_file, read_section
from pytest_qconform.report.storage import COMMITTED

__all__ = ["Entry", "Matrix", "MatrixError", "main", "merge"]
DEFAULT_MAX_AGE_DAYS = 30.0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m pytest_qconform.matrix.cli",
        description="Merge pytest-qconform run reports into the compatibility matrix.",
    )
    parser.add_argument(
        "paths",
        nargs="*",
        default=[str(COMMITTED.root)],
        metavar="PATH",
        help="report files or folders scanned recursively for *.json, but a folder's bench/ (default: reports/)",
    )
    parser.add_argument(
        "--readme",
        type=Path,
        help="replace the text between the qconform-matrix markers here with the compact table (a row per backend)",
    )
    parser.add_argument("--out", type=Path, help="write the summary and the full per-cell matrix to this file")
    parser.add_argument("--png", type=Path, help="write the summary heatmap PNG here (needs matplotlib)")
    parser.add_argument(
        "--site",
        type=Path,
        help="write the browsable page here: one self-contained HTML file (reports/site/index.html)",
    )
    parser.add_argument(
        "--step-summary", action="store_true", help="append the summary to the file named by $GITHUB_STEP_SUMMARY"
    )
    parser.add_argument(
        "--ignore-invalid", action="store_true", help="skip malformed report files with a warning instead of failing"
    )
    parser.add_argument(
        "--max-age-days",
        type=_age,
        default=DEFAULT_MAX_AGE_DAYS,
        metavar="N",
        help="flag reports created more than N days ago as stale (default: %(default)g; "
        "0 flags every report; they are still merged)",
    )
    return parser


def _age(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a number of days >= 0, got {text!r}")
    return value


def _warnings(matrix: Matrix) -> list[str]:
    """One line per report the merge flags as something to act on: stale (run it again), empty
    (a run that checked nothing was copied in). Reports of different contract revisions are
    not: the matrix's notes say so, once, where its reader reads it, and whoever runs the merge
    on a clone can do nothing about the committed reports."""
    lines = [
        f"stale report {r.source or r.label}: created {r.created}, more than {matrix.max_age_days:g} days "
        "ago (merged, and flagged in the notes)"
        for r in matrix.stale
    ]
    lines += [
        f"empty report {r.source or r.label}: no judged cell"
        + (f" ({len(r.cells)} not claimed)" if r.cells else "")
        + (f" ({len(r.benchmarks)} benchmarks only)" if r.benchmarks else "")
        + "; not merged"
        for r in matrix.empty
    ]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Exit 0 on success, 2 with a one-line error naming the file on any bad input."""
    args = _parser().parse_args(argv)
    prog = "qconform matrix"
    try:
        files = find_report_files(args.paths)
        reports = []
        sections = []
        for path in files:
            if is_section_file(path):  # a tool's section of the matrix (report.sections), not a run
                sections.append(read_section(path))
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
            raise MatrixError(
                "--step-summary: $GITHUB_STEP_SUMMARY is not set (it is set inside GitHub Actions); "
                "drop the option to run elsewhere"
            )
        matrix = merge(reports, max_age_days=args.max_age_days)
        for line in _warnings(matrix):
            print(f"{prog}: warning: {line}", file=sys.stderr)
        markdown = to_markdown(matrix, sections)
        summary = readme_markdown(matrix, sections)
        written = []
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(args.out, markdown)
            written.append(str(args.out))
        if args.readme:
            update_readme(args.readme, readme_table(matrix))
            written.append(str(args.readme))
        if args.png:
            try:
                from pytest_qconform.matrix.heatmap import render_heatmap  # matplotlib: the matrix extra

                render_heatmap(matrix, args.png)
            except ImportError as exc:
                raise MatrixError(
                    f"{args.png}: cannot draw the heatmap: {exc}; "
                    "install matplotlib (pip install 'pytest-qconform[matrix]')"
                ) from exc
            written.append(str(args.png))
        if args.site:
            write_site(matrix, args.site, sections)
            written.append(str(args.site))
        if summary_file:
            with open(summary_file, "a", encoding="utf-8") as handle:
                handle.write("## qconform compatibility matrix\n\n" + summary)
            written.append(summary_file)
    except (MatrixError, SectionError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"{prog}: error: {exc.filename or ''}: {exc.strerror or exc}", file=sys.stderr)
        return 2
    if not written:
        sys.stdout.write(markdown)
    print(
        f"{prog}: merged {len(matrix.runs)} report(s) from {len(files)} file(s) "
        f"({len(matrix.superseded)} superseded, {len(matrix.simulated)} simulated excluded)"
        + (f" -> {', '.join(written)}" if written else ""),
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
