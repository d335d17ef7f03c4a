"""The merged matrix as Markdown: the full per-cell table (reports/MATRIX.md) and the
one-screen summary for the README and a CI step summary, and the README's marked section.

Deterministic: the same reports give the same bytes.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from pytest_qconform.hardware.archs import KNOWN_ARCHS
from pytest_qconform.matrix.known_repros import NOT_RUN_PREFIX
from pytest_qconform.matrix.model import Entry, Matrix, MatrixError, device_label, known_archs, natural_key, target
from pytest_qconform.matrix.summary import DISAGREE, Summary, SummaryEntry, summarize
from pytest_qconform.matrix.versions import contract_revisions, other_differences, ranges
from pytest_qconform.report.atomic import write_text_atomically
from pytest_qconform.report.cells import VERDICTS
from pytest_qconform.report.sections import Section
from pytest_qconform.report.storage import COMMITTED
from pytest_qconform.report.tables import format_multiple
from pytest_qconform.vocabulary import Verdict

MARKER_START = "<!-- qconform-matrix:start -->"
MARKER_END = "<!-- qconform-matrix:end -->"
FULL_MATRIX = COMMITTED.matrix_markdown.as_posix()  # where nox -s matrix writes the full table; the README links it
SYMBOLS: dict[str, str] = {
    Verdict.PASS: "✅",
    Verdict.FAIL: "❌",
    Verdict.KNOWN_FAILURE: "⚠️",
    Verdict.CRASHED: "💥",
    Verdict.TIMEOUT: "⏱",
    Verdict.SKIPPED: "➖",
    Verdict.UNAVAILABLE: "🚫",
    Verdict.NOT_CLAIMED: "∅",
    DISAGREE: "≠",
}
LEGEND_WORDS: dict[str, str] = {
    "known-failure": "known failure",
    "not-claimed": "the backend claims nothing the check needs",
    DISAGREE: "runs of one target disagree",
}


def _md(text: Any) -> str:
    """A table cell: pipes escaped, newlines flattened."""
    return str(text).replace("\\", "\\\\").replace("|", "\\|").replace("\r", " ").replace("\n", " ")


def markdown_table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(_md(h) for h in header) + " |", "|" + "|".join(" --- " for _ in header) + "|"]
    lines.extend("| " + " | ".join(_md(v) for v in row) + " |" for row in rows)
    return lines


# Below this multiple of its worst-case bound a cell's error says little (the bound is loose
# by a factor that grows with K), so the cell also shows its ratio to torch's own dense op.
FAR_BELOW_THE_BOUND = 0.25


def _comparative(entry: Entry) -> str:
    """`` · 1.1× torch`` where the bound's multiple is far below 1 and a ratio was measured."""
    multiple, ratio = entry.worst_error_multiple, entry.worst_comparative_ratio
    if ratio is None or multiple is None or not multiple < FAR_BELOW_THE_BOUND:
        return ""
    return f" · {ratio:.2g}× torch"


def format_entry(entry: Entry | None) -> str:
    """``✅ 0.31``, or ``✅ 0.031 · 1.1× torch`` far below the bound (its error against torch's own
    dense op's); a disagreement ``❌ fail ×1 ≠ ✅ pass ×1 (2 runs)``; blank when no run covered it.
    Older backend versions that said something else follow: ``✅ 0.31 · 0.49.2 ❌``."""
    if entry is None:
        return ""
    if entry.agreed:
        verdict = entry.verdicts[0]
        multiple = "" if entry.worst_error_multiple is None else f" {format_multiple(entry.worst_error_multiple)}"
        text = f"{SYMBOLS[verdict]}{multiple}{_comparative(entry)}"
    else:
        distinct = sorted(set(entry.verdicts), key=VERDICTS.index)
        parts = [f"{SYMBOLS[v]} {v} ×{entry.verdicts.count(v)}" for v in distinct]
        text = " ≠ ".join(parts) + f" ({entry.runs} runs)"
    newest = set(entry.verdicts)
    older: dict[str, list[str]] = {}
    for version, verdict, source in entry.history:
        if source not in entry.sources and verdict not in newest:
            older.setdefault(str(version), []).append(SYMBOLS[verdict])
    return text + "".join(f" · {version} {''.join(sorted(set(marks)))}" for version, marks in older.items())


