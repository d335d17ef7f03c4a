"""Out of device memory in a test's call phase is a skip of that case, not a failure.

A large case that does not fit on a small GPU says nothing about whether the backend
computes the right numbers, so it is reported ``skipped`` with the reason
``out of memory: ...`` (``outcomes.OOM_PREFIX``) and the run goes on. Only the call
phase is covered: an out-of-memory error while setting up a fixture is a real fault.
Registered by the plugin under ``--qconform`` only.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest
import torch

from pytest_qconform.session.outcomes import OOM_PREFIX


def is_out_of_memory(exc: BaseException) -> bool:
    """torch's OutOfMemoryError, or a RuntimeError that says "out of memory" (some
    extensions raise that instead, e.g. ``CUDA error: out of memory``)."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    first_line = (str(exc).strip().splitlines() or [""])[0]
    return isinstance(exc, RuntimeError) and "out of memory" in first_line.lower()


def _release_cached_memory() -> None:
    """Give the allocator's cached blocks back so the next case starts clean."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, None, None]:
    try:
        return (yield)
    except Exception as exc:
        if not is_out_of_memory(exc):
            raise
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        reason = f"{OOM_PREFIX} {first_line}"
    # Outside the except block: the error's traceback (and the tensors its frames hold)
    # is released before the skip, so the memory can be freed.
    _release_cached_memory()
    pytest.skip(reason)
