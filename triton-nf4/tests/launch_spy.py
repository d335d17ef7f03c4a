"""Spies on a Triton kernel's launches, for the kernels' tests that read what a plan launched
(which kernel, its grid, the split count, the tickets it passed): each launch is recorded
and still made."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


def _spy(monkeypatch: pytest.MonkeyPatch, module: Any, name: str, record: Callable[[Any, tuple], Any]) -> list[Any]:
    launches: list[Any] = []
    kernel = getattr(module, name)

    class Spy:
        def __getitem__(self, grid: Any) -> Any:
            def launch(*args: Any, **meta: Any) -> Any:
                launches.append(record(grid, args))
                return kernel[grid](*args, **meta)

            return launch

    monkeypatch.setattr(module, name, Spy())
    return launches


def spy_launches(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[tuple[Any, tuple]]:
    """Replace the kernel ``module.name`` with a spy for the test; returns the list that
    collects ``(grid, args)`` of every launch."""
    return _spy(monkeypatch, module, name, lambda grid, args: (grid, args))


def spy_on(monkeypatch: pytest.MonkeyPatch, module: Any, name: str) -> list[Any]:
    """The same spy, collecting each launch's grid only."""
    return _spy(monkeypatch, module, name, lambda grid, args: grid)