def accel_version(probe: dict[str, Any]) -> str:
    """``cuda 12.8, driver 570.1``, ``hip 6.4``, or ``-`` on a CPU (the Runs table and the page)."""
    driver = f", driver {probe['driver']}" if probe.get("driver") else ""
    if probe.get("hip"):
        return f"hip {probe['hip']}{driver}"
    if probe.get("cuda"):
        return f"cuda {probe['cuda']}{driver}"
    return "-"


def _versions_table(matrix: Matrix) -> list[str]:
    backends = sorted({name for run in matrix.runs for name in run.probe["backends"]})
    header = ["target", "host", "device", "torch", "triton", "cuda/hip", *backends, "suite", "created", "report"]
    stale = {id(run) for run in matrix.stale}
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
        suite = f"{run.suite.version} r{run.suite.contract_revision}" if run.suite else "-"
        rows.append(
            [
                target(run),
                run.host,
                device_label(p),
                str(p["torch"]),
                str(p.get("triton") or "-"),
                accel_version(p),
                *versions,
                suite,
                run.created + (" (stale)" if id(run) in stale else ""),
                f"`{run.label}`",
            ]
        )
    return markdown_table(header, rows)


def _symbol_words() -> str:
    """``✅ pass · ❌ fail · ...``: every verdict's symbol, then the disagreement's."""
    return " · ".join(f"{SYMBOLS[v]} {LEGEND_WORDS.get(v, v)}" for v in (*VERDICTS, DISAGREE))


def _legend() -> str:
    return (
        f"Legend: {_symbol_words()}. The number is the worst error as a multiple of its derived bound "
        "(≤ 1 is within bound); below 0.25, where the worst-case bound says little, `· 1.1× torch` follows: "
        "the error against torch's own dense op's on the same decoded weights at the 90th percentile "
        "(above 3 fails). A disagreement shows each verdict with its count. "
        "Blank: no run on that arch covered the row."
    )


NOT_RUN_SYMBOL = "·"


def section_lines(section: Section, run_archs: set[str]) -> list[str]:
    """A section's notes, and its rows for the archs without a run report: the tool's status in
    words, never a verdict."""
    out = []
    if section.notes:
        out += ["", f"**{section.notes_title}** ({section.source}):", "", *(f"- {note}" for note in section.notes)]
    rows = []
    for found in section.without_runs(run_archs):
        facts = KNOWN_ARCHS.get(found.arch)
        rows.append(
            [
                found.arch,
                facts.family if facts else "?",
                str(facts.wave_size) if facts else "?",
                f"{section.symbol if found.held else NOT_RUN_SYMBOL} {found.status}",
                f"{NOT_RUN_SYMBOL} not run",
            ]
        )
    if rows:
        out += [
            "",
            f"**{section.title}** (archs without a run report: {section.symbol} {section.explanation})",
            "",
            *markdown_table(["arch", "family", "wave", section.backend, "other backends"], rows),
        ]
    return out


