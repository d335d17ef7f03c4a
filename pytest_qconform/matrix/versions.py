"""Version floors and regressions, read off the merged matrix's per-version history.

Where reports of one arch were computed with different versions of a backend library,
each cell's history (``Entry.history``) says which version gave which verdict. A cell
*works* in a version when it passed there, and *fails* when it failed, crashed, timed
out or hit a known failure (not a pass); skipped, unavailable and not-claimed cells say
nothing about the version. Then, per arch and backend (and per operation, for the
heatmap; an "arch" here is a matrix column, ``model.target``: a CPU's ISA is part of it):

- **floor**: the lowest tested version from which on every cell that works in the newest
  version also worked in every newer tested version. It is a floor only when some cell
  failed below it; when every such cell worked in every tested version, there is none;
- **regression**: a cell that worked in a version A and fails in a later version B.

A floor is only as fine as the versions tested: ``>= 0.50.0`` means 0.49.2 failed and
0.50.0 worked, not that 0.49.3 fails. The matrix prints which versions were tested, and
which other versions (torch, Triton, CUDA/HIP, driver) differ between those runs, since
the change may be theirs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pytest_qconform.matrix.model import Entry, Matrix, natural_key, target
from pytest_qconform.report.cells import FAILING_VERDICTS
from pytest_qconform.report.run_report import RunReport
from pytest_qconform.report.versions import PROBE_KEYS, backend_version, version_key
from pytest_qconform.vocabulary import CellKey, Verdict

WORKS: frozenset[str] = frozenset({Verdict.PASS})
FAILS: frozenset[str] = FAILING_VERDICTS | {Verdict.KNOWN_FAILURE}


@dataclass(frozen=True)
class Regression:
    """One cell that worked in ``good`` and fails in the later ``bad``."""

    row: CellKey
    good: str | None
    bad: str | None
    verdict: str  # what it says in ``bad``


@dataclass(frozen=True)
class VersionRange:
    """What the versions of one backend on one arch (one operation, or all) say.

    ``versions``: the tested versions, oldest first. ``floor``: the version from which it
    works (None: no floor, see ``failing_below`` and ``failing_newest``).
    ``failing_below``: cells that failed below the floor. ``failing_newest``: cells
    that fail in the newest version (they have no floor).
    """

    arch: str
    backend: str
    operation: str | None
    versions: tuple[str | None, ...]
    floor: str | None
    failing_below: int
    failing_newest: int
    regressions: tuple[Regression, ...]
    known_newest: int = 0  # of failing_newest: known failures (listed in known_failures.toml)

    @property
    def compared(self) -> bool:
        return len(self.versions) > 1

    def floor_text(self) -> str:
        """``bitsandbytes >= 0.50.0``, or why there is none."""
        if not self.compared:
            return f"one version tested ({_v(self.versions[0]) if self.versions else '-'})"
        if self.floor is not None:
            return f"{self.backend} >= {self.floor}"
        return "none: what passes in the newest version passed in every tested version"

    def regressions_text(self, limit: int = 3) -> str:
        if not self.regressions:
            return "none"
        pairs: dict[tuple[str | None, str | None], int] = {}
        for found in self.regressions:
            pairs[(found.good, found.bad)] = pairs.get((found.good, found.bad), 0) + 1
        text = "; ".join(
            f"{n} cell{'s' if n > 1 else ''} passed in {_v(good)}, fail in {_v(bad)}"
            for (good, bad), n in sorted(pairs.items(), key=lambda kv: -kv[1])[:limit]
        )
        return text


def _v(version: str | None) -> str:
    return version if version is not None else "unknown version"


def _by_version(entry: Entry) -> list[tuple[str | None, str]]:
    """(version, state) oldest first, one per version: "fails" if any run of that version
    failed, else "works" if one passed; versions without evidence left out."""
    states: dict[str | None, str] = {}
    for version, verdict, _ in entry.history:
        if verdict in FAILS:
            states[version] = "fails"
        elif verdict in WORKS and states.get(version) != "fails":
            states[version] = "works"
    return sorted(states.items(), key=lambda item: version_key(item[0]))


def version_range(
    arch: str, backend: str, operation: str | None, entries: Iterable[tuple[CellKey, Entry]]
) -> VersionRange:
    """The floor and regressions of the given cells (one arch, one backend)."""
    entries = list(entries)
    versions = sorted({version for _, entry in entries for version, _, _ in entry.history}, key=version_key)
    floor_key, floor, failing_below, failing_newest, known_newest = None, None, 0, 0, 0
    regressions: list[Regression] = []
    for row, entry in entries:
        history = _by_version(entry)
        if not history:
            continue
        for (good, before), (bad, after) in zip(history, history[1:]):
            if before == "works" and after == "fails":
                regressions.append(Regression(row, good, bad, _verdict_in(entry, bad)))
        if history[-1][1] == "fails":
            failing_newest += 1
            known_newest += _verdict_in(entry, history[-1][0]) == Verdict.KNOWN_FAILURE
            continue
        since = len(history) - 1  # the oldest version of the run of "works" that reaches the newest
        while since > 0 and history[since - 1][1] == "works":
            since -= 1
        if since > 0:  # something failed below: a floor for this cell
            failing_below += 1
            key = version_key(history[since][0])
            if floor_key is None or key > floor_key:
                floor_key, floor = key, history[since][0]
    return VersionRange(
        arch,
        backend,
        operation,
        tuple(versions),
        floor,
        failing_below,
        failing_newest,
        tuple(regressions),
        known_newest,
    )


def _verdict_in(entry: Entry, version: str | None) -> str:
    """The worst failing verdict of ``version`` in the entry's history."""
    return next(verdict for v, verdict, _ in entry.history if v == version and verdict in FAILS)


