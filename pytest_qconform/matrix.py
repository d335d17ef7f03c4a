"""Merge many runners' reports into one compatibility matrix (Markdown, README, heatmap).

Rows are (backend, operation, format, dtype), columns are archs. The merge never
hides evidence: a report replaced by a newer one of the same machine and versions is
listed as superseded, runs that disagree on a cell show the disagreement instead of
one of them, and simulated-probe reports (nothing was computed) are excluded with a
note. Reports without cells (a ``--benchmark-only`` run, a selection that matched
nothing) are left out: they would otherwise supersede their machine's conformance
report with nothing. Output is deterministic (no clock, stable order) so regenerating
an unchanged matrix changes no bytes in the repository.

CLI: ``python -m pytest_qconform.matrix [PATHS...] [--readme README.md]
[--out reports/MATRIX.md] [--png reports/matrix.png] [--step-summary] [--ignore-invalid]``.
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
from pytest_qconform.report import (
    VERDICTS,
    ReportError,
    RunReport,
    format_multiple,
    read_report,
    write_figure_png,
    write_text_atomically,
)

MARKER_START = "<!-- qconform-matrix:start -->"
MARKER_END = "<!-- qconform-matrix:end -->"
FALLBACK_ARCHS: tuple[str, ...] = ("gfx1200", "gfx1201", "gfx1100", "gfx942", "gfx90a", "sm90", "sm80")

SYMBOLS: dict[str, str] = {
    "pass": "✅",
    "fail": "❌",
    "known-failure": "⚠️",
    "crashed": "💥",
    "timeout": "⏱",
    "skipped": "➖",
    "unavailable": "🚫",
}
LEGEND_WORDS: dict[str, str] = {"known-failure": "known failure"}

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


def _natural_key(text: str) -> tuple[Any, ...]:
    """``sm80 < sm90 < sm100``: digit runs compare as numbers."""
    return tuple((0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", text) if part)


def _backend_versions(report: RunReport) -> tuple[tuple[str, str | None], ...]:
    return tuple(sorted((name, status.get("version")) for name, status in report.probe["backends"].items()))


def machine_key(report: RunReport) -> tuple[Any, ...]:
    """What makes two reports measurements of the same thing: arch, host and every version."""
    p = report.probe
    return (report.arch, report.host, p.get("torch"), p.get("cuda"), p.get("hip"), _backend_versions(report))


def _run_order(report: RunReport) -> tuple[Any, ...]:
    return (_natural_key(report.arch), report.host, report.created_at, report.label)


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

    per_cell: dict[tuple[RowKey, str], list[tuple[str, Any, str]]] = {}
    for report in counted:
        for cell in report.cells:
            per_cell.setdefault((cell.key, report.arch), []).append(
                (cell.verdict, cell.worst_error_multiple, report.label))
    entries: dict[tuple[RowKey, str], Entry] = {}
    for key, found in per_cell.items():
        found.sort(key=lambda item: (VERDICTS.index(item[0]), item[2]))
        multiples = [m for _, m, _ in found if m is not None]
        worst = None
        if multiples:
            worst = math.nan if any(math.isnan(m) for m in multiples) else max(multiples)
        entries[key] = Entry(tuple(v for v, _, _ in found), tuple(s for _, _, s in found), worst)

    rows = tuple(sorted({row for row, _ in entries}))
    columns = tuple(sorted({r.arch for r in counted}, key=_natural_key))
    return Matrix(rows, columns, entries, tuple(counted), tuple(superseded), tuple(simulated))


def known_archs() -> tuple[str, ...]:
    """The archs the project knows about (``pytest_qconform.archs``), else a fixed list."""
    try:
        from pytest_qconform.archs import KNOWN_ARCHS
    except ImportError:
        return FALLBACK_ARCHS
    return tuple(KNOWN_ARCHS)


# ---------------------------------------------------------------- Markdown


def _md(text: Any) -> str:
    """A table cell: pipes escaped, newlines flattened."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines.extend("| " + " | ".join(_md(v) for v in row) + " |" for row in rows)
    return lines


def format_entry(entry: Entry | None) -> str:
    """``✅ 0.31``; a disagreement ``❌ fail ×1 ≠ ✅ pass ×1 (2 runs)``; blank when no run covered it."""
    if entry is None:
        return ""
    if entry.agreed:
        verdict = entry.verdicts[0]
        multiple = "" if entry.worst_error_multiple is None else f" {format_multiple(entry.worst_error_multiple)}"
        return f"{SYMBOLS[verdict]}{multiple}"
    distinct = sorted(set(entry.verdicts), key=VERDICTS.index)
    parts = [f"{SYMBOLS[v]} {v} ×{entry.verdicts.count(v)}" for v in distinct]
    return " ≠ ".join(parts) + f" ({entry.runs} runs)"