def _notes(matrix: Matrix, sections: Sequence[Section]) -> list[str]:
    """Disagreements, archs without a report (with what the sections say of them),
    superseded and simulated reports."""
    out: list[str] = []
    disagreements = [
        (row, arch, e)
        for (row, arch), e in sorted(matrix.entries.items(), key=lambda kv: (kv[0][0], natural_key(kv[0][1])))
        if not e.agreed
    ]
    if disagreements:
        out += [
            "",
            "**Disagreements** (runs of the same target, an arch or a CPU's machine and vector ISA, that give "
            "different verdicts; neither is picked):",
            "",
        ]
        for row, arch, entry in disagreements:
            said = ", ".join(f"`{src}`: {v}" for v, src in zip(entry.verdicts, entry.sources))
            out.append(f"- {' · '.join(row)} on {arch}: {said}")

    run_archs = {run.arch for run in matrix.runs}
    missing = [arch for arch in sorted(known_archs(), key=natural_key) if arch not in run_archs]
    if missing:
        out += ["", "**Not run yet** (archs the project knows with no report): " + ", ".join(missing)]
    for section in sections:
        out += section_lines(section, run_archs)

    out += _contract_notes(matrix)
    out += _stale_entry_notes(matrix)
    if matrix.stale:
        out += [
            "",
            f"**Stale reports** (created more than {matrix.max_age_days:g} days before this merge; still "
            "counted: rerun them, or remove them if that runner is gone):",
            "",
        ]
        out += [f"- `{r.label}` ({target(r)}, created {r.created})" for r in matrix.stale]
    if matrix.empty:
        out += [
            "",
            "**Empty reports** (no judged cell, only not-claimed ones or none; not merged: a `--benchmark-only` run, a selection that matched "
            "nothing, or a backend that never loaded):",
            "",
        ]
        out += [
            f"- `{r.label}` ({target(r)}, {r.created})"
            + (f": {len(r.benchmarks)} benchmarks only" if r.benchmarks else ": nothing at all")
            for r in matrix.empty
        ]
    out += _retired_notes(matrix)
    if matrix.superseded:
        out += ["", "**Superseded reports** (a newer report of the same arch, host and versions counts instead):", ""]
        out += [
            f"- `{s.old.label}` ({s.old.created}), superseded by `{s.new.label}` ({s.new.created})"
            for s in matrix.superseded
        ]
    if matrix.partly_superseded:
        out += [
            "",
            "**Partly superseded reports** (a newer report of the same machine and the same version of a backend "
            "counts for that backend's cells; the older one still counts for its other backends):",
            "",
        ]
        out += [
            f"- `{old}`: {', '.join(backends)} superseded by `{new}`" for old, backends, new in matrix.partly_superseded
        ]
    if matrix.simulated:
        out += ["", "**Excluded simulated reports** (simulated probe: nothing was computed on the device):", ""]
        out += [f"- `{r.label}` ({target(r)}, {r.created})" for r in matrix.simulated]
    return out


def _retired_notes(matrix: Matrix) -> list[str]:
    """How many cells only older backend versions covered, per column, backend and version:
    not shown as current verdicts (``model.Retired``)."""
    counts: dict[tuple[str, str, str | None, str | None], int] = {}
    for r in matrix.retired:
        slot = (r.column, r.row[0], r.version, r.newest)
        counts[slot] = counts.get(slot, 0) + 1
    if not counts:
        return []
    out = [
        "",
        "**Cells only older versions covered** (not shown: the newest version of their backend tested on that "
        "column did not cover them, so an older version's verdict would read as the newest; rerun the older "
        "version's report or remove it):",
        "",
    ]
    out += [
        f"- {column}: {count} {backend} cells last covered by {version}, where {newest} is the newest tested"
        for (column, backend, version, newest), count in counts.items()
    ]
    return out


def _stale_entry_notes(matrix: Matrix) -> list[str]:
    """The known-failure entries a counted run found marking no collected test: stale or mistyped."""
    found: dict[tuple[str, str, str], list[str]] = {}
    for run in matrix.runs:
        for entry in run.stale_known_failures:
            found.setdefault((entry.source, entry.backend, entry.check), []).append(run.label)
    if not found:
        return []
    out = [
        "",
        "**Stale known failures** (entries of the known-failures files that marked no collected test in a run "
        "that had their backend, version and device: their test was renamed, a glob no longer matches, or the "
        "failure moved; remove or fix them):",
        "",
    ]
    out += [
        f"- `{source}` ({backend} · {check}): in {', '.join(f'`{label}`' for label in labels)}"
        for (source, backend, check), labels in sorted(found.items())
    ]
    return out


