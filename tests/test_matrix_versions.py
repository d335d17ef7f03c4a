"""Versions in the matrix: newest verdict, floors, regressions, contract revisions, stale
and empty reports, and the gate's --min-version, on synthetic reports."""

from __future__ import annotations

import datetime as _dt
import json
from pathlib import Path

import pytest

from pytest_qconform.hardware.probe import gpu_driver_version
from pytest_qconform.matrix.cli import main, merge
from pytest_qconform.matrix.heatmap import box_label, versions_label
from pytest_qconform.matrix.markdown import format_entry, to_markdown
from pytest_qconform.matrix.summary import summarize
from pytest_qconform.matrix.versions import ranges
from pytest_qconform.report import gate
from pytest_qconform.report.cells import Cell
from pytest_qconform.report.contract import CONTRACT_REVISION, Suite, current_suite
from pytest_qconform.report.run_report import RunReport, read_report, write_report
from pytest_qconform.report.versions import MinVersion, at_least, cell_versions

ROWS = [("bitsandbytes", "matmul", f"nf4-b{b}", "fp16") for b in (64, 128)] + [
    ("bitsandbytes", "dequantize", "nf4-b64", "fp16")
]


def probe(bnb: str, arch: str = "gfx1100", host: str = "rdna3", torch: str = "2.13.0", **extra) -> dict:
    return {
        "device_kind": "rocm",
        "arch": arch,
        "device_name": "Radeon",
        "host": host,
        "torch": torch,
        "cuda": None,
        "hip": "6.4",
        "simulated": False,
        "triton": "3.6.0",
        **extra,
        "backends": {"bitsandbytes": {"available": True, "version": bnb, "reason": ""}},
    }


def run(
    bnb: str, verdicts: list[str], created: str = "2026-11-20T00:00:00Z", revision: int | None = 1, **probe_args
) -> RunReport:
    cells = tuple(Cell(*row, verdict=v) for row, v in zip(ROWS, verdicts))
    suite = Suite("pytest-qconform", "0.1.0", revision) if revision else None
    return RunReport(probe(bnb, **probe_args), cells, created, source=f"bnb-{bnb}-{created[:10]}.json", suite=suite)


NOW = _dt.datetime(2026, 11, 25, tzinfo=_dt.UTC)


def test_the_newest_backend_version_gives_the_verdict_and_older_ones_stay_visible() -> None:
    m = merge(
        [
            run("0.50.0", ["pass", "pass", "pass"], "2026-11-01T00:00:00Z"),
            run("0.49.2", ["fail", "pass", "pass"], "2026-11-20T00:00:00Z"),
        ],
        now=NOW,
    )
    entry = m.entry(ROWS[0], "gfx1100")
    assert entry.verdicts == ("pass",) and entry.agreed  # the newer version, though the older report is newer
    assert [(v, verdict) for v, verdict, _ in entry.history] == [("0.49.2", "fail"), ("0.50.0", "pass")]
    assert format_entry(entry) == "✅ · 0.49.2 ❌"
    assert summarize(m).entry(("bitsandbytes", "matmul"), "gfx1100").counts == (("pass", 2),)


def test_a_floor_is_read_where_older_versions_fail() -> None:
    m = merge(
        [
            run("0.49.2", ["fail", "crashed", "pass"]),
            run("0.50.0", ["pass", "pass", "pass"]),
            run("0.48.3", ["fail", "fail", "pass"]),
        ],
        now=NOW,
    )
    (found,) = ranges(m)
    assert found.versions == ("0.48.3", "0.49.2", "0.50.0")
    assert found.floor == "0.50.0" and found.floor_text() == "bitsandbytes >= 0.50.0"
    assert found.failing_below == 2 and found.regressions == ()
    text = to_markdown(m)
    assert (
        "| gfx1100 | bitsandbytes | 0.48.3, 0.49.2, 0.50.0 | bitsandbytes >= 0.50.0 (2 cells fail below) | none |"
        in text
    )
    per_operation = {r.operation: r for r in ranges(m, by_operation=True)}
    assert versions_label(per_operation["matmul"]) == "≥ 0.50.0"
    assert versions_label(per_operation["dequantize"]) == "same in all versions"


def test_versions_that_agree_give_no_floor_and_say_so() -> None:
    m = merge(
        [run("0.49.2", ["pass", "known-failure", "pass"]), run("0.50.0", ["pass", "known-failure", "pass"])], now=NOW
    )
    (found,) = ranges(m)
    assert found.floor is None and found.floor_text().startswith("none:")
    assert found.failing_newest == found.known_newest == 1


