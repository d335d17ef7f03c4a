"""What changed between the versions of a backend: per arch, each tested version's verdict
counts and the cells whose verdict differs between versions.

``matrix_versions`` reduces a backend's versions to a floor and regressions (works / fails);
a reader following a backend over its releases also wants the rest: which cells a new
version fixed, which moved from a plain failure to a listed known failure, which it broke.
Read off the merged model's per-version history (``Entry.history``), never the reports
again. A cell's verdict in a version is the worst verdict of that version's runs (history
is ordered worst first within a version); a cell that only one version covered (a check
added later) is counted in that version, not listed as changed.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pytest_qconform.matrix.model import Entry, Matrix, natural_key
from pytest_qconform.report.cells import VERDICTS
from pytest_qconform.report.versions import version_key
from pytest_qconform.vocabulary import CellKey


@dataclass(frozen=True)
class CellChange:
    """One cell whose verdict differs between the versions that covered it."""

    row: CellKey
    said: tuple[tuple[str | None, str], ...]  # (version, verdict), oldest version first

    @property
    def transition(self) -> tuple[str, ...]:
        """``("fail", "pass")``: the verdicts in version order, repeats folded."""
        out: list[str] = []
        for _, verdict in self.said:
            if not out or out[-1] != verdict:
                out.append(verdict)
        return tuple(out)


@dataclass(frozen=True)
class Trend:
    """One backend on one arch across the versions of it that the merged reports hold."""

    arch: str
    backend: str
    versions: tuple[str | None, ...]  # oldest first
    counts: tuple[tuple[tuple[str, int], ...], ...]  # per version: (verdict, cells), worst first
    changed: tuple[CellChange, ...]

    def transitions(self) -> tuple[tuple[tuple[str, ...], int], ...]:
        """(transition, cells) for each kind of change, most cells first."""
        found = Counter(change.transition for change in self.changed)
        return tuple(sorted(found.items(), key=lambda kv: (-kv[1], kv[0])))


def verdicts_by_version(entry: Entry) -> tuple[tuple[str | None, str], ...]:
    """(version, verdict) oldest first, one per version: the worst of that version's runs."""
    found: dict[str | None, str] = {}
    for version, verdict, _ in entry.history:
        if version not in found or VERDICTS.index(verdict) < VERDICTS.index(found[version]):
            found[version] = verdict
    return tuple(sorted(found.items(), key=lambda item: version_key(item[0])))


def trends(matrix: Matrix) -> tuple[Trend, ...]:
    """One Trend per (arch, backend) tested with more than one version, by arch then backend."""
    grouped: dict[tuple[str, str], list[tuple[CellKey, Entry]]] = {}
    for (row, arch), entry in matrix.entries.items():
        grouped.setdefault((arch, row[0]), []).append((row, entry))
    out = []
    for (arch, backend), entries in grouped.items():
        per_cell = [(row, verdicts_by_version(entry)) for row, entry in sorted(entries)]
        versions = sorted({version for _, said in per_cell for version, _ in said}, key=version_key)
        if len(versions) < 2:
            continue
        counts = []
        for version in versions:
            counted = Counter(verdict for _, said in per_cell for v, verdict in said if v == version)
            counts.append(tuple(sorted(counted.items(), key=lambda kv: VERDICTS.index(kv[0]))))
        changed = tuple(CellChange(row, said) for row, said in per_cell if len({verdict for _, verdict in said}) > 1)
        out.append(Trend(arch, backend, tuple(versions), tuple(counts), changed))
    return tuple(sorted(out, key=lambda t: (natural_key(t.arch), t.backend)))
