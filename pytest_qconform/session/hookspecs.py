"""Hooks that other packages (or a conftest.py) implement to plug into pytest-qconform."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from pytest_qconform.backends.base import Backend


@pytest.hookspec
def pytest_qconform_backends(config: pytest.Config) -> dict[str, Callable[[], Backend]] | None:
    """Return extra backends to test, as ``{name: factory}``; a factory builds a ``Backend``.

    Use this from a ``conftest.py`` for a backend that is not an installed package; an
    installed package registers through the ``pytest_qconform.backends`` entry point group
    instead. Names must not collide with built-in ones (bitsandbytes, hqq) or installed ones (triton-nf4).
    """