def _accel_version(probe: dict[str, Any]) -> str:
    if probe.get("hip"):
        return f"hip {probe['hip']}"
    if probe.get("cuda"):
        return f"cuda {probe['cuda']}"
    return "-"


def _versions_table(matrix: Matrix) -> list[str]:
    backends = sorted({name for run in matrix.runs for name in run.probe["backends"]})
    header = ["arch", "host", "device", "torch", "cuda/hip", *backends, "created", "report"]
    rows = []
    for run in matrix.runs:
        p = run.probe
        versions = []
        for name in backends:
            status = p["backends"].get(name)
            if status is None:
                versions.append("-")
            elif status["available"]:
                versions.append(str(status["version"] or "?"))
            else:
                versions.append("unavailable")
        rows.append([run.arch, run.host, p["device_name"], str(p["torch"]), _accel_version(p), *versions,
                     run.created, f"`{run.label}`"])
    return _table(header, rows)


def _legend() -> str:
    words = " · ".join(f"{SYMBOLS[v]} {LEGEND_WORDS.get(v, v)}" for v in
                       ("pass", "fail", "known-failure", "crashed", "timeout", "skipped", "unavailable"))
    return (f"Legend: {words}. The number is the worst error as a multiple of its derived bound "
            "(≤ 1 is within bound). `≠`: runs on that arch disagree (each verdict with its count). "
            "Blank: no run on that arch covered the row.")


def to_markdown(matrix: Matrix, compiled: compile_report.CompileCheck | None = None) -> str:
    """The matrix as GitHub Markdown: deterministic (same reports, same bytes). ``compiled``:
    the compile check's results, shown as "compiled, not run" for archs without a run."""
    out: list[str] = []
    if matrix.runs:
        out += ["**Runs** (one row per counted report: the versions behind each arch column)", ""]
        out += _versions_table(matrix)
        out += ["", "**Verdicts**", ""]
        header = ["backend", "operation", "format", "dtype", *matrix.columns]
        rows = [[*row, *(format_entry(matrix.entry(row, arch)) for arch in matrix.columns)] for row in matrix.rows]
        out += _table(header, rows) if rows else ["(the counted reports contain no cells)"]
        out += ["", _legend()]
    else:
        out += ["No run reports merged yet: run `pytest --qconform` on a runner, commit its report under "
                "`reports/`, then `nox -s matrix`."]

    disagreements = [(row, arch, e) for (row, arch), e in sorted(matrix.entries.items(),
                                                                  key=lambda kv: (kv[0][0], _natural_key(kv[0][1])))
                     if not e.agreed]
    if disagreements:
        out += ["", "**Disagreements** (runs on the same arch that give different verdicts; neither is picked):", ""]
        for row, arch, entry in disagreements:
            said = ", ".join(f"`{src}`: {v}" for v, src in zip(entry.verdicts, entry.sources))
            out.append(f"- {' · '.join(row)} on {arch}: {said}")

    run_archs = {run.arch for run in matrix.runs}
    missing = [arch for arch in sorted(known_archs(), key=_natural_key) if arch not in run_archs]
    if missing:
        out += ["", "**Not run yet** (archs the project knows with no report): " + ", ".join(missing)]
    if compiled is not None:
        out += compile_report.matrix_lines(compiled, run_archs)

    if matrix.superseded:
        out += ["", "**Superseded reports** (a newer report of the same arch, host and versions counts instead):", ""]
        out += [f"- `{s.old.label}` ({s.old.created}), superseded by `{s.new.label}` ({s.new.created})"
                for s in matrix.superseded]
    if matrix.simulated:
        out += ["", "**Excluded simulated reports** (simulated probe: nothing was computed on the device):", ""]
        out += [f"- `{r.label}` ({r.arch}, {r.created})" for r in matrix.simulated]
    return "\n".join(out) + "\n"


def update_readme(readme: Path, markdown: str) -> bool:
    """Replace the text between the matrix markers in ``readme``; returns whether it changed."""
    readme = Path(readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"{readme}: cannot read: {exc.strerror or exc}") from exc
    starts, ends = text.count(MARKER_START), text.count(MARKER_END)
    if starts != 1 or ends != 1:
        raise MatrixError(f"{readme}: expected exactly one {MARKER_START} and one {MARKER_END} line, found "
                          f"{starts} and {ends}; add the pair where the matrix should go")
    head, rest = text.split(MARKER_START)
    if MARKER_END in head:
        raise MatrixError(f"{readme}: {MARKER_END} comes before {MARKER_START}; swap them")
    tail = rest.split(MARKER_END)[1]
    new = f"{head}{MARKER_START}\n{markdown.strip(chr(10))}\n{MARKER_END}{tail}"
    if new == text:
        return False
    write_text_atomically(readme, new)
    return True