def _contract_notes(matrix: Matrix) -> list[str]:
    """Say so when the counted reports were judged against different contract revisions."""
    revisions = contract_revisions(matrix.runs)
    if len(revisions) < 2:
        return []
    out = [
        "",
        "**Different contract revisions** (the reports were judged against different sets of checks, bounds "
        "or axes: a verdict that differs between them may come from the contract, not the library; "
        "docs/report-schema.md lists what changed):",
        "",
    ]
    for revision in sorted(revisions, key=lambda r: -1 if r is None else r):
        said = "no revision (a report older than schema version 3)" if revision is None else f"revision {revision}"
        out.append(f"- {said}: " + ", ".join(f"`{label}`" for label in revisions[revision]))
    return out


def versions_markdown(matrix: Matrix) -> list[str]:
    """Per arch and backend tested with more than one version: the versions, the floor and
    the regressions (matrix_versions); one line when there is none."""
    found = [r for r in ranges(matrix) if r.compared]
    head = [
        "**Versions** (per arch and backend tested with several of its versions: the newest version's verdicts "
        "are shown above; a floor is the version from which every cell that passes now passed)",
        "",
    ]
    if not found:
        return head + ["Every arch and backend was tested with one version of it: no floor or regression to read."]
    rows = [
        [
            r.arch,
            r.backend,
            ", ".join(str(v) for v in r.versions),
            r.floor_text() + (f" ({r.failing_below} cells fail below)" if r.floor else ""),
            r.regressions_text(),
            f"{r.failing_newest} ({r.known_newest} known failures)",
            "; ".join(other_differences(matrix, r.arch, r.backend)) or "-",
        ]
        for r in found
    ]
    return head + markdown_table(
        [
            "arch",
            "backend",
            "versions tested",
            "works from",
            "regressions",
            "cells failing in the newest",
            "other versions that differ",
        ],
        rows,
    )


_NO_RUNS = (
    "No run reports merged yet: run `pytest --qconform` on a runner, commit its report under `reports/`, "
    "then `nox -s matrix`."
)


def _runs_and_summary(matrix: Matrix) -> list[str]:
    out = [
        "**Runs** (one row per counted report: the versions behind each column; a column is a target, a GPU's "
        "arch or a CPU's machine and the vector ISA torch dispatched to, as bitsandbytes takes other CPU paths "
        "on each)",
        "",
    ]
    out += _versions_table(matrix)
    out += ["", *versions_markdown(matrix)]
    out += ["", "**Summary** (operation × backend · arch; the newest backend version's verdicts)", ""]
    return out + summary_markdown(summarize(matrix))


def readme_markdown(matrix: Matrix, sections: Sequence[Section] = ()) -> str:
    """The README's section: runs, the one-screen summary, a link to the full table, notes.
    ``sections``: what tools other than runs know (``report.sections``), shown for archs without a run."""
    if not matrix.runs:
        return "\n".join([_NO_RUNS, *_notes(matrix, sections)]) + "\n"
    out = _runs_and_summary(matrix)
    out += ["", f"Every cell (backend · operation · format · dtype): [{FULL_MATRIX}]({FULL_MATRIX})."]
    return "\n".join(out + _notes(matrix, sections)) + "\n"


def to_markdown(matrix: Matrix, sections: Sequence[Section] = ()) -> str:
    """The full matrix (the summary, then every cell): deterministic (same reports, same bytes)."""
    if not matrix.runs:
        return "\n".join([_NO_RUNS, *_notes(matrix, sections)]) + "\n"
    out = _runs_and_summary(matrix)
    out += ["", "**Verdicts** (every cell, a section per backend: the README's table links each)"]
    header = ["backend", "operation", "format", "dtype", *matrix.columns]
    for backend in sorted({row[0] for row in matrix.rows}, key=natural_key):
        rows = [
            [*row, *(format_entry(matrix.entry(row, arch)) for arch in matrix.columns)]
            for row in matrix.rows
            if row[0] == backend
        ]
        out += ["", f"### {backend}", "", *markdown_table(header, rows)]
    if not matrix.rows:
        out += ["", "(the counted reports contain no cells)"]
    out += ["", _legend()]
    out += _coverage(matrix)
    out += _calls(matrix)
    return "\n".join(out + _notes(matrix, sections)) + "\n"


