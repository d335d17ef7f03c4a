"""The reports folder's layout, known in this one place: the recorder, ``write_report``, the
matrix, the CI gate and noxfile.py ask a ``ReportsFolder`` where things go.

A folder of reports (``reports/`` in this repository, a run's ``--qconform-report-dir``)::

    <arch>-<host>-<UTC time>.json        one run report per run: the cells the matrix merges
    bench/<arch>-<host>-<UTC time>.json  a benchmark run (``nox -s bench``): timings, no cells,
    bench/<same stem>-bench.png          so not a matrix input; and its plot
    bench/<same stem>-dense.png          its matmuls over the dense bf16 layer's time (a GPU run's)
    sections/<tool>.json                 a tool's section of the matrix (report/sections.py: the
                                         Triton wing's compile check writes triton-nf4.json)
    MATRIX.md, matrix.png, site/         the merged matrix, its heatmap and its page

Imports only the standard library: noxfile.py asks it without importing the plugin.
"""

from __future__ import annotations

import datetime as _dt
import re
from dataclasses import dataclass
from pathlib import Path

FILENAME_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
LOCAL_REPORT_DIR = ".qconform/reports"  # a run's default folder (session/options.py): scratch, ignored by git
_LOCAL_IGNORE = "# Written by pytest-qconform: local run reports are not evidence (see README).\n*\n"


class NotOneReport(ValueError):
    """A folder that should hold one run's report holds none or several."""


def safe_filename_part(text: str) -> str:
    """Keep letters, digits, ``.``, ``_`` and ``-``; no leading dot (no hidden files)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")
    return cleaned or "unknown"


def report_filename(arch: str, host: str, created: _dt.datetime) -> str:
    """``<arch>-<host>-<YYYYmmddTHHMMSSZ>.json``."""
    return f"{safe_filename_part(arch)}-{safe_filename_part(host)}-{created.strftime(FILENAME_TIME_FORMAT)}.json"


@dataclass(frozen=True)
class ReportsFolder:
    """One folder of reports and what lies where in it (the module docstring draws it)."""

    root: Path

    @classmethod
    def for_run(cls, chosen: str, start: Path) -> ReportsFolder:
        """A run's folder: ``chosen`` (the option or ini value) taken from ``start``, where pytest
        was started. The default (``LOCAL_REPORT_DIR``) gets a ``.gitignore`` of ``*`` in its top
        folder, as ``.pytest_cache`` does: a project that runs us needs no ignore line of its own."""
        folder = Path(chosen)
        if Path(chosen) == Path(LOCAL_REPORT_DIR):
            top = start / Path(LOCAL_REPORT_DIR).parts[0]
            top.mkdir(parents=True, exist_ok=True)
            ignore = top / ".gitignore"
            if not ignore.exists():
                ignore.write_text(_LOCAL_IGNORE, encoding="utf-8")
        return cls(folder if folder.is_absolute() else start / folder)

    @property
    def bench(self) -> Path:
        return self.root / "bench"

    @property
    def sections(self) -> Path:
        return self.root / "sections"

    @property
    def matrix_markdown(self) -> Path:
        return self.root / "MATRIX.md"

    @property
    def heatmap(self) -> Path:
        return self.root / "matrix.png"

    @property
    def site(self) -> Path:
        return self.root / "site" / "index.html"

    def new_report_path(self, arch: str, host: str, created: _dt.datetime) -> Path:
        """Where a new run report goes (the folder created): a second report of the same arch,
        host and second gets a ``-1``, ``-2``... suffix rather than replacing the first."""
        self.root.mkdir(parents=True, exist_ok=True)
        name = report_filename(arch, host, created)
        path = self.root / name
        counter = 0
        while path.exists():
            counter += 1
            path = self.root / f"{name[: -len('.json')]}-{counter}.json"
        return path

    def matrix_inputs(self) -> list[Path]:
        """Every ``*.json`` the matrix reads, in every subfolder but ``bench/`` (benchmark runs
        hold timings, no cells: merged, they would only be empty reports). Sorted."""
        return sorted(p for p in self.root.rglob("*.json") if p.is_file() and self.bench not in p.parents)

    def the_run_report(self) -> Path:
        """The one run report of a run's own folder (the CI gate's input). NotOneReport when it
        holds none or several: a folder reused across runs keeps old reports, and an old one
        could pass a run that wrote none."""
        found = sorted(p for p in self.root.glob("*.json") if p.is_file())
        if len(found) != 1:
            names = ", ".join(p.name for p in found[:5]) + (", ..." if len(found) > 5 else "")
            raise NotOneReport(
                f"{self.root}: expected exactly one run report (*.json), found {len(found)}"
                + (f" ({names})" if found else "")
                + ". A folder reused across runs keeps old reports, and an old one could pass a run that wrote "
                "none: give each job a fresh --qconform-report-dir, or name the report file"
            )
        return found[0]

    def bench_plot(self, report: Path) -> Path:
        """A benchmark report's plot: ``<report stem>-bench.png`` beside it."""
        return report.with_name(f"{report.stem}-bench.png")

    def bench_dense_plot(self, report: Path) -> Path:
        """A benchmark report's plot against the dense bf16 layer: ``<report stem>-dense.png``."""
        return report.with_name(f"{report.stem}-dense.png")

    def bench_reports(self) -> list[Path]:
        """The benchmark runs' reports in ``bench/``, sorted."""
        return sorted(p for p in self.bench.glob("*.json") if p.is_file())


# This repository's folder, relative to the checkout: what ``nox -s matrix`` merges by default, and
# where the README's links point.
COMMITTED = ReportsFolder(Path("reports"))
