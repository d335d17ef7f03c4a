"""A process that runs the checks keeps the memory it frees (session.allocator), unless
its user configured the allocator."""

from __future__ import annotations

import pytest

from pytest_qconform.session import allocator


class RecordingLibc:
    def __init__(self, answer: int = 1) -> None:
        self.calls: list[tuple[int, int]] = []
        self.answer = answer

    def mallopt(self, parameter: int, value: int) -> int:
        self.calls.append((parameter, value))
        return self.answer


def test_glibc_maps_no_large_block_and_keeps_the_heap_top():
    libc = RecordingLibc()
    assert allocator.keep_freed_memory({}, libc) == "freed memory kept"
    assert libc.calls == [(allocator.M_MMAP_MAX, 0), (allocator.M_TRIM_THRESHOLD, allocator.KEEP_UP_TO)]


@pytest.mark.parametrize(
    ("environment", "named"),
    [
        ({"MALLOC_ARENA_MAX_": "2"}, "MALLOC_ARENA_MAX_"),
        ({"GLIBC_TUNABLES": "glibc.malloc.mmap_max=65536"}, "GLIBC_TUNABLES"),
        ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
    ],
    ids=["malloc-variable", "tunables", "preloaded-allocator"],
)
def test_an_allocator_the_user_configured_is_left_alone(environment, named):
    libc = RecordingLibc()
    assert allocator.keep_freed_memory(environment, libc) == f"left as configured by {named}"
    assert libc.calls == []


def test_tunables_of_other_parts_of_glibc_do_not_count_as_configuring_malloc():
    libc = RecordingLibc()
    assert allocator.keep_freed_memory({"GLIBC_TUNABLES": "glibc.pthread.rseq=0"}, libc) == "freed memory kept"


def test_a_libc_without_mallopt_or_one_that_refuses_is_reported_not_an_error():
    assert allocator.keep_freed_memory({}, object()) == "left as it is: not glibc"
    assert allocator.keep_freed_memory({}, RecordingLibc(answer=0)) == "left as it is: mallopt refused"


def test_a_qconform_session_that_runs_checks_sets_its_allocator(fake_backend_project: pytest.Pytester, monkeypatch):
    """The session does it at configure time, in the process that runs the tests, and
    records what it did; installed but off (no ``--qconform``), it does nothing."""
    done: list[str] = []
    monkeypatch.setattr(allocator, "keep_freed_memory", lambda: done.append("called") or "freed memory kept")
    fake_backend_project.makepyfile(
        test_suite="""
from pytest_qconform.session import state

def test_what_the_session_did(request):
    recorded = request.config.stash.get(state.ALLOCATOR, None)
    assert recorded == ("freed memory kept" if request.config.getoption("qconform") else None)
"""
    )
    fake_backend_project.inline_run("test_suite.py").assertoutcome(passed=1)
    assert done == []
    fake_backend_project.inline_run("test_suite.py", "--qconform", "--qconform-no-report").assertoutcome(passed=1)
    assert done == ["called"]
