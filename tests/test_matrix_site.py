"""The browsable matrix page without a browser: its data is the merged model serialised
(the same verdicts as MATRIX.md, the runs in the published report schema), it is one file
that fetches nothing, it is deterministic, and the trend and known-failure repros it shows
come from the model and the registry. tests/test_matrix_site_browser.py opens it in Chromium."""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest
from test_matrix import OTHER_ROW, ROW, cell, cpu_report, report

from pytest_qconform.matrix.cli import main, merge
from pytest_qconform.matrix.known_repros import registry_repros, repro_for
from pytest_qconform.matrix.model import find_report_files
from pytest_qconform.matrix.site import decode_data, render_page, write_site
from pytest_qconform.matrix.site_data import PAGE_SCHEMA, page_data, rerun_command, state_of
from pytest_qconform.matrix.trend import trends
from pytest_qconform.report.run_report import RunReport, read_report, write_report

REPO = Path(__file__).resolve().parent.parent
KNOWN_TOML = """
[[failure]]
backend = "bitsandbytes"
versions = "*"
arch = "sm90"
check = "matmul"
reason = "wrong values"
link = "https://example.org/issue/1"
repro = "python -c 'print(1)'"
"""
KNOWN_REASON = "known failure (https://example.org/issue/1): wrong values [known.toml:2]"


@functools.cache
def committed_matrix():
    """The matrix of the committed reports (read once: 2 MB of JSON; the model is frozen)."""
    reports = [read_report(p) for p in find_report_files([REPO / "reports"]) if "sections" not in p.parts]
    return merge(reports)


def test_the_page_holds_the_merged_verdict_of_every_cell():
    m = merge(
        [
            report(arch="sm90", cells=[cell(ROW, "fail", 4.2), cell(OTHER_ROW)]),
            report(arch="sm90", host="h100-b", cells=[cell(ROW, "pass")]),  # disagrees with h100-a
            report(arch="gfx942", host="mi300", cells=[cell(ROW)]),
        ]
    )
    data = decode_data(render_page(page_data(m, repros={})))
    assert data["schema"] == PAGE_SCHEMA and data["columns"] == ["gfx942", "sm90"]
    shown = {(tuple(data["rows"][e["row"]]), e["arch"]): e["state"] for e in data["entries"]}
    assert shown == {(row, arch): state_of(entry.verdicts) for (row, arch), entry in m.entries.items()}
    assert shown[(ROW, "sm90")] == "disagree" and shown[(ROW, "gfx942")] == "pass"
    first = next(e for e in data["entries"] if e["arch"] == "sm90" and data["rows"][e["row"]] == list(ROW))
    assert first["multiple_text"] == "4.2"


def test_the_runs_are_embedded_in_the_published_report_schema():
    m = merge([report(arch="sm90", cells=[cell(ROW, "fail", 4.2)], source="reports/a.json")])
    run = page_data(m, repros={})["runs"][0]
    assert run["label"] == "a.json"
    assert RunReport.from_dict(run["report"]).cells == m.runs[0].cells  # validates against the schema


def test_a_failing_cell_offers_its_stored_repro_first_then_a_rerun():
    m = merge([report(arch="sm90", cells=[cell(ROW, "fail", 4.2)])])
    repros = page_data(m, repros={})["entries"][0]["repros"]
    assert [r["kind"] for r in repros] == ["failure", "rerun"]
    assert repros[0]["command"] == "pytest -k x"  # what test_matrix.cell stores
    assert repros[1]["command"] == (
        "pytest --qconform -m sm90 --qconform-backend=bitsandbytes --qconform-format=nf4 --qconform-dtype=bf16"
    )


def test_a_cpu_isa_is_a_column_of_the_page_and_its_rerun_takes_the_machines_marker():
    """The page's columns, cells and runs are the model's targets (``x86_64 (AVX2)`` beside
    ``x86_64 (AVX512)``, no disagreement between them); a cell's rerun selects the machine's
    marker (``-m x86_64``), the one the CPU's tests carry, whatever its ISA."""
    m = merge(
        [
            cpu_report("2025-01-01T00:00:00Z", [cell(ROW, "known-failure")], "AVX512"),
            cpu_report("2025-01-02T00:00:00Z", [cell(ROW, "pass")], "AVX2"),
        ]
    )
    data = page_data(m, repros={})
    assert data["columns"] == data["options"]["arch"] == ["x86_64 (AVX2)", "x86_64 (AVX512)"]
    assert {(e["arch"], e["state"]) for e in data["entries"]} == {
        ("x86_64 (AVX2)", "pass"),
        ("x86_64 (AVX512)", "known-failure"),
    }
    assert [r["arch"] for r in data["runs"]] == ["x86_64 (AVX2)", "x86_64 (AVX512)"]
    assert {o["arch"] for o in data["overview"]} == {"x86_64 (AVX2)", "x86_64 (AVX512)"}
    assert {e["repros"][-1]["command"] for e in data["entries"]} == {
        "pytest --qconform -m x86_64 --qconform-backend=bitsandbytes --qconform-format=nf4 --qconform-dtype=bf16"
    }


