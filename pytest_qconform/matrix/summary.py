"""The matrix at a glance: backend × operation × arch, for the README and the heatmap.

The full matrix has a row per (backend, operation, format, dtype): hundreds of rows,
which nobody reads. The summary folds each (backend, operation) on one arch into one
entry: how many of its cells ended in each verdict, and the worst error multiple of the
cells that were judged against a bound (pass and fail; a known failure's multiple
belongs to its bug, which is named below the table instead). The detail stays in
``reports/MATRIX.md``.

Verdicts are counted by name in ``VERDICTS`` order, and any other status a report may
carry later is counted after them under its own name, so a new kind of row or status
adds a count rather than a code path.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from pytest_qconform.matrix.model import Entry, Matrix, natural_key
from pytest_qconform.report.cells import VERDICTS
from pytest_qconform.vocabulary import CellKey, Verdict

DISAGREE = "disagree"  # runs on the same arch gave different verdicts for one cell
JUDGED: frozenset[str] = frozenset({Verdict.PASS, Verdict.FAIL})
SummaryKey = tuple[str, str]  # (backend, operation)


def _order(verdict: str) -> tuple[int, str]:
    return (VERDICTS.index(verdict), "") if verdict in VERDICTS else (len(VERDICTS), verdict)


@dataclass(frozen=True)
class SummaryEntry:
    """One (backend, operation) on one arch: cell counts per verdict, worst judged multiple."""

    counts: tuple[tuple[str, int], ...]  # (verdict or DISAGREE, cells), worst first
    worst_judged_multiple: float | None

    @property
    def worst(self) -> str:
        """The state the heatmap colours by: a disagreement first, else the worst verdict."""
        names = [name for name, _ in self.counts]
        return DISAGREE if DISAGREE in names else names[0]

    @property
    def cells(self) -> int:
        return sum(n for _, n in self.counts)


@dataclass(frozen=True)
class KnownFailureGroup:
    """The cells of one (backend, operation) that one known failure covers, and the archs
    where it showed (the same cells with the same reason on several archs are one group)."""

    backend: str
    operation: str
    archs: tuple[str, ...]
    cells: tuple[str, ...]  # "format/dtype"
    reason: str


@dataclass(frozen=True)
class Summary:
    rows: tuple[SummaryKey, ...]
    columns: tuple[str, ...]
    entries: dict[tuple[SummaryKey, str], SummaryEntry]
    known_failures: tuple[KnownFailureGroup, ...]

    def entry(self, row: SummaryKey, arch: str) -> SummaryEntry | None:
        return self.entries.get((row, arch))


def _worst_multiple(values: Iterable[float]) -> float | None:
    present = list(values)
    if not present:
        return None
    return next((v for v in present if v != v), max(present))  # NaN is the worst of all


def summarize(matrix: Matrix, operation_of: Callable[[str], str] | None = None) -> Summary:
    """Fold the matrix's cells into one entry per (backend, operation) and column.
    ``operation_of``: the summary row an operation goes to (default: its own); the heatmap
    folds namespaced operations (``multi-gpu:matmul``) into their namespace's row. Known
    failures stay grouped by the cells' own operations."""
    grouped: dict[tuple[SummaryKey, str], list[tuple[CellKey, Entry]]] = {}
    for (row, arch), entry in matrix.entries.items():
        operation = row[1] if operation_of is None else operation_of(row[1])
        grouped.setdefault(((row[0], operation), arch), []).append((row, entry))
    entries: dict[tuple[SummaryKey, str], SummaryEntry] = {}
    known: dict[tuple[str, str, str, str], list[str]] = {}
    for key, found in grouped.items():
        counts: Counter[str] = Counter()
        judged = []
        for row, entry in found:
            verdict = entry.verdicts[0] if entry.agreed else DISAGREE
            counts[verdict] += 1
            if verdict in JUDGED and entry.worst_error_multiple is not None:
                judged.append(entry.worst_error_multiple)
            if verdict == Verdict.KNOWN_FAILURE:
                reason = entry.reasons[0] if entry.reasons else ""
                known.setdefault((row[0], row[1], key[1], reason), []).append(f"{row[2]}/{row[3]}")
        ordered = tuple(sorted(counts.items(), key=lambda kv: (kv[0] != DISAGREE, _order(kv[0]))))
        entries[key] = SummaryEntry(ordered, _worst_multiple(judged))
    rows = tuple(sorted({row for row, _ in entries}))
    archs_of: dict[tuple[str, str, tuple[str, ...], str], list[str]] = {}
    for (backend, operation, arch, reason), cells in known.items():
        archs_of.setdefault((backend, operation, tuple(sorted(cells)), reason), []).append(arch)
    groups = tuple(
        sorted(
            (
                KnownFailureGroup(b, op, tuple(sorted(archs, key=natural_key)), cells, reason)
                for (b, op, cells, reason), archs in archs_of.items()
            ),
            key=lambda g: (g.backend, g.operation, [natural_key(a) for a in g.archs], g.cells),
        )
    )
    return Summary(rows, matrix.columns, entries, groups)
