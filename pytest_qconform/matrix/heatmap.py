"""The summary heatmap (reports/matrix.png): one panel per backend, operations × targets.

Each box is one (backend, operation) on one target (a matrix column: a GPU's arch, or a
CPU's machine and vector ISA, ``model.target``), coloured by its worst verdict, with its
cell counts and worst judged error multiple written in (``matrix_summary``). Its size
grows with backends, operations and targets, not with formats and dtypes, so it stays
readable at 100 % zoom: panels are laid out at most two abreast (a README column is
about 900 pixels wide) and every label is at least 9 pt at 100 dpi.

It is the page's overview, not its detail: a namespaced operation (``multi-gpu:matmul``,
``workload:generate``, ``distributed:ddp``) folds into one row per namespace and backend
(``multi-gpu: 6 operations``), whose box sums their cells, so the picture grows with the
suites' families rather than with each check a family adds. Each row of panels is as tall
as its tallest panel. The reports of 2026-11-28 (four backends, up to 27 rows a panel,
three columns) make it 2855 pixels tall (4136 before the folding, with 40 rows a panel),
inside ``MAX_HEIGHT_PX``; every operation's own box stays in reports/MATRIX.md's summary
and on the page. Drawn on the Agg canvas directly (no pyplot, no global backend switch)
and saved without matplotlib's version, so the same reports give the same bytes.

Where an arch was tested with several versions of a backend, the box also says what the
versions say (``matrix_versions``): ``≥ 0.50.0`` (the floor), ``same in all versions`` or a
regression (``0.49.2 ✓ → 0.50.2 ✗``, drawn with a thick outline, so it shows at a glance).
"""

from __future__ import annotations

from pathlib import Path

from pytest_qconform.matrix.model import Entry, Matrix
from pytest_qconform.matrix.summary import DISAGREE, SummaryEntry, summarize
from pytest_qconform.matrix.versions import VersionRange, version_range
from pytest_qconform.report.cells import VERDICTS
from pytest_qconform.report.figures import write_figure_png
from pytest_qconform.report.tables import format_multiple
from pytest_qconform.vocabulary import CellKey, Verdict

HEAT_COLORS: dict[str, str] = {
    Verdict.PASS: "#2e7d32",
    Verdict.FAIL: "#c62828",
    Verdict.KNOWN_FAILURE: "#f9a825",
    Verdict.CRASHED: "#4a148c",
    Verdict.TIMEOUT: "#8d6e63",
    Verdict.SKIPPED: "#cfd8dc",
    Verdict.UNAVAILABLE: "#90a4ae",
    Verdict.NOT_CLAIMED: "#eceff1",
    DISAGREE: "#ec407a",
}
OTHER_COLOR = "#b0bec5"  # a status this version does not know (a newer report's)
REGRESSION_EDGE = "#000000"  # outline of a box with a version regression
DARK = frozenset({Verdict.PASS, Verdict.FAIL, Verdict.CRASHED, Verdict.TIMEOUT, DISAGREE})  # white text on these
# A box's words: the verdict's own, as MATRIX.md writes it, at most shortened to its first word.
WORDS = {
    Verdict.PASS: Verdict.PASS,
    Verdict.FAIL: Verdict.FAIL,
    Verdict.KNOWN_FAILURE: "known",
    Verdict.CRASHED: Verdict.CRASHED,
    Verdict.TIMEOUT: Verdict.TIMEOUT,
    Verdict.SKIPPED: Verdict.SKIPPED,
    Verdict.UNAVAILABLE: Verdict.UNAVAILABLE,
    Verdict.NOT_CLAIMED: "not claimed",
    DISAGREE: "≠",
}
FONT_PT = 9
DPI = 100
BOX_W, BOX_H, LABEL_W, TITLE_H = 1.55, 0.48, 1.45, 0.45  # inches (LABEL_W: the least label column)
LABEL_CHAR_W = 0.075  # inches a label character takes at FONT_PT (DejaVu Sans, generous)
MAX_PANELS_ABREAST = 2
MAX_HEIGHT_PX = 3000  # what the committed reports' picture must stay within (tests/test_matrix.py)
NAMESPACE = ":"  # ``multi-gpu:matmul``: the operation ``matmul`` of the family ``multi-gpu``
# Families whose operations carry no namespace, folded alike: the layer suites' checks, and
# the bad-data suite's (issue 50), which would otherwise take the picture past MAX_HEIGHT_PX.
FAMILIES = {
    "layer-forward": "layer",
    "layer-quantize": "layer",
    "layer-sequencing": "layer",
    "layer-state": "layer",
    "nonfinite-quantize": "bad-data",
    "row-isolation": "bad-data",
    "corrupt-checkpoint": "bad-data",
}
BOX_CHARS = 26  # what fits on one line of a box at FONT_PT