def test_rerun_command_leaves_out_what_no_option_selects():
    assert rerun_command(("hqq", "interop", "-", "-"), "not-an-arch") == "pytest --qconform --qconform-backend=hqq"


def test_a_known_failure_shows_its_reason_link_and_registry_repro():
    known = cell(("bitsandbytes", "matmul", "nf4-b64", "bf16"), "known-failure", 3.0)
    known["reason"] = KNOWN_REASON
    m = merge([report(arch="sm90", cells=[known])])
    entry = page_data(m, repros=registry_repros(KNOWN_TOML))["entries"][0]
    assert entry["known"]["what"] == "wrong values" and entry["known"]["link"] == "https://example.org/issue/1"
    assert entry["known"]["entry"] == "known.toml:2"
    assert entry["repros"][0] == {"kind": "known-failure", "source": m.runs[0].label, "command": "python -c 'print(1)'"}


def test_known_failure_repros_match_the_exact_text_or_a_narrowed_entry_of_the_same_link():
    repros = registry_repros(KNOWN_TOML)
    assert repro_for(KNOWN_REASON, repros) == "python -c 'print(1)'"
    assert repro_for("[NOTRUN] " + KNOWN_REASON, repros) == "python -c 'print(1)'"  # an entry that ends the process
    # edited since the report was written: the link's only entry is still its entry
    assert repro_for(KNOWN_REASON.replace("wrong values", "other values"), repros) == "python -c 'print(1)'"
    assert repro_for(KNOWN_REASON.replace("issue/1", "issue/2"), repros) is None  # another link
    start = "the CUDA kernel flushes every subnormal result to zero on its way out of the block"
    two = "".join(
        KNOWN_TOML.replace("wrong values", f"{start}{end}").replace("print(1)", f"print({n})")
        for n, end in ((2, ", then rounds"), (3, "; narrowed to bf16 and fp32 since"))
    )
    repros = registry_repros(two)
    narrowed = f"known failure (https://example.org/issue/1): {start}; narrowed to bf16 [known.toml:9]"
    assert repro_for(narrowed, repros) == "python -c 'print(3)'"  # the longest shared start
    assert repro_for(KNOWN_REASON, repros) is None  # shares too little with either


def test_every_known_failure_of_the_committed_reports_finds_its_repro():
    repros = registry_repros()
    m = committed_matrix()
    known = [c.reason for run in m.runs for c in run.cells if c.verdict == "known-failure"]
    assert known and all(repro_for(reason, repros) for reason in known)


def test_trend_lists_the_cells_a_version_changed():
    old = report("2025-01-01T00:00:00Z", [cell(ROW, "fail", 3.0), cell(OTHER_ROW)], bnb="0.49.2")
    new = report("2025-02-01T00:00:00Z", [cell(ROW, "pass"), cell(OTHER_ROW)], bnb="0.50.2")
    (found,) = trends(merge([old, new]))
    assert (found.arch, found.backend, found.versions) == ("sm90", "bitsandbytes", ("0.49.2", "0.50.2"))
    assert found.counts == ((("fail", 1),), (("pass", 1),))
    assert [(c.row, c.transition) for c in found.changed] == [(ROW, ("fail", "pass"))]
    assert found.transitions() == ((("fail", "pass"), 1),)
    assert trends(merge([new])) == ()  # one version: no trend


def test_the_page_is_one_file_that_fetches_nothing(tmp_path):
    page = write_site(committed_matrix(), tmp_path / "site" / "index.html").read_text(encoding="utf-8")
    assert not re.search(r"<(link|img|iframe)\b|\bsrc\s*=|@import|url\(", page, re.IGNORECASE)
    assert page.count("<script") == 2  # the data and the inline script
    assert len(page.encode()) < 400_000  # 170 kB for the committed reports (gzip: 1.8 MB of JSON)


def test_the_page_is_deterministic_and_needs_every_marker(monkeypatch):
    from pytest_qconform.matrix import site

    m = committed_matrix()
    assert render_page(page_data(m)) == render_page(page_data(m))
    original = site._asset
    monkeypatch.setattr(site, "_asset", lambda name: original(name).replace("QCONFORM_DATA", "", 1))
    with pytest.raises(ValueError, match="QCONFORM_DATA once, found 0"):
        render_page({})


def test_report_text_cannot_end_the_script(tmp_path):
    evil = cell(ROW, "skipped", None)
    evil["reason"] = "</script><script>alert(1)</script>"
    page = render_page(page_data(merge([report(cells=[evil])]), repros={}))
    assert "alert(1)" not in page  # embedded compressed; the page sets report text with textContent
    assert decode_data(page)["runs"][0]["report"]["cells"][0]["reason"] == evil["reason"]


def test_cli_site_option_writes_the_page(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_report(report(arch="sm90", cells=[cell(ROW, "fail", 4.2)]), tmp_path / "reports")
    assert main(["reports", "--site", "out/site/index.html"]) == 0
    data = decode_data((tmp_path / "out" / "site" / "index.html").read_text(encoding="utf-8"))
    assert [e["state"] for e in data["entries"]] == ["fail"]
