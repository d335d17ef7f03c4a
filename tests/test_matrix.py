"""The merged matrix: supersede, disagreement, simulated exclusion, determinism, outputs, CLI."""

from __future__ import annotations

import hashlib
import json
import random
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_qconform.matrix import model as matrix_mod
from pytest_qconform.matrix.cli import MatrixError, main, merge
from pytest_qconform.matrix.heatmap import render_heatmap
from pytest_qconform.matrix.markdown import MARKER_END, MARKER_START, readme_markdown, to_markdown, update_readme
from pytest_qconform.matrix.summary import summarize
from pytest_qconform.report.run_report import RunReport, read_report, write_report

ROW = ("bitsandbytes", "matmul", "nf4-b64-dq", "bf16")
OTHER_ROW = ("hqq", "dequantize", "hqq4-g64", "fp16")
THIRD_ROW = ("triton-nf4", "matmul", "nf4-b64", "bf16")


def probe(
    arch: str = "sm90", host: str = "h100-a", torch: str = "2.13.0", simulated: bool = False, bnb: str = "0.50.2"
) -> dict:
    rocm = arch.startswith("gfx")
    return {
        "device_kind": "rocm" if rocm else "cuda",
        "arch": arch,
        "device_name": f"device {arch}",
        "host": host,
        "torch": torch,
        "cuda": None if rocm else "12.8",
        "hip": "6.4" if rocm else None,
        "simulated": simulated,
        "backends": {
            "bitsandbytes": {"available": True, "version": bnb, "reason": ""},
            "hqq": {"available": True, "version": "0.2.8", "reason": ""},
        },
    }


def cell(row: tuple[str, str, str, str] = ROW, verdict: str = "pass", multiple: float | None = 0.31) -> dict:
    backend, operation, fmt, dtype = row
    failing = verdict in ("fail", "crashed", "timeout")
    return {
        "backend": backend,
        "operation": operation,
        "format": fmt,
        "dtype": dtype,
        "verdict": verdict,
        "cases": 3,
        "worst_error_multiple": multiple,
        "first_failure": {"message": "out of bound", "repro": "pytest -k x"} if failing else None,
        "reason": "" if verdict == "pass" or failing else "because",
    }


def report(
    created: str = "2025-01-31T12:00:00Z", cells: list[dict] | None = None, source: str = "", **probe_args
) -> RunReport:
    data = {
        "schema": "pytest-qconform/report",
        "schema_version": 1,
        "created": created,
        "probe": probe(**probe_args),
        "cells": cells if cells is not None else [cell()],
    }
    return RunReport.from_dict(data, source=source)


def save(folder: Path, rep: RunReport) -> Path:
    return write_report(rep, folder)


# ---------------------------------------------------------------- merge


def test_merge_makes_sorted_rows_and_arch_columns():
    m = merge(
        [
            report(arch="sm90", cells=[cell(OTHER_ROW), cell(ROW)]),
            report(arch="gfx942", host="mi300", cells=[cell(ROW, "fail", 4.2)]),
            report(arch="sm100", host="b200"),
        ]
    )
    assert m.rows == (ROW, OTHER_ROW)
    assert m.columns == ("gfx942", "sm90", "sm100")  # natural order: sm90 before sm100
    assert m.entry(ROW, "gfx942").verdicts == ("fail",)
    assert m.entry(OTHER_ROW, "gfx942") is None
    text = to_markdown(m)
    assert "| bitsandbytes | matmul | nf4-b64-dq | bf16 | ❌ 4.2 | ✅ 0.31 | ✅ 0.31 |" in text
    assert "| hqq | dequantize | hqq4-g64 | fp16 |  | ✅ 0.31 |  |" in text


def test_versions_table_shows_each_columns_versions():
    text = to_markdown(merge([report(arch="gfx942", host="mi300", torch="2.12.0"), report()]))
    assert (
        "| target | host | device | torch | triton | cuda/hip | bitsandbytes | hqq | suite | created | report |" in text
    )
    assert "| gfx942 | mi300 | device gfx942 | 2.12.0 | - | hip 6.4 | 0.50.2 | 0.2.8 | - |" in text
    assert "| sm90 | h100-a | device sm90 | 2.13.0 | - | cuda 12.8 | 0.50.2 | 0.2.8 | - |" in text