def versions_label(found: VersionRange | None) -> str:
    """What the backend's versions say about the box: a floor, a regression, or nothing."""
    if found is None or not found.compared:
        return ""
    if found.regressions:
        first = found.regressions[0]
        return f"{first.good} ✓ → {first.bad} ✗"
    if found.floor is not None:
        return f"≥ {found.floor}"
    return "same in all versions"


def _wrapped(counts: list[str], width: int = BOX_CHARS) -> list[str]:
    """The counts joined by `` · ``, on as many lines as a box's width needs."""
    lines = [counts[0]] if counts else [""]
    for part in counts[1:]:
        if len(lines[-1]) + 3 + len(part) <= width:
            lines[-1] += f" · {part}"
        else:
            lines.append(part)
    return lines


def box_label(entry: SummaryEntry, found: VersionRange | None = None) -> str:
    """``22 pass · 2 known`` over ``worst 0.48``, over the versions' word (``≥ 0.50.0``). Counts
    too wide for one line take two, and the worst multiple joins their second: a box holds three."""
    lines = _wrapped([f"{n} {WORDS.get(name, name)}" for name, n in entry.counts])
    if entry.worst_judged_multiple is not None:
        worst = f"worst {format_multiple(entry.worst_judged_multiple)}"
        lines = lines[:-1] + _wrapped([lines[-1], worst]) if len(lines) > 1 else [*lines, worst]
    versions = versions_label(found)
    if versions:
        lines.append(versions)
    return "\n".join(lines)


def heatmap_row(operation: str) -> str:
    """The heatmap's row of an operation: its namespace for a namespaced one (``multi-gpu:matmul``
    goes to ``multi-gpu``), its family in ``FAMILIES``, else the operation itself."""
    namespace, sep, _ = operation.partition(NAMESPACE)
    return namespace if sep else FAMILIES.get(operation, operation)


def row_label(row: str, operations: set[str]) -> str:
    """``multi-gpu: 6 operations`` for a folded row (``operations``: the backend's operations in
    it); a row of one operation says its name (``workload:generate``)."""
    if len(operations) == 1:
        return next(iter(operations))
    return f"{row}{NAMESPACE} {len(operations)} operations"


def _folded_ranges(matrix: Matrix) -> dict[tuple[str, str, str], VersionRange]:
    """What the backend's versions say about each box: (column, backend, heatmap row) ->
    the floor and regressions of all the box's cells (``versions.version_range``)."""
    grouped: dict[tuple[str, str, str], list[tuple[CellKey, Entry]]] = {}
    for (row, column), entry in matrix.entries.items():
        grouped.setdefault((column, row[0], heatmap_row(row[1])), []).append((row, entry))
    return {key: version_range(*key, sorted(entries)) for key, entries in grouped.items()}


