"""The ``large`` checks are opt-in (issue 51): sizes beyond the default run's budget run only
when ``-m large`` names them (only them) or ``--qconform-large`` asks for them beside the rest
(one run, one report, so the matrix merges their cells with the others'). A check marked
``qconform_large_on(kinds)`` is large on those target kinds only, and part of the default run
elsewhere (the rows ladder's top: large on a CPU, default on a GPU)."""

from __future__ import annotations

import textwrap

import pytest
import torch
from fake_backend import FAKE_BACKEND

# The run's target kind (a CPU machine's instances are the CPU's; a GPU host reports on its GPU),
# and a kind this machine is not.
HERE = "cuda" if torch.cuda.is_available() else "cpu"
ELSEWHERE = "rocm" if HERE != "rocm" else "cuda"

CONFTEST = FAKE_BACKEND + textwrap.dedent("""
    def pytest_qconform_backends(config):
        return {"fake": FakeBackend}
""")

SUITE = textwrap.dedent(f"""
    import pytest

    @pytest.mark.qconform_axes("format")
    def test_small(qtarget, qbackend, spec):
        pass

    @pytest.mark.large
    @pytest.mark.qconform_axes("format")
    def test_big(qtarget, qbackend, spec):
        pass

    @pytest.mark.qconform_large_on({HERE!r})
    @pytest.mark.qconform_axes("format")
    def test_big_here(qtarget, qbackend, spec):
        pass

    @pytest.mark.qconform_large_on({ELSEWHERE!r})
    @pytest.mark.qconform_axes("format")
    def test_big_elsewhere(qtarget, qbackend, spec):
        pass
""")


def _run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_sizes=SUITE)
    return pytester.runpytest(
        "--qconform",
        "test_sizes.py",
        "--qconform-backend=fake",
        "--qconform-no-report",
        "--strict-markers",
        "-v",
        *args,
    )


def _ran(result: pytest.RunResult) -> set[str]:
    return {
        name
        for name in ("test_small", "test_big", "test_big_here", "test_big_elsewhere")
        if f"{name}[" in result.stdout.str()
    }


def test_the_default_run_leaves_the_large_checks_out_and_says_how_to_run_them(pytester: pytest.Pytester) -> None:
    result = _run(pytester)
    assert _ran(result) == {"test_small", "test_big_elsewhere"}
    result.stdout.fnmatch_lines(["*2 opt-in (-m large runs its 2, --qconform-large beside the rest)*"])
    result.assert_outcomes(passed=2, deselected=2)


def test_m_large_runs_only_the_large_checks(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "-m", "large")
    assert _ran(result) == {"test_big", "test_big_here"}
    result.assert_outcomes(passed=2, deselected=2)


def test_the_option_runs_the_large_checks_beside_the_rest(pytester: pytest.Pytester) -> None:
    result = _run(pytester, "--qconform-large")
    assert _ran(result) == {"test_small", "test_big", "test_big_here", "test_big_elsewhere"}
    result.assert_outcomes(passed=4)


def test_the_markers_are_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    result.stdout.fnmatch_lines(
        ["@pytest.mark.large: *opt-in*--qconform-large*", "@pytest.mark.qconform_large_on(*kinds)*"]
    )