def test_same_machine_and_versions_newer_report_supersedes_older_visibly():
    old = report("2025-01-01T00:00:00Z", [cell(verdict="fail", multiple=9.0)], source="reports/old.json")
    new = report("2025-02-01T00:00:00Z", [cell(verdict="pass")], source="reports/new.json")
    m = merge([new, old])
    assert m.runs == (new,)
    assert [(s.old.label, s.new.label) for s in m.superseded] == [("old.json", "new.json")]
    assert m.entry(ROW, "sm90").verdicts == ("pass",)  # the older fail does not count
    text = to_markdown(m)
    assert "`old.json` (2025-01-01T00:00:00Z), superseded by `new.json` (2025-02-01T00:00:00Z)" in text
    assert "≠" not in text.split("**Verdicts**")[1].split("Legend")[0]


def test_a_run_on_more_devices_does_not_supersede_a_one_device_run():
    """A two-GPU run (its multi-device cells) beside a one-GPU run of the same host and
    versions: both count, and the one-device run's cells stay in the matrix."""
    one = report("2025-01-01T00:00:00Z", [cell()], source="one.json")
    two = report("2025-02-01T00:00:00Z", [cell(OTHER_ROW)], source="two.json")
    two.probe["device_count"] = 2
    m = merge([one, two])
    assert m.superseded == () and len(m.runs) == 2
    assert m.entry(ROW, "sm90").verdicts == ("pass",) and m.entry(OTHER_ROW, "sm90").verdicts == ("pass",)


def cpu_report(created: str, cells: list[dict], capability: str | None, host: str = "h100-a") -> RunReport:
    """A CPU run's report on x86_64; ``capability``: the vector ISA torch dispatched to (None:
    a report older than the probe's ``cpu_capability``)."""
    run = report(created, cells, source=f"{capability}-{host}-{created[:10]}.json", arch="x86_64", host=host)
    run.probe.update(device_kind="cpu", device_name="x86_64", cuda=None, cpu_capability=capability)
    return run


def test_cpu_runs_on_two_vector_isas_are_two_targets_that_do_not_disagree():
    """bitsandbytes' CPU kernels take other paths on AVX512 and AVX2, and its known failures
    are scoped to AVX512: two runs of one host and versions on the two ISAs are two columns
    (the committed reports' 93 "runs disagree" cells were this), neither supersedes the other,
    and each column says its own verdict, in MATRIX.md, the summary, the README table and the
    heatmap's boxes. A newer run on one ISA still supersedes that ISA's older run."""
    from pytest_qconform.matrix.readme_table import readme_table

    runs = [
        cpu_report("2025-01-01T00:00:00Z", [cell(verdict="known-failure")], "AVX512"),
        cpu_report("2025-02-01T00:00:00Z", [cell(verdict="pass")], "AVX2"),
    ]
    m = merge(runs)
    assert m.columns == ("x86_64 (AVX2)", "x86_64 (AVX512)") and m.superseded == () and len(m.runs) == 2
    assert m.entry(ROW, "x86_64 (AVX512)").verdicts == ("known-failure",)
    assert m.entry(ROW, "x86_64 (AVX2)").verdicts == ("pass",)
    assert all(entry.agreed for entry in m.entries.values())
    assert m.arch_of("x86_64 (AVX2)") == "x86_64" and m.arch_of("sm90") == "sm90"
    text = to_markdown(m)
    assert not [line for line in text.splitlines() if line.startswith("|") and "≠" in line]
    assert "**Disagreements**" not in text
    assert "| bitsandbytes | matmul | nf4-b64-dq | bf16 | ✅ 0.31 | ⚠️ 0.31 |" in text
    assert (
        "| x86_64 (AVX512) | h100-a | x86_64 (AVX512) |" in text
        and "| x86_64 (AVX2) | h100-a | x86_64 (AVX2) |" in text
    )
    assert "| operation | bitsandbytes · x86_64 (AVX2) | bitsandbytes · x86_64 (AVX512) |" in text
    table = readme_table(m)
    assert table.startswith("| backend | x86_64 (AVX2) | x86_64 (AVX512) |\n") and "disagree ·" not in table
    assert [e.worst for e in summarize(m).entries.values()] == ["pass", "known-failure"]
    same = cpu_report("2025-03-01T00:00:00Z", [cell()], "AVX2")
    assert [(s.old.label, s.new.label) for s in merge([*runs, same]).superseded] == [(runs[1].label, same.label)]