def test_a_regression_names_the_last_good_and_the_first_bad_version() -> None:
    m = merge(
        [
            run("0.48.3", ["pass", "pass", "pass"]),
            run("0.49.2", ["pass", "pass", "pass"]),
            run("0.50.0", ["fail", "pass", "known-failure"]),
        ],
        now=NOW,
    )
    (found,) = ranges(m)
    assert [(r.row, r.good, r.bad, r.verdict) for r in found.regressions] == [
        (ROWS[2], "0.49.2", "0.50.0", "known-failure"),
        (ROWS[0], "0.49.2", "0.50.0", "fail"),
    ]
    assert found.regressions_text() == "2 cells passed in 0.49.2, fail in 0.50.0"
    assert "0.49.2 ✓ → 0.50.0 ✗" in box_label(
        summarize(m).entry(("bitsandbytes", "matmul"), "gfx1100"),
        next(r for r in ranges(m, True) if r.operation == "matmul"),
    )


def test_skipped_cells_say_nothing_about_a_version() -> None:
    m = merge([run("0.49.2", ["skipped", "unavailable", "pass"]), run("0.50.0", ["pass", "pass", "pass"])], now=NOW)
    (found,) = ranges(m)
    assert found.floor is None and found.regressions == ()


def test_other_versions_that_differ_are_named_beside_the_floor() -> None:
    m = merge(
        [
            run("0.49.2", ["fail", "pass", "pass"], torch="2.12.0", revision=None),
            run("0.50.0", ["pass", "pass", "pass"]),
        ],
        now=NOW,
    )
    text = to_markdown(m)
    assert "torch 2.12.0 / 2.13.0; contract revision none / 1 |" in text
    assert "**Different contract revisions**" in text
    assert "- no revision (a report older than schema version 3): `bnb-0.49.2-2026-11-20.json`" in text


def test_one_version_per_arch_says_there_is_nothing_to_read() -> None:
    text = to_markdown(merge([run("0.50.0", ["pass", "pass", "pass"])], now=NOW))
    assert "Every arch and backend was tested with one version of it" in text
    assert "Different contract revisions" not in text


def test_stale_reports_are_merged_and_flagged_empty_ones_flagged_and_left_out() -> None:
    old = run("0.50.0", ["pass", "pass", "pass"], "2026-09-01T00:00:00Z")
    empty = RunReport(probe("0.50.0", host="other"), (), "2026-11-24T00:00:00Z", source="empty.json")
    m = merge([old, empty], max_age_days=30, now=NOW)
    assert m.runs == (old,) and m.stale == (old,) and m.empty == (empty,)
    text = to_markdown(m)
    assert "**Stale reports** (created more than 30 days before this merge" in text
    assert "2026-09-01T00:00:00Z (stale)" in text
    assert "- `empty.json` (gfx1100, 2026-11-24T00:00:00Z): nothing at all" in text
    assert merge([old], max_age_days=100, now=NOW).stale == ()


def test_a_newer_report_of_only_not_claimed_cells_does_not_supersede_a_conformance_run() -> None:
    """A --benchmark-only run of the same machine and versions writes only not-claimed
    cells: it once superseded the H100 conformance report and emptied its column."""
    conformance = run("0.50.0", ["pass", "fail", "pass"], "2026-11-20T00:00:00Z")
    bench_only = run("0.50.0", ["not-claimed"] * 3, "2026-11-21T00:00:00Z")
    m = merge([conformance, bench_only], now=NOW)
    assert m.runs == (conformance,) and m.empty == (bench_only,) and m.superseded == ()


def test_the_cli_warns_about_stale_and_empty_reports_and_notes_mixed_contracts(tmp_path: Path, capsys) -> None:
    """Mixed contract revisions are said once, in the matrix's notes: a warning on every merge of
    a clean clone told its user of committed reports they can do nothing about."""
    write_report(run("0.49.2", ["fail", "pass", "pass"], "2020-01-01T00:00:00Z", revision=None), tmp_path)
    write_report(run("0.50.0", ["pass", "pass", "pass"], host="b"), tmp_path)
    write_report(RunReport(probe("0.50.0", host="c"), (), "2026-11-24T00:00:00Z", suite=current_suite()), tmp_path)
    assert main([str(tmp_path), "--max-age-days", "3650", "--out", str(tmp_path / "M.md")]) == 0
    err = capsys.readouterr().err
    assert "warning: stale" not in err and "warning: empty report" in err and "contract revision" not in err
    assert "**Different contract revisions**" in (tmp_path / "M.md").read_text(encoding="utf-8")
    assert main([str(tmp_path), "--max-age-days", "7", "--out", str(tmp_path / "M.md")]) == 0
    assert "warning: stale report" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--max-age-days", "-1"])