def _coverage(matrix: Matrix) -> list[str]:
    """Per run and backend: the checked instances of the checks with declared axes, the
    operations, how many value pairs were checked, and any claimed value left unchecked."""
    rows = []
    for report in matrix.runs:
        by_backend: dict[str, list] = {}
        for entry in report.coverage:
            by_backend.setdefault(entry.backend, []).append(entry)
        for backend, entries in sorted(by_backend.items()):
            unchecked = [
                f"{e.operation}: "
                + "; ".join(f"{axis} {', '.join(found)}" for axis, found in sorted(e.unchecked.items()))
                for e in entries
                if e.unchecked
            ]
            rows.append(
                [
                    report.arch,
                    backend,
                    str(sum(e.instances for e in entries)),
                    str(len(entries)),
                    str(sum(len(e.pairs) for e in entries)),
                    "<br>".join(unchecked) or "none",
                ]
            )
    if not rows:
        return []
    return [
        "",
        "**Coverage** (checks with declared axes: instances that ran to a verdict, operations, value "
        "pairs of two axes checked, and claimed values no instance checked)",
        "",
        *markdown_table(["arch", "backend", "instances", "operations", "pairs", "unchecked claimed values"], rows),
    ]


def _calls(matrix: Matrix) -> list[str]:
    """Per run and backend: the quantized-layer calls the call-site oracle judged inside the
    workloads, and every setting they were judged in (the words of the calls' context
    signatures, docs/watch.md)."""
    rows = []
    for report in matrix.runs:
        by_backend: dict[str, list] = {}
        for entry in report.calls:
            by_backend.setdefault(entry.backend, []).append(entry)
        for backend, entries in sorted(by_backend.items()):
            words = sorted({word for e in entries for signature in e.contexts for word in signature.split()})
            rows.append(
                [
                    report.arch,
                    backend,
                    str(len(entries)),
                    f"{sum(e.judged for e in entries)} of {sum(e.seen for e in entries)}",
                    str(sum(e.failed for e in entries)),
                    f"{len({s for e in entries for s in e.contexts})}: " + ", ".join(words),
                ]
            )
    if not rows:
        return []
    return [
        "",
        "**Calls judged inside workloads** (the call-site oracle: workload operations, calls judged of those "
        "made, failed calls, and the distinct contexts with every setting they were judged in)",
        "",
        *markdown_table(["arch", "backend", "workloads", "calls judged", "failed", "contexts"], rows),
    ]


_LINK_START = "known failure ("
_ENTRY_PLACE = re.compile(r" \[[^\[\]]*\]$")  # the entry's place, always last: `` [.../known_failures.toml:308]``


def known_failure_text(reason: str) -> tuple[str, str]:
    """(what, link) from a known failure's cell reason ``[NOTRUN] known failure (<link>): <what>
    [<entry's file:line>]``: ``what`` is the first sentence of the entry's reason, whole (a cut
    inside a clause reads as another claim: "absmax transposed to ("), without its full stop,
    pytest's ``[NOTRUN]`` or the entry's place."""
    rest = _ENTRY_PLACE.sub("", reason.removeprefix(NOT_RUN_PREFIX))
    link = ""
    if rest.startswith(_LINK_START):
        close = _closing(rest, len(_LINK_START) - 1)
        if close is not None and rest.startswith("): ", close):
            link, rest = rest[len(_LINK_START) : close], rest[close + 3 :]
    end = _closing(rest, None)
    return (rest[:end] if end is not None else rest.strip().removesuffix(".")), link


