"""A skip raised by ``outcomes.skip_not_claimed`` declares itself no cell on its report, so the
recorder reads a value rather than the ``not claimed:`` prefix of its message (the prefix is
still read for skips downstream tests write themselves)."""

from __future__ import annotations

from collections.abc import Generator

import pytest

from pytest_qconform.session import outcomes


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    declared = getattr(call.excinfo.value, outcomes.DECLARED_ATTRIBUTE, None) if call.excinfo is not None else None
    if declared == outcomes.NO_CELL:
        outcomes.declare(report.user_properties, None)
    return report