def ranges(matrix: Matrix, by_operation: bool = False) -> tuple[VersionRange, ...]:
    """One VersionRange per (arch, backend), or per (arch, backend, operation)."""
    grouped: dict[tuple[str, str, str | None], list[tuple[CellKey, Entry]]] = {}
    for (row, arch), entry in matrix.entries.items():
        grouped.setdefault((arch, row[0], row[1] if by_operation else None), []).append((row, entry))
    found = [
        version_range(arch, backend, operation, sorted(entries))
        for (arch, backend, operation), entries in grouped.items()
    ]
    return tuple(sorted(found, key=lambda r: (natural_key(r.arch), r.backend, r.operation or "")))


def other_differences(matrix: Matrix, arch: str, backend: str) -> tuple[str, ...]:
    """The probe versions (torch, triton, ...) that differ between the runs of the column
    ``arch`` (a target: ``sm90``, ``x86_64 (AVX2)``) that hold cells of ``backend`` with
    different backend versions: ``torch 2.12.0 / 2.13.0``."""
    runs = [run for run in matrix.runs if target(run) == arch and any(c.backend == backend for c in run.cells)]
    if len({backend_version(run, backend) for run in runs}) < 2:
        return ()
    out = []
    for key in PROBE_KEYS:
        values = sorted({str(run.probe.get(key)) for run in runs if run.probe.get(key) is not None}, key=version_key)
        if len(values) > 1:
            out.append(f"{key} {' / '.join(values)}")
    revisions = contract_revisions(runs)
    if len(revisions) > 1:
        out.append(
            "contract revision "
            + " / ".join(
                "none" if r is None else str(r) for r in sorted(revisions, key=lambda r: -1 if r is None else r)
            )
        )
    return tuple(out)


def contract_revisions(runs: Iterable[RunReport]) -> dict[int | None, list[str]]:
    """Counted reports by the contract revision they were judged against (None: a report
    older than schema version 3, which does not say)."""
    found: dict[int | None, list[str]] = {}
    for run in runs:
        found.setdefault(run.suite.contract_revision if run.suite else None, []).append(run.label)
    return found
