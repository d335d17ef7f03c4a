"""A section of the matrix that a tool, not a run, writes: what is known of one backend on
archs that may have no run report (public API).

Why: a backend's own tools can know something of an arch no runner has computed on (our
Triton wing's compile check compiles its kernels for every listed arch on a CPU: "compiled,
not run"). The matrix shows that beside the verdicts without knowing the tool: the tool
writes this record (JSON, ``"kind": "qconform-section"``) into the reports folder, and
``nox -s matrix`` renders every section it finds there. A section never carries a verdict:
an arch with a run report shows the run's cells; the section shows only the archs without
one, and its ``notes`` (what holds whatever the runs say).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

KIND = "qconform-section"
SCHEMA_VERSION = 1


class SectionError(ValueError):
    """A file that says it is a section but cannot be read as one."""


@dataclass(frozen=True)
class ArchStatus:
    """What the tool found for one arch, in words (``compiled, not run (346 variants of 4
    kernels)``); ``held``: whether its check held there (a ``symbol`` row, else "not run")."""

    arch: str
    held: bool
    status: str


@dataclass(frozen=True)
class Section:
    """One backend's evidence beside the runs.

    ``title`` heads the rows of the archs without a run (``Compiled, not run``) and
    ``explanation`` says what a held row means; ``symbol`` marks such a row. ``notes`` are
    lines shown whatever the runs, under ``notes_title``. ``source`` names the tool and its
    version (``the compile check, Triton 3.9.0``)."""

    backend: str
    source: str
    title: str
    explanation: str
    symbol: str
    archs: tuple[ArchStatus, ...]
    notes_title: str = ""
    notes: tuple[str, ...] = ()

    def without_runs(self, run_archs: set[str] | frozenset[str]) -> tuple[ArchStatus, ...]:
        """The section's archs that no run report covers, in the section's order."""
        return tuple(a for a in self.archs if a.arch not in run_archs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "schema_version": SCHEMA_VERSION,
            "backend": self.backend,
            "source": self.source,
            "title": self.title,
            "explanation": self.explanation,
            "symbol": self.symbol,
            "archs": [{"arch": a.arch, "held": a.held, "status": a.status} for a in self.archs],
            "notes_title": self.notes_title,
            "notes": list(self.notes),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Section:
        return cls(
            str(data["backend"]),
            str(data["source"]),
            str(data["title"]),
            str(data["explanation"]),
            str(data["symbol"]),
            tuple(ArchStatus(str(a["arch"]), bool(a["held"]), str(a["status"])) for a in data["archs"]),
            str(data.get("notes_title", "")),
            tuple(str(n) for n in data.get("notes", ())),
        )


def is_section_file(path: Path) -> bool:
    """Whether ``path`` is a JSON file whose ``"kind"`` says it is a section."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False  # not a section: whoever reads it next names the problem
    return isinstance(data, dict) and data.get("kind") == KIND


def read_section(path: Path) -> Section:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        if not isinstance(data, dict) or data.get("kind") != KIND:
            raise SectionError(f'no "kind": "{KIND}"')
        if data.get("schema_version") != SCHEMA_VERSION:
            raise SectionError(f"schema_version {data.get('schema_version')!r}, this reader reads {SCHEMA_VERSION}")
        return Section.from_dict(data)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SectionError(f"{path}: cannot read a matrix section: {exc}") from None


def write_section(section: Section, path: Path) -> None:
    """Keys sorted, one line per arch: the same section gives the same bytes."""
    data = section.to_dict()
    archs = data.pop("archs")
    head = json.dumps(data, sort_keys=True, ensure_ascii=False)[:-1]
    lines = ",\n".join(json.dumps(a, sort_keys=True, ensure_ascii=False) for a in archs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head}, "archs": [\n{lines}\n]}}\n', encoding="utf-8")
