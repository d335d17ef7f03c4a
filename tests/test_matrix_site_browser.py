"""The browsable matrix page in a real browser: headless Chromium driven through
chromedriver (selenium), both from Debian's packages (``apt-get install chromium
chromium-driver``; .ci/run installs them), nothing downloaded at run time.

It checks what a reader does: set filters and see the cells the model has, click a cell
and read its repro, open a report set with a failure and see the failure first. Each test
saves a screenshot (``--basetemp`` or pytest's tmp folder) to look at. Without the browser
the tests skip, naming what is missing, except in CI (``CI=true``), where .ci/run installs
it and a missing browser is a failure, not a silent skip.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import site_browser
from site_browser import open_page
from test_matrix import OTHER_ROW, cell, report
from test_matrix_site import committed_matrix

from pytest_qconform.matrix.cli import merge
from pytest_qconform.matrix.site import write_site
from pytest_qconform.matrix.site_data import state_of
from pytest_qconform.matrix.trend import verdicts_by_version

MISSING = site_browser.missing()
IN_CI = os.environ.get("CI", "").lower() == "true"
pytestmark = pytest.mark.skipif(MISSING is not None and not IN_CI, reason=f"needs a browser: {MISSING}")


@pytest.fixture(scope="module")
def browser():
    if MISSING is not None:  # only in CI, where .ci/run installs it
        pytest.fail(f"CI=true but the browser is missing: {MISSING}; .ci/run installs it with apt-get")
    driver = site_browser.start()
    yield driver
    driver.quit()


def choose(driver, name: str, value: str) -> None:
    from selenium.webdriver.support.ui import Select

    Select(driver.find_element("id", f"f-{name}")).select_by_value(value)


def visible_cells(driver) -> list[tuple[str, str, str]]:
    """(key, arch, state) of every coloured cell, in the grid's order."""
    return [
        tuple(found)
        for found in driver.execute_script(
            "return [...document.querySelectorAll('#grid td.cell')]"
            ".map(td => [td.dataset.key, td.dataset.arch, td.dataset.state])"
        )
    ]


def test_visible_cells_match_the_model_after_setting_filters(browser, tmp_path):
    m = committed_matrix()
    page = write_site(m, tmp_path / "index.html")
    open_page(browser, page)
    everything = visible_cells(browser)
    assert sorted(everything) == sorted(
        ("|".join(row), arch, state_of(e.verdicts)) for (row, arch), e in m.entries.items()
    )
    cpu = "x86_64 (AVX512)"  # a CPU's column is its machine and vector ISA (matrix.model.target)
    choose(browser, "arch", cpu)
    choose(browser, "backend", "bitsandbytes")
    choose(browser, "format", "nf4-b128")  # every blocksize-128 NF4 format, the -dq ones too
    choose(browser, "dtype", "bf16")
    expected = {
        ("|".join(row), arch, state_of(e.verdicts))
        for (row, arch), e in m.entries.items()
        if arch == cpu and row[0] == "bitsandbytes" and row[2].startswith("nf4-b128") and row[3] == "bf16"
    }
    shown = visible_cells(browser)
    assert len(expected) > 5 and sorted(shown) == sorted(expected)
    assert "arch=x86_64" in browser.current_url and "format=nf4-b128" in browser.current_url  # a link keeps the filters
    browser.save_screenshot(str(tmp_path / "filtered.png"))


def test_an_older_backend_version_shows_what_that_version_said(browser, tmp_path):
    m = committed_matrix()
    open_page(browser, write_site(m, tmp_path / "index.html"))
    choose(browser, "version", "bitsandbytes 0.49.2")
    shown = visible_cells(browser)
    expected = {
        ("|".join(row), arch, dict(verdicts_by_version(entry))["0.49.2"])
        for (row, arch), entry in m.entries.items()
        if row[0] == "bitsandbytes" and "0.49.2" in dict(verdicts_by_version(entry))
    }
    assert shown and sorted(shown) == sorted(expected)


def failing_set(tmp_path: Path) -> Path:
    """Two archs of passing cells and, named in the middle, one failing cell on one arch."""
    rows = [("bitsandbytes", "dequantize", f"nf4-b{b}", d) for b in (32, 64, 128) for d in ("bf16", "fp16")]
    failing = ("bitsandbytes", "dequantize", "nf4-b64", "fp16")
    reports = [
        report(
            arch="sm90", cells=[cell(r, "fail" if r == failing else "pass", 7.5 if r == failing else 0.4) for r in rows]
        ),
        report(arch="gfx942", host="mi300", cells=[cell(r) for r in rows] + [cell(OTHER_ROW)]),
    ]
    return write_site(merge(reports), tmp_path / "index.html")