def test_two_runs_of_one_isa_that_differ_still_disagree():
    """ "Runs disagree" keeps its meaning inside a target: two AVX2 runs (two hosts, so both
    count) with other verdicts for a cell show both, named, in the AVX2 column only."""
    m = merge(
        [
            cpu_report("2025-01-01T00:00:00Z", [cell(verdict="fail", multiple=3.0)], "AVX2", host="a"),
            cpu_report("2025-01-02T00:00:00Z", [cell(verdict="pass")], "AVX2", host="b"),
            cpu_report("2025-01-03T00:00:00Z", [cell(verdict="pass")], "AVX512", host="a"),
        ]
    )
    assert not m.entry(ROW, "x86_64 (AVX2)").agreed and m.entry(ROW, "x86_64 (AVX512)").agreed
    text = to_markdown(m)
    assert "- bitsandbytes · matmul · nf4-b64-dq · bf16 on x86_64 (AVX2): `AVX2-a-2025-01-01.json`: fail" in text
    assert "on x86_64 (AVX512)" not in text
    assert summarize(m).entry(ROW[:2], "x86_64 (AVX2)").worst == "disagree"


def test_a_cpu_report_without_its_isa_is_the_plain_machines_column():
    """A CPU report older than the probe's ``cpu_capability`` does not say which ISA it ran on:
    it is neither ISA's measurement, so it gets the plain machine's column (``x86_64``) and
    disagrees with no ISA's run. A GPU's column stays its arch, though its host's ISA is
    recorded too (the kernels a backend launches are chosen per arch)."""
    gpu = report("2025-01-01T00:00:00Z", [cell()], source="gpu.json")
    gpu.probe["cpu_capability"] = "AVX512"
    m = merge(
        [
            cpu_report("2025-01-01T00:00:00Z", [cell(verdict="fail", multiple=2.0)], None),
            cpu_report("2025-01-02T00:00:00Z", [cell(verdict="pass")], "AVX2"),
            gpu,
        ]
    )
    assert m.columns == ("sm90", "x86_64", "x86_64 (AVX2)") and m.superseded == ()
    assert all(entry.agreed for entry in m.entries.values())
    assert m.entry(ROW, "x86_64").verdicts == ("fail",) and m.entry(ROW, "x86_64 (AVX2)").verdicts == ("pass",)
    assert "| x86_64 | h100-a | x86_64 |" in to_markdown(m)


@pytest.mark.parametrize("differs", [{"host": "h100-b"}, {"torch": "2.12.0"}])  # bnb versions: test_matrix_versions
def test_different_host_or_versions_both_count_and_disagreement_is_shown(differs):
    first = report("2025-01-01T00:00:00Z", [cell(verdict="pass")], source="a.json")
    second = report("2025-02-01T00:00:00Z", [cell(verdict="fail", multiple=3.0)], source="b.json", **differs)
    m = merge([first, second])
    assert len(m.runs) == 2 and m.superseded == ()
    entry = m.entry(ROW, "sm90")
    assert not entry.agreed and entry.verdicts == ("fail", "pass") and entry.sources == ("b.json", "a.json")
    text = to_markdown(m)
    assert "❌ fail ×1 ≠ ✅ pass ×1 (2 runs)" in text
    assert "- bitsandbytes · matmul · nf4-b64-dq · bf16 on sm90: `b.json`: fail, `a.json`: pass" in text