def _closing(text: str, start: int | None) -> int | None:
    """With ``start`` (an opening parenthesis): the index of its closing one. Without: the
    index of the first sentence's full stop (``. `` outside brackets). None when there is none."""
    depth = 0
    for i in range(start or 0, len(text)):
        depth += {"(": 1, "[": 1, ")": -1, "]": -1}.get(text[i], 0)
        if start is not None and depth == 0:
            return i
        if start is None and depth == 0 and text.startswith(". ", i):
            return i
    return None


def format_summary_entry(entry: SummaryEntry | None) -> str:
    """``✅ 22 ⚠️ 2 · 0.57``: cells per verdict, then the worst judged multiple; blank when no run covered it."""
    if entry is None:
        return ""
    parts = [f"{SYMBOLS.get(name, name)} {n}" for name, n in entry.counts]
    multiple = f" · {format_multiple(entry.worst_judged_multiple)}" if entry.worst_judged_multiple is not None else ""
    return " ".join(parts) + multiple


def summary_legend() -> str:
    return (
        "Each entry: how many of the backend's cells of that operation (one per format × dtype) ended in each "
        "verdict on that arch "
        f"({_symbol_words()}), then the worst error of the pass and fail cells as a multiple of its derived "
        "bound (≤ 1 is within bound). Blank: the backend has no cell of that operation on that arch (not claimed, "
        "or no run covered it)."
    )


def summary_markdown(summary: Summary) -> list[str]:
    """The summary table, its legend and the known failures, as Markdown lines."""
    if not summary.rows:
        return ["(the counted reports contain no cells)"]
    # One row per operation, one column per (backend, arch): the table grows with the
    # number of operations, not with backends x operations, so it stays one screen tall.
    backends = sorted({backend for backend, _ in summary.rows}, key=natural_key)
    operations = sorted({operation for _, operation in summary.rows}, key=natural_key)
    columns = [
        (backend, arch)
        for backend in backends
        for arch in summary.columns
        if any(summary.entry((backend, op), arch) is not None for op in operations)
    ]
    rows = [
        [operation, *(format_summary_entry(summary.entry((backend, operation), arch)) for backend, arch in columns)]
        for operation in operations
    ]
    out = markdown_table(["operation", *(f"{backend} · {arch}" for backend, arch in columns)], rows)
    out += ["", summary_legend()]
    if summary.known_failures:
        out += ["", "**Known failures** (listed in `known_failures.toml`; docs/findings.md):", ""]
        for group in summary.known_failures:
            what, link = known_failure_text(group.reason)
            source = f" ([source]({link.split(' ')[0]}))" if link.startswith("http") else ""
            not_run = "; not run: it would end the test process" if group.reason.startswith(NOT_RUN_PREFIX) else ""
            out.append(
                f"- {group.backend} · {group.operation} on {', '.join(group.archs)} ({len(group.cells)} cells: "
                f"{', '.join(group.cells)}): {what}{source}{not_run}"
            )
    return out


def update_readme(readme: Path, markdown: str) -> bool:
    """Replace the text between the matrix markers in ``readme``; returns whether it changed."""
    readme = Path(readme)
    try:
        text = readme.read_text(encoding="utf-8")
    except OSError as exc:
        raise MatrixError(f"{readme}: cannot read: {exc.strerror or exc}") from exc
    starts, ends = text.count(MARKER_START), text.count(MARKER_END)
    if starts != 1 or ends != 1:
        raise MatrixError(
            f"{readme}: expected exactly one {MARKER_START} and one {MARKER_END} line, found "
            f"{starts} and {ends}; add the pair where the matrix should go"
        )
    head, rest = text.split(MARKER_START)
    if MARKER_END in head:
        raise MatrixError(f"{readme}: {MARKER_END} comes before {MARKER_START}; swap them")
    tail = rest.split(MARKER_END)[1]
    new = f"{head}{MARKER_START}\n{markdown.strip(chr(10))}\n{MARKER_END}{tail}"
    if new == text:
        return False
    write_text_atomically(readme, new)
    return True