def test_a_failing_cell_is_shown_first(browser, tmp_path):
    open_page(browser, failing_set(tmp_path))
    shown = visible_cells(browser)
    failing = "bitsandbytes|dequantize|nf4-b64|fp16"
    assert [key for key, _, _ in shown[:2]] == [failing, failing]  # the first row: its gfx942 and sm90 cells
    assert (failing, "sm90", "fail") in shown[:2]
    assert [state for key, _, state in shown if key != failing] == ["pass"] * (len(shown) - 2)
    choose(browser, "sort", "name")
    assert visible_cells(browser)[0][0] == "bitsandbytes|dequantize|nf4-b128|bf16"  # the model's order, MATRIX.md's


def test_a_cells_detail_shows_its_repro_and_where_it_came_from(browser, tmp_path):
    open_page(browser, failing_set(tmp_path))
    browser.find_element("css selector", "#grid td.cell[data-state='fail']").click()
    detail = browser.find_element("id", "detail")
    assert browser.find_element("id", "detail-repro").text == "pytest -k x"  # the failing case's stored repro
    assert "7.5 × its bound" in browser.find_element("id", "detail-multiple").text
    assert "out of bound" in detail.text  # the first failure's message
    assert "sm90-h100-a-2025-01-31T12:00:00Z" in detail.text and "bitsandbytes 0.50.2" in detail.text
    assert "cell=bitsandbytes%7Cdequantize%7Cnf4-b64%7Cfp16%40sm90" in browser.current_url
    browser.save_screenshot(str(tmp_path / "detail.png"))
    # The link opens the same cell.
    open_page(browser, tmp_path / "index.html", "#" + browser.current_url.split("#", 1)[1])
    assert browser.find_element("id", "detail-repro").text == "pytest -k x"


def test_the_overview_filters_the_matrix(browser, tmp_path):
    open_page(browser, failing_set(tmp_path))
    box = browser.find_element("css selector", "#overview-panels table.heat td[style]")
    box.click()
    values = {
        name: browser.find_element("id", f"f-{name}").get_attribute("value")
        for name in ("backend", "operation", "arch")
    }
    assert values["backend"] and values["operation"] and values["arch"]
    assert {key.split("|")[1] for key, _, _ in visible_cells(browser)} == {values["operation"]}


def test_a_regressed_cell_says_what_each_version_said(browser, tmp_path):
    """A cell of the committed reports that passed with an older bitsandbytes and is a known
    failure with the newest (the Versions table's regressions): its detail says both."""
    m = committed_matrix()
    regressed = [
        (row, arch, said)
        for (row, arch), entry in sorted(m.entries.items())
        if row[0] == "bitsandbytes"
        for said in [verdicts_by_version(entry)]
        if [verdict for _, verdict in said] == ["pass", "known-failure"]
    ]
    assert regressed, "the committed reports hold no regression of bitsandbytes (the Versions table names them)"
    row, arch, said = regressed[0]
    open_page(browser, write_site(m, tmp_path / "index.html"), "#cell=" + "|".join(row) + f"@{arch}")
    (old, _), (new, _) = said
    assert browser.find_element("id", "detail-versions").text == f"bitsandbytes {old} pass → {new} known failure"
    assert browser.find_element("id", "detail-repro").get_attribute("data-kind") == "known-failure"
    browser.save_screenshot(str(tmp_path / "regressed.png"))


def test_an_arch_without_a_run_says_compiled_not_run(browser, tmp_path):
    from pytest_qconform.report.sections import read_section

    section = read_section(Path(__file__).resolve().parent.parent / "reports" / "sections" / "triton-nf4.json")
    open_page(browser, write_site(committed_matrix(), tmp_path / "index.html", [section]))
    choose(browser, "arch", "gfx1200")
    assert visible_cells(browser) == []
    said = browser.find_element("id", "grid-not-run").text
    assert said.startswith("No report from gfx1200") and "triton-nf4: compiled, not run (" in said
    rows = browser.execute_script(
        "return [...document.querySelectorAll('#section-triton-nf4 tr')].filter(tr => !tr.hidden).map(tr => tr.cells[0].textContent)"
    )
    assert rows == ["arch", "gfx1200"]
    browser.save_screenshot(str(tmp_path / "not-run.png"))