def test_agreeing_runs_show_one_verdict_and_the_worst_multiple():
    m = merge([report(cells=[cell(multiple=0.2)]), report(host="h100-b", cells=[cell(multiple=0.7)])])
    entry = m.entry(ROW, "sm90")
    assert entry.agreed and entry.runs == 2 and entry.worst_error_multiple == 0.7
    assert "| ✅ 0.7 |" in to_markdown(m)


def test_simulated_reports_are_excluded_with_a_note():
    sim = report(
        arch="gfx1200",
        host="simulated",
        simulated=True,
        source="gfx1200-sim.json",
        cells=[cell(verdict="skipped", multiple=None)],
    )
    m = merge([report(), sim])
    assert m.columns == ("sm90",) and m.simulated == (sim,)
    text = to_markdown(m)
    assert "**Excluded simulated reports**" in text and "`gfx1200-sim.json` (gfx1200, 2025-01-31T12:00:00Z)" in text
    assert "| gfx1200 |" not in text
    assert "gfx1200" in text.split("**Not run yet**")[1].splitlines()[0]  # still not run for real


def test_not_run_yet_lists_known_archs_without_reports(monkeypatch):
    monkeypatch.setattr("pytest_qconform.matrix.markdown.known_archs", lambda: ("sm80", "gfx1201", "sm90"))
    text = to_markdown(merge([report()]))
    assert "**Not run yet** (archs the project knows with no report): gfx1201, sm80\n" in text  # sm90 ran


def test_known_archs_come_from_the_archs_module():
    from pytest_qconform.hardware.archs import KNOWN_ARCHS

    assert matrix_mod.known_archs() == tuple(KNOWN_ARCHS)


def test_empty_merge_says_so():
    text = to_markdown(merge([]))
    assert text.startswith("No run reports merged yet")
    assert "**Not run yet**" in text


def test_markdown_escapes_pipes_in_cells():
    text = to_markdown(merge([report(host="a|b")]))
    assert "a\\|b" in text and "| a|b |" not in text


# ---------------------------------------------------------------- determinism


def many_reports() -> list[RunReport]:
    return [
        report("2025-01-01T00:00:00Z", [cell(), cell(OTHER_ROW, "known-failure", 1.5)], source="r/1.json"),
        report("2025-01-02T00:00:00Z", [cell(verdict="crashed", multiple=None)], source="r/2.json"),
        report("2025-01-03T00:00:00Z", [cell(verdict="timeout", multiple=None)], source="r/3.json", host="h100-b"),
        report(
            "2025-01-01T00:00:00Z",
            [cell(ROW, "unavailable", None), cell(OTHER_ROW, "skipped", None)],
            source="r/4.json",
            arch="gfx1100",
            host="navi",
        ),
        report("2025-01-01T00:00:00Z", [cell()], source="r/5.json", arch="gfx1200", simulated=True),
        report(
            "2025-01-01T00:00:00Z",
            [cell(verdict="fail", multiple=float("inf")), cell(OTHER_ROW, "known-failure", 1.5)],
            source="r/6.json",
            arch="gfx942",
            host="mi300",
        ),
    ]


def test_markdown_is_identical_twice_and_under_shuffled_input():
    reports = many_reports()
    expected = to_markdown(merge(reports))
    assert to_markdown(merge(reports)) == expected
    rng = random.Random(1234)
    for _ in range(10):
        shuffled = reports[:]
        rng.shuffle(shuffled)
        assert to_markdown(merge(shuffled)) == expected
    # The content is what the shuffle must preserve, not trivially empty.
    assert "💥" in expected and "⏱" in expected and "🚫" in expected and "➖" in expected and "⚠️ 1.5" in expected
    assert "❌ inf" in expected and "r/2.json" not in expected and "`2.json`" in expected


def test_heatmap_png_is_written_and_deterministic(tmp_path):
    pytest.importorskip("matplotlib")
    reports = many_reports()
    first = render_heatmap(merge(reports), tmp_path / "a" / "matrix.png")
    second = render_heatmap(merge(list(reversed(reports))), tmp_path / "b.png")
    data = first.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 1000
    assert hashlib.sha256(data).digest() == hashlib.sha256(second.read_bytes()).digest()
    assert b"Software" not in data and b"matplotlib" not in data.lower()
    assert sorted(p.name for p in tmp_path.rglob("*") if p.is_file()) == ["b.png", "matrix.png"]  # no temp files
    empty = render_heatmap(merge([]), tmp_path / "empty.png")
    assert empty.read_bytes().startswith(b"\x89PNG")