# ---------------------------------------------------------------- heatmap

HEAT_COLORS: dict[str, str] = {
    "pass": "#2e7d32",
    "fail": "#c62828",
    "known-failure": "#f9a825",
    "crashed": "#4a148c",
    "timeout": "#8d6e63",
    "skipped": "#cfd8dc",
    "unavailable": "#90a4ae",
    "disagree": "#ec407a",
    "none": "#ffffff",
}
_HEAT_ABBREV = {"pass": "pass", "fail": "FAIL", "known-failure": "known", "crashed": "CRASH",
                "timeout": "TIME", "skipped": "skip", "unavailable": "n/a"}


def _heat_state(entry: Entry | None) -> tuple[str, str]:
    if entry is None:
        return "none", ""
    if not entry.agreed:
        return "disagree", "≠ " + "/".join(_HEAT_ABBREV[v] for v in sorted(set(entry.verdicts), key=VERDICTS.index))
    verdict = entry.verdicts[0]
    label = _HEAT_ABBREV[verdict]
    if entry.worst_error_multiple is not None:
        label += f"\n{format_multiple(entry.worst_error_multiple)}"
    return verdict, label


def render_heatmap(matrix: Matrix, png_path: Path) -> Path:
    """A PNG heatmap: rows x arch columns, verdict colors, worst multiples written in.

    Uses the Agg canvas directly (no pyplot, no global backend switch) and strips the
    PNG's Software metadata so identical matrices give identical bytes.
    """
    from matplotlib.colors import ListedColormap
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    states = list(HEAT_COLORS)
    rows, cols = matrix.rows, matrix.columns
    width = 3.5 + 1.1 * max(len(cols), 1)
    height = 1.8 + 0.42 * max(len(rows), 1)
    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    if not rows or not cols:
        ax.axis("off")
        ax.text(0.5, 0.5, "no run reports merged yet", ha="center", va="center")
    else:
        grid = []
        for y, row in enumerate(rows):
            line = []
            for x, arch in enumerate(cols):
                state, label = _heat_state(matrix.entry(row, arch))
                line.append(states.index(state))
                if label:
                    dark = state in ("pass", "fail", "crashed", "timeout", "disagree")
                    ax.text(x, y, label, ha="center", va="center", fontsize=7, color="white" if dark else "black")
            grid.append(line)
        cmap = ListedColormap([HEAT_COLORS[s] for s in states])
        ax.imshow(grid, cmap=cmap, vmin=-0.5, vmax=len(states) - 0.5, aspect="auto", interpolation="nearest")
        ax.set_xticks(range(len(cols)), labels=list(cols))
        ax.set_yticks(range(len(rows)), labels=[" · ".join(r) for r in rows], fontsize=7)
        ax.xaxis.tick_top()
        ax.set_xticks([x - 0.5 for x in range(1, len(cols))], minor=True)
        ax.set_yticks([y - 0.5 for y in range(1, len(rows))], minor=True)
        ax.grid(which="minor", color="white", linewidth=1.5)
        ax.tick_params(which="minor", length=0)
        handles = [Patch(facecolor=HEAT_COLORS[s], edgecolor="black", linewidth=0.5, label=LEGEND_WORDS.get(s, s))
                   for s in states if s != "none"]
        ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.02), ncol=4, fontsize=7,
                  frameon=False)
    fig.tight_layout()
    return write_figure_png(fig, png_path)


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
    parser.add_argument("--readme", type=Path, help="replace the matrix between the qconform-matrix markers here")
    parser.add_argument("--out", type=Path, help="write the Markdown matrix to this file")
    parser.add_argument("--png", type=Path, help="write the heatmap PNG here (needs matplotlib)")
    parser.add_argument("--step-summary", action="store_true",
                        help="append the Markdown to the file named by $GITHUB_STEP_SUMMARY")
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
        written = []
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            write_text_atomically(args.out, markdown)
            written.append(str(args.out))
        if args.readme:
            update_readme(args.readme, markdown)
            written.append(str(args.readme))
        if args.png:
            try:
                render_heatmap(matrix, args.png)
            except ImportError as exc:
                raise MatrixError(f"{args.png}: cannot draw the heatmap: {exc}; "
                                  "install matplotlib (pip install 'pytest-qconform[matrix]')") from exc
            written.append(str(args.png))
        if summary_file:
            with open(summary_file, "a", encoding="utf-8") as handle:
                handle.write("## qconform compatibility matrix\n\n" + markdown)
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
