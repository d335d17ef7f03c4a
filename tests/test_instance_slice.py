"""``--qconform-slice``: a reproducible, daily rotated part of a run's instances (the
thorough profile's slice in the CPU job, issue 53): the same key keeps the same instances in
one process and under pytest-xdist, another key others, the M parts hold every instance
once, and the summary says how many ran."""

from __future__ import annotations

import argparse
import re

import pytest

from pytest_qconform.session import instance_slice
from pytest_qconform.session.instance_slice import Part

SUITE = """
import pytest

@pytest.mark.qconform_operation("dequantize")
@pytest.mark.parametrize("case", range(40))
def test_dequantize(qtarget, qbackend, case):
    pass
"""
ARGS = ("--qconform", "--qconform-backend=fake", "-p", "no:cacheprovider", "--qconform-no-report", "-rA")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1/10", Part(1, 10)),
        (" 3/4@nightly ", Part(3, 4, "nightly")),
        ("2/2@2026-11-28", Part(2, 2, "2026-11-28")),
    ],
)
def test_a_slice_is_written_n_of_m_and_a_key(text, expected):
    assert instance_slice.parse(text) == expected


@pytest.mark.parametrize("text", ["10", "0/4", "5/4", "a/b", "1/0", ""])
def test_a_slice_that_keeps_nothing_or_cannot_be_read_is_refused(text):
    with pytest.raises(argparse.ArgumentTypeError, match="N/M"):
        instance_slice.parse(text)


def test_the_slice_keeps_its_part_and_rotates_with_its_key():
    """About 1/M of many ids, the same ones for the same key, others for another day's."""
    ids = [f"suites/test_matmul.py::test_matmul[case-{n}]" for n in range(4000)]
    day = [i for i in ids if instance_slice.kept(Part(1, 10, "2026-11-28"), i)]
    again = [i for i in ids if instance_slice.kept(Part(1, 10, "2026-11-28"), i)]
    next_day = [i for i in ids if instance_slice.kept(Part(1, 10, "2026-11-29"), i)]
    assert day == again
    assert 320 < len(day) < 480
    assert len(set(day) & set(next_day)) < len(day) // 4  # another day, mostly other instances
    assert all(instance_slice.kept(Part(1, 1, "any"), i) for i in ids)


def test_the_parts_hold_every_instance_once():
    """Part N of M is not the first N parts (``2/3`` ran ``1/3`` again until revision 11): a run
    split into M calls runs each instance once."""
    ids = [f"suites/test_matmul.py::test_matmul[case-{n}]" for n in range(3000)]
    parts = [{i for i in ids if instance_slice.kept(Part(n, 3, "2026-11-29"), i)} for n in (1, 2, 3)]
    assert all(800 < len(part) < 1200 for part in parts)
    assert set.union(*parts) == set(ids) and sum(map(len, parts)) == len(ids)


def test_an_unkeyed_slice_takes_todays_date():
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", Part(1, 2).keyed().key)
    assert Part(1, 2, "fixed").keyed().key == "fixed"


def _ran(result: pytest.RunResult) -> set[str]:
    return set(re.findall(r"PASSED \S*test_dequantize\[(\S+)\]", result.stdout.str()))


def test_the_same_key_runs_the_same_instances_with_workers(fake_backend_project: pytest.Pytester):
    """One process and two pytest-xdist workers keep the same instances and print one line
    saying how many ran of how many, with the option that replays them."""
    pytest.importorskip("xdist")
    fake_backend_project.makepyfile(test_suite=SUITE)
    suite = str(fake_backend_project.path / "test_suite.py")
    serial = fake_backend_project.runpytest_inprocess(suite, *ARGS, "--qconform-slice=1/4@k1")
    parallel = fake_backend_project.runpytest_subprocess(suite, *ARGS, "--qconform-slice=1/4@k1", "-n", "2")
    other = fake_backend_project.runpytest_inprocess(suite, *ARGS, "--qconform-slice=1/4@k2")
    ran = _ran(serial)
    assert ran and ran == _ran(parallel) and ran != _ran(other)
    for result in (serial, parallel):
        result.stdout.fnmatch_lines(
            [
                f"qconform: slice 1/4 of key k1: ran {len(ran)} of 40 instances, {40 - len(ran)} deselected "
                "(the same slice again: --qconform-slice=1/4@k1)"
            ]
        )
