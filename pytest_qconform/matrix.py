"""The matrix CLI: merge run reports (``matrix_model``) and write the README section,
the full table (``matrix_markdown``), the heatmap (``heatmap``) and the step summary.

CLI: ``python -m pytest_qconform.matrix [PATHS...] [--readme README.md]
[--out reports/MATRIX.md] [--png reports/matrix.png] [--step-summary] [--ignore-invalid]``:
the README and the step summary get the summary (``matrix_summary``, one screen), the
``--out`` file the full per-cell table as well (``matrix_markdown``), the PNG the summary
heatmap (``heatmap``).
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Sequence

from pytest_qconform import compile_report
from pytest_qconform.atomic import write_text_atomically
from pytest_qconform.matrix_markdown import readme_markdown, to_markdown, update_readme
from pytest_qconform.matrix_model import Entry, Matrix, MatrixError, find_report_files, merge
from pytest_qconform.report import ReportError, read_report

__all__ = ["Entry", "Matrix", "MatrixError", "main", "merge"]


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
                from pytest_qconform.heatmap import render_heatmap  # matplotlib: the matrix extra

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