def png_size(path: Path) -> tuple[int, int]:
    """A PNG's width and height in pixels (its IHDR chunk)."""
    return struct.unpack(">II", path.read_bytes()[16:24])


def test_the_committed_reports_heatmap_is_at_most_max_height_px_tall(tmp_path):
    """reports/matrix.png was 4136 pixels tall (40 rows a panel): a README reader scrolled
    through it. With namespaced operations folded it must stay within MAX_HEIGHT_PX, with a
    column per target (AVX512 and AVX2 apart)."""
    pytest.importorskip("matplotlib")
    from pytest_qconform.matrix.heatmap import MAX_HEIGHT_PX
    from pytest_qconform.matrix.model import find_report_files

    folder = Path(__file__).resolve().parent.parent / "reports"
    reports = [read_report(p) for p in find_report_files([folder]) if "sections" not in p.parts]
    m = merge(reports)
    assert {"x86_64 (AVX512)", "x86_64 (AVX2)"} <= set(m.columns)
    height = png_size(render_heatmap(m, tmp_path / "matrix.png"))[1]
    assert height <= MAX_HEIGHT_PX, f"the heatmap is {height} px tall; fold more of it (heatmap.py's docstring)"


def test_a_family_of_operations_is_one_heatmap_row_however_many_it_holds(tmp_path):
    """``workload:generate``, ``workload:serving``, ...: one row per namespace and backend, whose
    box sums the family's cells and is coloured by their worst verdict, so a suite that adds
    checks to a family does not add height; each operation keeps its own row in MATRIX.md."""
    pytest.importorskip("matplotlib")
    from pytest_qconform.matrix.heatmap import heatmap_row, row_label

    def family(n: int) -> list[RunReport]:
        cells = [cell(("hqq", "matmul", "hqq4-g64", "bf16"))]
        cells += [
            cell(("hqq", f"workload:w{i}", "hqq4-g64", "bf16"), "known-failure" if i == 1 else "pass") for i in range(n)
        ]
        return [report(cells=cells)]

    heights = [png_size(render_heatmap(merge(family(n)), tmp_path / f"{n}.png"))[1] for n in (1, 12)]
    assert heights[0] == heights[1]
    folded = summarize(merge(family(12)), operation_of=heatmap_row).entry(("hqq", "workload"), "sm90")
    assert folded.counts == (("known-failure", 1), ("pass", 11)) and folded.worst == "known-failure"
    assert row_label("workload", {f"workload:w{i}" for i in range(12)}) == "workload: 12 operations"
    assert row_label("workload", {"workload:w0"}) == "workload:w0"  # one: its own name
    assert row_label("matmul", {"matmul"}) == "matmul" and heatmap_row("matmul") == "matmul"
    assert "| hqq | workload:w11 | hqq4-g64 | bf16 |" in to_markdown(merge(family(12)))


# ---------------------------------------------------------------- README


README = f"# proj\n\nintro\n\n## Compatibility matrix\n\n{MARKER_START}\nold table\n{MARKER_END}\n\n## After\n"


