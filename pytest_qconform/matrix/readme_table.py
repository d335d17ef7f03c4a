"""The README's compact matrix: one row per backend, one column per target run (a GPU's arch,
or a CPU's machine and vector ISA: ``model.target``).

Each box says how many of the backend's cells on that arch (every operation, format and dtype,
the newest backend version's verdicts) passed, are known failures, failed, or could not run,
and, where several versions of the backend ran, from which one they hold (the floor,
``matrix.versions``). The backend links
to its section of the full matrix. It grows with backends and archs, never with cells, so it
stays one screen in the README (``nox -s matrix`` writes it between the markers); the detail
is in MATRIX.md, the heatmap and the page.
"""

from __future__ import annotations

import re
from collections import Counter

from pytest_qconform.matrix.model import Matrix, known_archs, natural_key
from pytest_qconform.matrix.summary import DISAGREE
from pytest_qconform.matrix.versions import VersionRange, ranges
from pytest_qconform.report.storage import COMMITTED
from pytest_qconform.vocabulary import FAILING, Verdict

# What a box counts, in this order: what ran and what could not (skipped and not-claimed cells
# say only what the check did not apply to; MATRIX.md has them).
COUNTED: tuple[tuple[str, frozenset[str]], ...] = (
    ("pass", frozenset({Verdict.PASS})),
    ("known", frozenset({Verdict.KNOWN_FAILURE})),
    ("fail", FAILING),
    ("unavailable", frozenset({Verdict.UNAVAILABLE})),
    ("runs disagree", frozenset({DISAGREE})),
)


def section_anchor(backend: str) -> str:
    """The anchor of MATRIX.md's ``### <backend>`` heading, as GitHub makes it."""
    return re.sub(r"[^a-z0-9 _-]", "", backend.lower()).replace(" ", "-")


def _counts(matrix: Matrix, backend: str, arch: str) -> Counter[str]:
    found: Counter[str] = Counter()
    for row in matrix.rows:
        entry = matrix.entry(row, arch) if row[0] == backend else None
        if entry is not None:
            found[entry.verdicts[0] if entry.agreed else DISAGREE] += 1
    return found


def _box(counts: Counter[str], versions: VersionRange | None) -> str:
    """``1230 pass · 88 known · 0 fail · ≥ 0.50.2``; blank when no run on the arch had the backend."""
    if not counts:
        return ""
    parts = [
        f"{sum(counts[v] for v in verdicts)} {word}"
        for word, verdicts in COUNTED
        if word in ("pass", "known", "fail") or any(counts[v] for v in verdicts)
    ]
    if all(v == Verdict.UNAVAILABLE for v in counts):  # nothing ran: say only that
        parts = [f"{counts[Verdict.UNAVAILABLE]} unavailable"]
    elif versions is not None and versions.floor is not None:
        parts.append(f"≥ {versions.floor}")
    return " · ".join(parts)


def readme_table(matrix: Matrix) -> str:
    """The README's section between the matrix markers, as Markdown."""
    full = COMMITTED.matrix_markdown.as_posix()
    if not matrix.runs:
        return f'No run report merged yet: every arch is "not run" ([{full}]({full})).\n'
    archs = list(matrix.columns)
    backends = sorted({row[0] for row in matrix.rows}, key=natural_key)
    versions = {(r.backend, r.arch): r for r in ranges(matrix)}
    lines = [
        "| backend | " + " | ".join(archs) + " |",
        "|" + " --- |" * (len(archs) + 1),
    ]
    for backend in backends:
        boxes = [_box(_counts(matrix, backend, arch), versions.get((backend, arch))) for arch in archs]
        lines.append(f"| [{backend}]({full}#{section_anchor(backend)}) | " + " | ".join(boxes) + " |")
    run_archs = {matrix.arch_of(column) for column in archs}
    not_run = [arch for arch in sorted(known_archs(), key=natural_key) if arch not in run_archs]
    lines += [
        "",
        "Cells (operation · format · dtype) per verdict of the newest backend version; `≥ v`: where several "
        "versions ran, the floor from which every passing cell passes; runs disagree: runs of the same "
        "versions on that column gave other verdicts. A CPU's column is its machine and the vector ISA torch "
        "dispatched to (bitsandbytes takes other CPU paths on AVX512 and AVX2). A backend links to its cells in "
        f"[{full}]({full})." + (f" Not run yet: {', '.join(not_run)}." if not_run else ""),
    ]
    return "\n".join(lines) + "\n"