def render_heatmap(matrix: Matrix, png_path: Path) -> Path:
    """Write the summary heatmap of ``matrix`` to ``png_path`` (atomically)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch, Rectangle

    summary = summarize(matrix, operation_of=heatmap_row)
    by_row = _folded_ranges(matrix)
    backends = sorted({backend for backend, _ in summary.rows})
    cols = list(summary.columns)
    if not backends or not cols:
        fig = Figure(figsize=(4, 1), dpi=DPI)
        FigureCanvasAgg(fig)
        ax = fig.add_subplot(1, 1, 1)
        ax.axis("off")
        ax.text(0.5, 0.5, "no run reports merged yet", ha="center", va="center", fontsize=FONT_PT)
        return write_figure_png(fig, png_path)

    operations = {b: [op for backend, op in summary.rows if backend == b] for b in backends}
    members: dict[tuple[str, str], set[str]] = {}
    for row in matrix.rows:
        members.setdefault((row[0], heatmap_row(row[1])), set()).add(row[1])
    labels = {key: row_label(key[1], found) for key, found in members.items()}
    abreast = min(MAX_PANELS_ABREAST, len(backends))
    panel_rows = [backends[i : i + abreast] for i in range(0, len(backends), abreast)]
    # Each row of panels is as tall as its tallest panel (a column header and its operations).
    heights = [TITLE_H + BOX_H * (1 + max(len(operations[b]) for b in row)) for row in panel_rows]
    # The label column fits the longest row label ("distributed:fsdp-accelerate" was cut
    # off at the fixed width, and the panel to its right drew over the one on its left).
    label_w = max(LABEL_W, 0.15 + LABEL_CHAR_W * max(len(label) for label in labels.values()))
    panel_w = label_w + BOX_W * len(cols)
    legend_h = 1.25  # three lines of title and three rows of handles
    fig = Figure(figsize=(panel_w * abreast + 0.2, sum(heights) + legend_h), dpi=DPI)
    FigureCanvasAgg(fig)
    width, height = fig.get_size_inches()
    for index, backend in enumerate(backends):
        left = 0.1 + (index % abreast) * panel_w
        top = height - sum(heights[: index // abreast])
        shown = len(operations[backend])
        # Axes in inches: x = columns (0..len(cols)), y = operation rows from the top.
        ax = fig.add_axes(
            (
                (left + label_w) / width,
                (top - TITLE_H - BOX_H * (shown + 1) + 0.05) / height,
                (BOX_W * len(cols)) / width,
                (BOX_H * (shown + 1)) / height,
            )
        )
        ax.set_xlim(0, len(cols))
        ax.set_ylim(shown + 1, 0)
        ax.axis("off")
        ax.text(-label_w / BOX_W, -0.1, backend, ha="left", va="bottom", fontsize=FONT_PT + 2, fontweight="bold")
        for x, arch in enumerate(cols):
            ax.text(x + 0.5, 0.5, arch, ha="center", va="center", fontsize=FONT_PT, fontweight="bold")
        for y, operation in enumerate(operations[backend], start=1):
            ax.text(-0.05, y + 0.5, labels[(backend, operation)], ha="right", va="center", fontsize=FONT_PT)
            for x, arch in enumerate(cols):
                entry = summary.entry((backend, operation), arch)
                if entry is None:
                    ax.add_patch(
                        Rectangle(
                            (x + 0.03, y + 0.04), 0.94, 0.92, facecolor="white", edgecolor="#cfd8dc", linewidth=0.8
                        )
                    )
                    continue
                state = entry.worst
                found = by_row.get((arch, backend, operation))
                regressed = found is not None and bool(found.regressions)
                ax.add_patch(
                    Rectangle(
                        (x + 0.03, y + 0.04),
                        0.94,
                        0.92,
                        facecolor=HEAT_COLORS.get(state, OTHER_COLOR),
                        edgecolor=REGRESSION_EDGE if regressed else "none",
                        linewidth=2.5 if regressed else 0,
                    )
                )
                ax.text(
                    x + 0.5,
                    y + 0.5,
                    box_label(entry, found),
                    ha="center",
                    va="center",
                    fontsize=FONT_PT - 1,
                    color="white" if state in DARK else "black",
                    linespacing=1.15,
                )
    states = [*VERDICTS, DISAGREE]
    handles = [Patch(facecolor=HEAT_COLORS[s], label=WORDS[s] if s != DISAGREE else "runs disagree") for s in states]
    fig.legend(
        handles=handles,
        loc="lower center",
        ncol=4,
        fontsize=FONT_PT,
        frameon=False,
        title="colour: the worst verdict of the operation's cells on that column (its newest backend "
        "version); worst: the largest error of its pass/fail cells as a multiple of the bound;\n"
        "≥ v: works from backend version v; a ✓ → b ✗ (thick outline): passed in a, fails in b;\n"
        "family: n operations: the family's operations in one box (each on its own in MATRIX.md and on the page)",
        title_fontsize=FONT_PT - 1,
    )
    return write_figure_png(fig, png_path)
