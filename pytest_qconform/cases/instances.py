"""The instances of a check that declares its axes (``qconform_axes``): one covering
array per target and backend, from that backend's claims there (``axes``).

Called from the plugin's ``pytest_generate_tests``; parametrizes ``qtarget``,
``qbackend`` and the check's own arguments together, since which values exist depends
on the backend and the device. The session hands in its targets and backends
(``Backends``): this room sits below the session and does not read the session's stash.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from pytest_qconform.backends.base import Backend
from pytest_qconform.cases import axes
from pytest_qconform.cases.claims import target_device
from pytest_qconform.hardware.targets import Target
from pytest_qconform.vocabulary import NOTHING_CLAIMED_PREFIX

AXES_MARKER = "qconform_axes"


STRENGTH_MARKER = "qconform_ci_strength"
THOROUGH_STRENGTH_MARKER = "qconform_thorough_strength"
# A check whose instances on some target kinds are large there (beyond the default run's
# budget) and ordinary elsewhere: its instances on those kinds get the ``large`` marker, so
# that ``-m large`` selects exactly them and the default run leaves them out
# (``session.applicability``).
LARGE_ON_MARKER = "qconform_large_on"


@dataclass(frozen=True)
class Backends:
    """The session's targets and backends under test: ``backend(name)`` builds one on first use."""

    targets: tuple[Target, ...]
    names: tuple[str, ...]
    backend: Callable[[str], Backend]


def _strength(config: pytest.Config, definition: Any = None) -> tuple[int, tuple[str, ...]]:
    """3-wise in ``thorough`` (or less where ``qconform_thorough_strength(n)`` says so: an
    axis of many values, such as the rows ladder's 47, times every pair of the others is
    more than a nightly run holds); all pairs in ``ci``, or less where a check's
    ``qconform_ci_strength(n)`` marker says so (a whole workload per instance), with every
    combination of the axes its ``jointly=`` names (the matrix cell's, say)."""
    profile = config.getoption("qconform_profile", default=None) or config.getini("qconform_profile")
    if profile == "thorough":
        capped = definition.get_closest_marker(THOROUGH_STRENGTH_MARKER) if definition is not None else None
        return (int(capped.args[0]) if capped is not None else 3), ()
    marker = definition.get_closest_marker(STRENGTH_MARKER) if definition is not None else None
    if marker is None:
        return 2, ()
    return int(marker.args[0]), tuple(marker.kwargs.get("jointly", ()))


def _nothing_claimed(check: axes.CheckAxes, values: dict[str, tuple[Any, ...]], backend: str) -> str:
    empty = [name for name, found in values.items() if not found]
    wanted = "; ".join(f"{name} in {check.only[name]}" if name in check.only else name for name in empty)
    return f"{NOTHING_CLAIMED_PREFIX} {backend} claims no value of {wanted}"


def parametrize(metafunc: pytest.Metafunc, marker: pytest.Mark, session: Backends) -> None:
    """``qtarget``, ``qbackend`` and the check's axes, jointly, for every target and backend."""
    check = axes.CheckAxes.from_marker(marker)
    strength, jointly = _strength(metafunc.config, metafunc.definition)
    large_on = metafunc.definition.get_closest_marker(LARGE_ON_MARKER)
    params = []
    for target in session.targets:
        target_marks = [getattr(pytest.mark, m) for m in target.marker_names]
        if large_on is not None and target.kind in large_on.args:
            target_marks.append(pytest.mark.large)
        for name in sorted(session.names):
            backend = session.backend(name)
            rows: list[dict[str, Any]]
            marks = list(target_marks)
            if backend.availability().available:
                values = check.values(backend.capabilities(target_device(target)), target.bf16)
                rows = axes.covering_rows(values, strength, jointly)
                if not rows:  # the check's one cell says what is missing
                    rows = [axes.default_row(check)]
                    marks.append(pytest.mark.skip(reason=_nothing_claimed(check, values, name)))
            else:  # its one instance skips as unavailable, naming why
                rows = [axes.default_row(check)]
            for row in rows:
                params.append(
                    pytest.param(
                        target,
                        name,
                        *axes.arguments(check, row),
                        marks=marks,
                        id=f"{target.id}-{name}-{axes.instance_id(row)}",
                    )
                )
    metafunc.parametrize(("qtarget", "qbackend", *check.argnames), params, indirect=("qtarget", "qbackend"))


def axis_labels(item: pytest.Item) -> dict[str, str] | None:
    """The axis values of an instance of a check with declared axes, by label."""
    marker = item.get_closest_marker(AXES_MARKER)
    params = getattr(getattr(item, "callspec", None), "params", None)
    if marker is None or params is None:
        return None
    check = axes.CheckAxes.from_marker(marker)
    spec = params.get("spec")
    row: dict[str, Any] = {}
    for name in check.names:
        if name in axes.SPEC_AXES:
            row[name] = {
                "format": spec.format,
                "blocksize": spec.blocksize,
                "double_quant": spec.double_quant,
                "hqq_axis": spec.axis,
                "quant_storage": spec.quant_storage,
            }[name]
        else:
            row[name] = params[name]
    return axes.labels(row)


def claimed_labels(item: pytest.Item, cache: dict, backend_of: Callable[[str], Backend]) -> dict[str, list[str]] | None:
    """The values each declared axis of an instance's check has for its backend on its
    target (claimed, within the check's ``only``), by label: what coverage is measured
    against. ``cache``: shared across the items of one collection."""
    marker = item.get_closest_marker(AXES_MARKER)
    params = getattr(getattr(item, "callspec", None), "params", None)
    if marker is None or params is None:
        return None
    target, name = params["qtarget"], params["qbackend"]
    key = (name, target.id, marker.args, tuple(sorted((k, tuple(v)) for k, v in marker.kwargs.items())))
    if key not in cache:
        backend = backend_of(name)
        if not backend.availability().available:
            cache[key] = None
        else:
            check = axes.CheckAxes.from_marker(marker)
            values = check.values(backend.capabilities(target_device(target)), target.bf16)
            if not all(values.values()):  # the check does not apply to this backend: it claims nothing of it
                cache[key] = {}
            else:
                cache[key] = {axis: [axes.AXES[axis].label(v) for v in found] for axis, found in values.items()}
    return cache[key]


def nothing_claimed(item: pytest.Item) -> bool:
    """Whether this instance is a check's one cell saying its backend claims nothing it needs."""
    return any(str(m.kwargs.get("reason", "")).startswith(NOTHING_CLAIMED_PREFIX) for m in item.iter_markers("skip"))
