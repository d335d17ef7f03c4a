"""The hypothesis example database: a failing example found in one run is replayed first
in the next (what CI gets by keeping the folder between runs), through pytester."""

from __future__ import annotations

import json

import pytest

FLAKY_SUITE = """
import json
import pytest
from hypothesis import given, strategies as st

@pytest.mark.qconform_operation("dequantize")
@given(value=st.integers(min_value=10**6, max_value=2**62))
def test_small(qtarget, qbackend, value):
    with open("drawn.jsonl", "a") as log:
        log.write(json.dumps(value) + "\\n")
    assert value < 1000, "every draw is a counterexample: the first run fails on its first"
"""


def drawn(pytester: pytest.Pytester) -> list[int]:
    path = pytester.path / "drawn.jsonl"
    values = [json.loads(line) for line in path.read_text().splitlines()]
    path.unlink()
    return values


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # A subprocess per run: each is a fresh process, as on a CI runner, with only the folder shared.
    return pytester.runpytest_subprocess(
        str(pytester.path / "test_suite.py"),
        "--qconform",
        "--qconform-no-report",
        "--qconform-backend=fake",
        "-p",
        "no:cacheprovider",
        *args,
    )


def test_a_failing_example_is_saved_and_replayed_first_by_the_next_run(fake_backend_project) -> None:
    fake_backend_project.makepyfile(test_suite=FLAKY_SUITE)
    first = run(fake_backend_project, "--qconform-hypothesis-db=ci-cache/examples")
    first.assert_outcomes(failed=1)
    found = [v for v in drawn(fake_backend_project) if v >= 1000]
    assert found, "the first run drew no failing example"
    assert any((fake_backend_project.path / "ci-cache" / "examples").rglob("*")), "nothing was saved"

    second = run(fake_backend_project, "--qconform-hypothesis-db=ci-cache/examples", "--hypothesis-show-statistics")
    second.assert_outcomes(failed=1)
    assert drawn(fake_backend_project)[0] in found  # replayed before any new draw
    second.stdout.fnmatch_lines(["*during reuse phase*", "*1 failing*"])  # from the database, not drawn anew


def test_without_a_database_the_ci_profile_saves_nothing(fake_backend_project) -> None:
    fake_backend_project.makepyfile(test_suite=FLAKY_SUITE)
    run(fake_backend_project)
    assert not (fake_backend_project.path / ".hypothesis" / "examples").exists()


def test_the_ini_names_the_database_relative_to_the_rootdir(fake_backend_project) -> None:
    fake_backend_project.makeini("[pytest]\nqconform_hypothesis_db = saved\n")
    fake_backend_project.makepyfile(test_suite=FLAKY_SUITE)
    (fake_backend_project.path / "elsewhere").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(fake_backend_project.path / "elsewhere")
        run(fake_backend_project)
    assert any((fake_backend_project.path / "saved").rglob("*"))
