"""The wing's pytest plugin owns its options, as a pytest plugin does: declared in its own group
by its own ``pytest_addoption``, and refused without ``--qconform`` as the core refuses its own."""

from __future__ import annotations

import pytest


def test_the_record_option_is_declared_in_the_wings_own_group(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--help")
    result.stdout.fnmatch_lines(
        ["qconform-triton-nf4: our Triton NF4 backend:", "*--qconform-record-kernel-calls=FILE*"]
    )
    from pytest_qconform.session import options

    assert "--qconform-record-kernel-calls" not in [flag for flag, _ in options._options()]


def test_the_record_option_without_qconform_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest_subprocess("--qconform-record-kernel-calls=calls.json", "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--qconform-record-kernel-calls only works with --qconform, which is missing*"])
    assert not (pytester.path / "calls.json").exists()
