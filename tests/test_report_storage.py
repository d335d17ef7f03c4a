"""One owner of the reports folder's layout: ``report/storage.ReportsFolder``.

The recorder, ``write_report``, the matrix, the CI gate and noxfile.py ask it where a report
goes and which files are what; a second place that globs ``*.json`` or spells a file name of
the layout would drift from it (benchmark runs merged as empty reports, say).
"""

from __future__ import annotations

import datetime as _dt
import re
from pathlib import Path

import pytest

import pytest_qconform
from pytest_qconform.matrix import cli
from pytest_qconform.report.storage import LOCAL_REPORT_DIR, NotOneReport, ReportsFolder

CREATED = _dt.datetime(2026, 11, 26, 18, 0, 0, tzinfo=_dt.UTC)
CHECKOUT = Path(__file__).resolve().parent.parent


def _touch(path: Path, text: str = "{}") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def test_a_new_report_is_named_by_arch_host_and_time_and_never_replaces_one(tmp_path):
    folder = ReportsFolder(tmp_path / "new")
    first = _touch(folder.new_report_path("gfx1200", "runner 1/a", CREATED))
    second = folder.new_report_path("gfx1200", "runner 1/a", CREATED)
    assert first.name == "gfx1200-runner_1_a-20261126T180000Z.json"
    assert second.name == "gfx1200-runner_1_a-20261126T180000Z-1.json"


def test_the_matrix_reads_every_report_but_the_benchmark_runs(tmp_path):
    folder = ReportsFolder(tmp_path)
    run = _touch(tmp_path / "sm90-a-20261126T180000Z.json")
    nested = _touch(tmp_path / "ci" / "gfx942-b-20261126T180000Z.json")
    section = _touch(folder.sections / "triton-nf4.json")
    bench = _touch(folder.bench / "sm90-a-20261125T180000Z.json")
    assert folder.matrix_inputs() == sorted([run, nested, section])
    assert folder.bench_reports() == [bench]
    assert folder.bench_plot(bench) == folder.bench / "sm90-a-20261125T180000Z-bench.png"


def test_a_run_folder_must_hold_exactly_one_report(tmp_path):
    folder = ReportsFolder(tmp_path)
    with pytest.raises(NotOneReport, match="found 0"):
        folder.the_run_report()
    only = _touch(tmp_path / "a.json")
    assert folder.the_run_report() == only
    _touch(tmp_path / "b.json")
    with pytest.raises(NotOneReport, match=r"found 2 \(a.json, b.json\).*fresh --qconform-report-dir"):
        folder.the_run_report()


def test_a_run_folder_is_taken_from_where_pytest_started_and_the_default_ignores_itself(tmp_path):
    assert ReportsFolder.for_run("out", tmp_path).root == tmp_path / "out"
    assert not (tmp_path / ".qconform").exists()
    assert ReportsFolder.for_run(LOCAL_REPORT_DIR, tmp_path).root == tmp_path / LOCAL_REPORT_DIR
    assert (tmp_path / ".qconform" / ".gitignore").read_text(encoding="utf-8").endswith("*\n")


def test_nox_matrix_says_nothing_of_the_committed_benchmark_runs(capsys):
    """A clean clone's ``nox -s matrix`` merged reports/bench/'s runs as 4 empty reports, with a
    warning each that a newcomer could do nothing about: they are no matrix input."""
    assert cli.main([str(CHECKOUT / "reports")]) == 0
    err = capsys.readouterr().err
    assert "empty report" not in err and "bench" not in err


def test_no_other_module_knows_the_layout():
    """No module of the core but storage.py globs for reports or spells a file name of the layout."""
    package = Path(pytest_qconform.__file__).parent
    spelled = re.compile(
        r"""\.r?glob\(\s*["']\*\.json|["'][\w./-]*(MATRIX\.md|matrix\.png|index\.html|-bench\.png)["'](?!\w)"""
    )
    knowing = [
        f"{path.relative_to(package)}:{n}"
        for path in sorted([*package.rglob("*.py"), CHECKOUT / "noxfile.py"])
        if path.name != "storage.py" and path.relative_to(CHECKOUT).parts[:2] != ("pytest_qconform", "compile")
        for n, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1)
        if spelled.search(line)
    ]
    assert knowing == []
