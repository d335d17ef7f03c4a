"""The README's compact matrix (``matrix/readme_table.py``): one row per backend, one screen.

It says, per arch, how many cells passed, are known failures or failed, and the floor; each
backend links to its section of MATRIX.md. The committed README holds what ``nox -s matrix``
writes from the committed reports.
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

from test_matrix_versions import ROWS, run

from pytest_qconform.matrix.markdown import MARKER_END, MARKER_START, to_markdown
from pytest_qconform.matrix.model import find_report_files, merge
from pytest_qconform.matrix.readme_table import readme_table, section_anchor
from pytest_qconform.report.cells import Cell
from pytest_qconform.report.run_report import RunReport, read_report

CHECKOUT = Path(__file__).resolve().parent.parent
NOW = _dt.datetime(2026, 11, 25, tzinfo=_dt.UTC)


def test_a_box_counts_pass_known_fail_and_says_the_floor():
    matrix = merge(
        [
            run("0.49.2", ["fail", "pass", "pass"]),
            run("0.50.0", ["pass", "known-failure", "pass"]),
            run("0.50.0", ["fail", "crashed", "pass"], arch="sm90", host="h100"),
        ],
        now=NOW,
    )
    lines = readme_table(matrix).splitlines()
    assert lines[:3] == [
        "| backend | gfx1100 | sm90 |",
        "| --- | --- | --- |",
        "| [bitsandbytes](reports/MATRIX.md#bitsandbytes) | 2 pass · 1 known · 0 fail · ≥ 0.50.0 "
        "| 1 pass · 0 known · 2 fail |",
    ]


def test_a_backend_that_could_not_run_says_so_and_nothing_else():
    cells = tuple(Cell(*row, verdict="unavailable", reason="unavailable: gemlite is not installed") for row in ROWS)
    matrix = merge([RunReport(run("0.50.0", []).probe, cells, "2026-11-20T00:00:00Z")], now=NOW)
    assert "| [bitsandbytes](reports/MATRIX.md#bitsandbytes) | 3 unavailable |" in readme_table(matrix)


def test_every_backend_links_to_its_section_of_the_full_matrix():
    matrix = merge([run("0.50.0", ["pass", "pass", "pass"])], now=NOW)
    full = to_markdown(matrix)
    for anchor in re.findall(r"\]\(reports/MATRIX\.md#([^)]+)\)", readme_table(matrix)):
        assert any(section_anchor(line[4:]) == anchor for line in full.splitlines() if line.startswith("### "))


def test_the_committed_readme_holds_the_committed_reports_table_in_one_screen():
    """``nox -s matrix`` rewrites it: a report added without running it shows here."""
    readme = (CHECKOUT / "README.md").read_text(encoding="utf-8")
    table = readme.split(MARKER_START + "\n")[1].split(MARKER_END)[0]
    reports = [read_report(p) for p in find_report_files([CHECKOUT / "reports"]) if "sections" not in p.parts]
    assert table == readme_table(merge(reports)), "run nox -s matrix and commit README.md"
    assert len(table.splitlines()) <= 30