def test_a_report_says_which_suite_and_contract_judged_it(tmp_path: Path) -> None:
    report = run("0.50.0", ["pass", "pass", "pass"])
    data = json.loads(write_report(report, tmp_path).read_text())
    assert data["schema_version"] == 3
    assert data["suite"] == {"name": "pytest-qconform", "version": "0.1.0", "contract_revision": 1}
    assert read_report(tmp_path / f"{report.arch}-{report.host}-20261120T000000Z.json").suite == report.suite
    assert current_suite().contract_revision == CONTRACT_REVISION


@pytest.mark.parametrize(
    "change, message",
    [
        ({"suite": None}, "report.suite: expected a JSON object"),
        (
            {"suite": {"name": "pytest-qconform", "version": "0.1.0", "contract_revision": "1"}},
            "report.suite.contract_revision: Input should be a valid integer, got str '1'",
        ),
        ({"schema_version": 2}, "report.suite: not part of schema_version 2"),
        ({"suite": "drop"}, "missing field 'suite' (required since schema_version 3"),
    ],
)
def test_a_malformed_suite_is_an_error_naming_the_field(tmp_path: Path, change: dict, message: str) -> None:
    data = run("0.50.0", ["pass"]).to_dict()
    data.update(change)
    if data.get("suite") == "drop":
        del data["suite"]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json: .*" + message.replace("(", r"\(").replace("'", ".")):
        read_report(path)


def test_cells_refer_to_their_reports_versions() -> None:
    report = run("0.50.0", ["pass"], driver="580.1")
    assert cell_versions(report, "bitsandbytes") == {
        "bitsandbytes": "0.50.0",
        "torch": "2.13.0",
        "triton": "3.6.0",
        "cuda": None,
        "hip": "6.4",
        "driver": "580.1",
    }


def test_the_driver_version_is_read_from_the_file_the_driver_publishes(tmp_path: Path) -> None:
    nvidia = tmp_path / "nvidia"
    nvidia.write_text("NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build\n")
    amd = tmp_path / "amdgpu"
    amd.write_text("6.12.12\n")
    files = {"cuda": str(nvidia), "rocm": str(amd)}
    assert gpu_driver_version("cuda", files) == "580.159.04"
    assert gpu_driver_version("rocm", files) == "6.12.12"
    assert gpu_driver_version("rocm", {"rocm": str(tmp_path / "absent")}) is None


@pytest.mark.parametrize(
    "found, minimum, expected",
    [
        ("0.50.0", "0.50.0", True),
        ("0.50.2", "0.50.0", True),
        ("0.49.2", "0.50.0", False),
        (None, "0.1", False),
        ("weird-build", "0.1", False),
        ("2.13.0+cpu", "2.13", True),
    ],
)
def test_at_least_compares_pep440_versions(found, minimum, expected) -> None:
    assert at_least(found, minimum) is expected


@pytest.mark.parametrize("text", ["bitsandbytes", "bitsandbytes=", "=0.5", "bitsandbytes=newest"])
def test_min_version_needs_package_and_version(text: str) -> None:
    with pytest.raises(ValueError, match="--min-version"):
        MinVersion.parse(text)


def test_the_gate_judges_only_cells_of_at_least_the_minimum_version(tmp_path: Path, capsys) -> None:
    old = write_report(run("0.49.2", ["fail", "pass", "pass"], host="a"), tmp_path / "a")
    new = write_report(run("0.50.0", ["pass", "pass", "pass"], host="b"), tmp_path / "b")
    assert gate.main([str(old), str(new)]) == 1  # the old version's failure counts without --min-version
    capsys.readouterr()
    assert gate.main([str(old), str(new), "--min-version", "bitsandbytes=0.50.0"]) == 0
    out = capsys.readouterr().out
    assert f"{old} (gfx1100): left out: no cell computed with bitsandbytes >= 0.50.0 (bitsandbytes 0.49.2 in" in out
    assert f"{new} (gfx1100): 3 pass: ok" in out


def test_the_gate_fails_clearly_when_no_cell_meets_the_minimum(tmp_path: Path, capsys) -> None:
    old = write_report(run("0.49.2", ["pass", "pass", "pass"]), tmp_path)
    assert gate.main([str(old), "--min-version", "bitsandbytes=0.50.0"]) == 1
    assert "no cell was computed with bitsandbytes >= 0.50.0 (bitsandbytes 0.49.2 in" in capsys.readouterr().err
    assert gate.main([str(old), "--min-version", "torch=2.13"]) == 0  # a probe version applies to every cell
    assert gate.main([str(old), "--min-version", "nonsense"]) == 2


def test_the_matrix_lists_known_failure_entries_a_run_found_stale(tmp_path: Path) -> None:
    """Stale in the matrix too: the report keeps the entries that marked no collected test."""
    import dataclasses

    from pytest_qconform.matrix.markdown import to_markdown
    from pytest_qconform.report.stale_entries import StaleEntry

    stale = StaleEntry("pytest_qconform/session/known_failures.toml:173", "bitsandbytes", "checkpoint", "absmax ...")
    report = dataclasses.replace(run("0.50.0", ["pass", "pass", "pass"]), stale_known_failures=(stale,))
    back = read_report(write_report(report, tmp_path))
    assert back.stale_known_failures == (stale,)
    text = to_markdown(merge([back], now=NOW))
    assert "**Stale known failures**" in text
    assert f"- `{stale.source}` (bitsandbytes · checkpoint): in `{back.label}`" in text


def test_a_cell_only_an_older_version_covered_is_not_shown_as_the_newest_verdict() -> None:
    """A report of bitsandbytes 0.49.2 that failed a cell the 0.50.2 run no longer makes must
    not read as the column's current word (129 cells did once); it is listed instead, and
    it disappears with the older report."""
    old = run("0.49.2", ["pass", "pass", "fail"], "2026-11-01T00:00:00Z")
    new = run("0.50.2", ["pass", "pass"], "2026-11-20T00:00:00Z")
    m = merge([old, new])
    dequantize = ROWS[2]
    assert m.entry(dequantize, "gfx1100") is None and dequantize not in m.rows
    assert [(r.row, r.column, r.version, r.newest) for r in m.retired] == [(dequantize, "gfx1100", "0.49.2", "0.50.2")]
    assert m.entry(ROWS[0], "gfx1100").verdicts == ("pass",)
    text = to_markdown(m)
    assert "- gfx1100: 1 bitsandbytes cells last covered by 0.49.2, where 0.50.2 is the newest tested" in text
    assert merge([new]).retired == ()


def test_a_newer_report_supersedes_an_older_ones_cells_of_the_backends_it_ran_at_the_same_version() -> None:
    """Two runs of one machine, bitsandbytes 0.50.2 in both, gemlite carried to the first only:
    the runs are different machine keys (the backends' versions differ), yet the first's
    bitsandbytes cells are an older measurement of the same thing, so they no longer count
    (they read as 'runs disagree' once the suite had changed between the runs); its gemlite
    cells still do, the only ones there are."""
    gemlite_row = ("hqq-gemlite", "matmul", "hqq4-b64", "fp16")

    def with_gemlite(report: RunReport, version: str | None, verdict: str) -> RunReport:
        probe_ = dict(report.probe)
        probe_["backends"] = {
            **probe_["backends"],
            "hqq-gemlite": {"available": version is not None, "version": version, "reason": ""},
        }
        cells = (*report.cells, Cell(*gemlite_row, verdict=verdict))
        return RunReport(probe_, cells, report.created, source=report.label, suite=report.suite)

    older = with_gemlite(run("0.50.2", ["pass", "known-failure", "pass"], "2026-11-20T00:00:00Z"), "0.6.0", "pass")
    newer = with_gemlite(run("0.50.2", ["pass", "pass", "pass"], "2026-11-21T00:00:00Z"), None, "unavailable")
    m = merge([older, newer])
    assert m.superseded == ()
    assert m.entry(ROWS[1], "gfx1100").verdicts == ("pass",)  # the newer run's alone: no disagreement
    assert m.entry(gemlite_row, "gfx1100").verdicts == ("pass",)  # the older run's gemlite verdict
    assert m.partly_superseded == ((older.label, ("bitsandbytes",), newer.label),)
    assert f"- `{older.label}`: bitsandbytes superseded by `{newer.label}`" in to_markdown(m)