def test_update_readme_replaces_only_between_markers(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    assert update_readme(readme, "| new | table |\n") is True
    assert readme.read_text(encoding="utf-8") == README.replace("old table", "| new | table |")
    before = readme.read_bytes()
    assert update_readme(readme, "| new | table |\n") is False
    assert readme.read_bytes() == before


@pytest.mark.parametrize(
    "text, problem",
    [
        ("# no markers\n", "found 0 and 0"),
        (f"{MARKER_START}\nonly start\n", "found 1 and 0"),
        (f"{MARKER_START}\n{MARKER_END}\n{MARKER_START}\n{MARKER_END}\n", "found 2 and 2"),
        (f"{MARKER_END}\n{MARKER_START}\n", "comes before"),
    ],
)
def test_update_readme_names_the_file_when_markers_are_wrong(tmp_path, text, problem):
    readme = tmp_path / "README.md"
    readme.write_text(text, encoding="utf-8")
    with pytest.raises(MatrixError, match=problem) as info:
        update_readme(readme, "x")
    assert str(info.value).startswith(f"{readme}: ")
    assert readme.read_text(encoding="utf-8") == text


# ---------------------------------------------------------------- CLI


def test_cli_writes_all_outputs_and_is_idempotent(tmp_path, monkeypatch):
    reports_dir = tmp_path / "reports" / "nested"
    for rep in many_reports():
        save(reports_dir, rep)
    readme = tmp_path / "README.md"
    readme.write_text(README, encoding="utf-8")
    summary = tmp_path / "summary.md"
    monkeypatch.setenv("GITHUB_STEP_SUMMARY", str(summary))
    args = [
        str(tmp_path / "reports"),
        "--readme",
        str(readme),
        "--out",
        str(tmp_path / "out" / "MATRIX.md"),
        "--step-summary",
    ]
    assert main(args) == 0
    markdown = (tmp_path / "out" / "MATRIX.md").read_text(encoding="utf-8")
    assert "**Summary**" in markdown and "**Verdicts** (every cell" in markdown
    in_readme = readme.read_text(encoding="utf-8")
    assert "| backend |" in in_readme and "**Summary**" not in in_readme  # the README gets the compact table
    assert "[reports/MATRIX.md](reports/MATRIX.md)" in in_readme
    step = summary.read_text(encoding="utf-8")
    assert (
        step.startswith("## qconform compatibility matrix\n") and "**Summary**" in step and "**Verdicts**" not in step
    )
    readme_bytes = readme.read_bytes()
    assert main(args) == 0
    assert readme.read_bytes() == readme_bytes
    assert (tmp_path / "out" / "MATRIX.md").read_text(encoding="utf-8") == markdown


def test_cli_bad_report_exits_2_naming_file_and_problem(tmp_path, capsys):
    save(tmp_path, report())
    bad = tmp_path / "zz-bad.json"
    bad.write_text(json.dumps({"schema": "pytest-qconform/report", "schema_version": 7}), encoding="utf-8")
    assert main([str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1
    assert str(bad) in err[0] and "schema_version 7 is newer" in err[0]


def test_cli_ignore_invalid_skips_with_a_warning(tmp_path, capsys):
    save(tmp_path, report())
    (tmp_path / "broken.json").write_text("{", encoding="utf-8")
    assert main([str(tmp_path), "--ignore-invalid"]) == 0
    captured = capsys.readouterr()
    assert "warning: skipping bad report" in captured.err and "broken.json: truncated JSON" in captured.err
    assert "| ✅ 0.31 |" in captured.out  # no outputs named: the markdown goes to stdout


@pytest.mark.parametrize(
    "args, problem",
    [
        (["{missing}"], "no such file or folder"),
        (["{dir}", "--step-summary"], "GITHUB_STEP_SUMMARY is not set"),
        (["{dir}", "--readme", "{dir}/NOREADME.md"], "NOREADME.md: cannot read"),
    ],
)
def test_cli_usage_errors_exit_2(tmp_path, monkeypatch, capsys, args, problem):
    monkeypatch.delenv("GITHUB_STEP_SUMMARY", raising=False)
    save(tmp_path, report())
    argv = [a.format(dir=tmp_path, missing=tmp_path / "missing") for a in args]
    assert main(argv) == 2
    assert problem in capsys.readouterr().err


def test_python_dash_m_runs_the_cli(tmp_path):
    path = save(tmp_path, report())
    done = subprocess.run(
        [sys.executable, "-m", "pytest_qconform.matrix.cli", str(path), "--png", str(tmp_path / "m.png")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "m.png").read_bytes().startswith(b"\x89PNG")
    assert "merged 1 report(s) from 1 file(s)" in done.stderr
    bad = tmp_path / "bad.json"
    bad.write_text("[]", encoding="utf-8")
    done = subprocess.run(
        [sys.executable, "-m", "pytest_qconform.matrix.cli", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 2 and f"{bad}: top level: expected a JSON object" in done.stderr


def test_reports_written_then_read_keep_their_file_label(tmp_path):
    path = save(tmp_path, report())
    assert read_report(path).label == path.name


def test_supersede_ties_are_decided_by_content_not_input_order():
    a = report("2025-01-01T00:00:00Z", [cell(verdict="pass")])
    b = report("2025-01-01T00:00:00Z", [cell(verdict="fail", multiple=2.0)])
    assert to_markdown(merge([a, b])) == to_markdown(merge([b, a]))
    assert len(merge([a, b]).superseded) == 1


# ---------------------------------------------------------------- summary

KNOWN_REASON = (
    "known failure (https://example.invalid/bnb/ops.py (dequantize_4bit, cpu kernel)): the CPU kernel "
    "reads absmax per row, so blocks that start mid-row get a neighbour's absmax [pytest-qconform]"
)


def test_summary_counts_verdicts_per_backend_operation_and_arch():
    rows = [("bnb", "dequantize", f"nf4-b{b}", d) for b in (64, 128) for d in ("bf16", "fp32")]
    known = {**cell(rows[3], "known-failure", 6.7e6), "reason": KNOWN_REASON}
    reports = [
        report(cells=[cell(rows[0], multiple=0.5), cell(rows[1], multiple=0.9), cell(rows[2], "fail", 3.0), known]),
        report(arch="x86_64", host="cpu", cells=[known, cell(rows[0], multiple=0.25)]),
    ]
    summary = summarize(merge(reports))
    assert summary.rows == (("bnb", "dequantize"),) and summary.columns == ("sm90", "x86_64")
    entry = summary.entry(("bnb", "dequantize"), "sm90")
    assert entry.counts == (("fail", 1), ("known-failure", 1), ("pass", 2)) and entry.cells == 4
    assert entry.worst_judged_multiple == 3.0  # the known failure's 6.7e6 belongs to its bug, named below
    assert entry.worst == "fail"
    text = readme_markdown(merge(reports))
    assert "| operation | bnb · sm90 | bnb · x86_64 |" in text  # a row per operation, a column per backend and arch
    assert "| dequantize | ❌ 1 ⚠️ 1 ✅ 2 · 3 | ⚠️ 1 ✅ 1 · 0.25 |" in text
    # One known failure on two archs with the same cells is one line, its first sentence whole, with its source.
    assert (
        "- bnb · dequantize on sm90, x86_64 (1 cells: nf4-b128/fp32): the CPU kernel reads absmax per row, "
        "so blocks that start mid-row get a neighbour's absmax ([source](https://example.invalid/bnb/ops.py))"
    ) in text


def test_summary_counts_disagreements_and_unknown_statuses_by_name():
    """A new status (another engineer's "compiled, not run", say) is counted, not dropped."""
    m = merge(
        [
            report(cells=[cell(verdict="pass")], source="a.json"),
            report(host="h100-b", cells=[cell(verdict="fail", multiple=2.0)], source="b.json"),
        ]
    )
    entry = summarize(m).entry(ROW[:2], "sm90")
    assert entry.counts == (("disagree", 1),) and entry.worst == "disagree"
    from pytest_qconform.matrix.cli import Entry, Matrix
    from pytest_qconform.matrix.markdown import format_summary_entry

    odd = Matrix((ROW,), ("gfx1200",), {(ROW, "gfx1200"): Entry(("compiled",), ("c.json",), None)}, (), (), ())
    odd_entry = summarize(odd).entry(ROW[:2], "gfx1200")
    assert odd_entry.counts == (("compiled", 1),) and format_summary_entry(odd_entry) == "compiled 1"


def test_readme_section_fits_a_screen_however_many_cells(tmp_path):
    """The README summary and the heatmap grow with backends x operations x archs, not with
    formats x dtypes: 240 cells make the same number of summary lines and the same image
    size as 2."""
    pytest.importorskip("matplotlib")
    pairs = [(b, op) for b in ("bitsandbytes", "hqq") for op in ("dequantize", "matmul")]
    small = [report(cells=[cell((b, op, "nf4-b64", "bf16")) for b, op in pairs])]
    many = [
        report(
            cells=[
                cell((b, op, f"nf4-b{2**k}", d))
                for b, op in pairs
                for k in range(5, 25)
                for d in ("bf16", "fp16", "fp32")
            ]
        )
    ]
    assert len(readme_markdown(merge(many)).splitlines()) <= len(readme_markdown(merge(small)).splitlines()) + 2
    sizes = []
    for name, reports in (("small", small), ("many", many)):
        data = render_heatmap(merge(reports), tmp_path / f"{name}.png").read_bytes()
        sizes.append(struct.unpack(">II", data[16:24]))  # the PNG's IHDR width and height
    assert sizes[0] == sizes[1] and sizes[0][0] <= 1000


# ---------------------------------------------------------------- words a reader meets


def test_a_known_failure_reads_as_its_whole_first_sentence():
    """MATRIX.md cut "absmax transposed to [K/blocksize, N] ..." at its bracket, and showed
    pytest's raw "[NOTRUN]" and a link left in place when the link held nested parentheses."""
    from pytest_qconform.matrix.markdown import known_failure_text

    reason = (
        "known failure (https://x/functional.py (quantize_4bit: offset = absmax.mean())): a checkpoint holds "
        "absmax transposed to [K/blocksize, N] in bf16 (plain), or re-quantized; reloaded, it decodes "
        "to other weights. Seen on sm90. [pytest_qconform/session/known_failures.toml:173]"
    )
    what = (
        "a checkpoint holds absmax transposed to [K/blocksize, N] in bf16 (plain), or re-quantized; "
        "reloaded, it decodes to other weights"
    )
    assert known_failure_text(reason) == (what, "https://x/functional.py (quantize_4bit: offset = absmax.mean())")
    assert known_failure_text(f"[NOTRUN] {reason}") == known_failure_text(reason)
    assert known_failure_text("no link, no full stop [a.toml:1]") == ("no link, no full stop", "")


def test_the_committed_matrix_shows_no_raw_notrun_and_no_cut_reason():
    matrix = (Path(__file__).resolve().parent.parent / "reports" / "MATRIX.md").read_text(encoding="utf-8")
    known = matrix.split("**Known failures**")[1].split("\n\n")[1]
    assert "[NOTRUN]" not in known and "known failure (" not in known
    assert "transposed to ([source]" not in known


def test_the_heatmap_says_each_verdict_in_matrix_words():
    """Its boxes said "n/a" where MATRIX.md says unavailable: a word is the verdict's, at most
    shortened to its first word."""
    from pytest_qconform.matrix.heatmap import WORDS
    from pytest_qconform.vocabulary import Verdict

    for verdict in Verdict:
        assert verdict.value.startswith(WORDS[verdict].replace(" ", "-")), (verdict, WORDS[verdict])


def test_a_cell_far_below_its_bound_shows_its_ratio_to_torch():
    """Issue 50: where the worst-case bound says little (a multiple far below 1), MATRIX.md's
    cell shows the comparative ratio the run recorded (its error against torch's own dense op's
    on the same decoded weights); a cell near its bound, or without a ratio, shows none."""
    from pytest_qconform.matrix.markdown import format_entry

    far = {**cell(ROW, "pass", 0.031), "worst_comparative_ratio": 1.3}
    near = {**cell(OTHER_ROW, "pass", 0.6), "worst_comparative_ratio": 2.0}
    m = merge([report(arch="sm90", cells=[far, near, cell(THIRD_ROW, "pass", 0.02)])])
    assert format_entry(m.entries[(ROW, "sm90")]) == "✅ 0.031 · 1.3× torch"
    assert format_entry(m.entries[(OTHER_ROW, "sm90")]) == "✅ 0.6"
    assert format_entry(m.entries[(THIRD_ROW, "sm90")]) == "✅ 0.02"
