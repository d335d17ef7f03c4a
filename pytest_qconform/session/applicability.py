"""Instances that cannot apply to this run are deselected at collection and summed up in
one line, instead of ending as hundreds of skips.

What is known before anything runs:

- **another device**: on a GPU host the CPU instances (a run reports on one device, so
  they could only skip with ``other device:``), unless ``-m`` asked for them;
- **not claimed**: an available backend does not claim the instance's format, blocksize,
  double quantization, dtype or device (the same rule as the suites' ``require_claim``,
  ``claims.unclaimed``; backward and serialization are still asked inside the tests);
- **opt-in**: the checks marked ``distributed`` or ``large`` (sizes beyond the default run's
  budget; ``qconform_large_on`` marks a check's instances on some target kinds only), unless
  ``-m`` names the marker, or, for ``large``, ``--qconform-large`` asks for them beside the rest.

Those of the first two kinds never make a matrix cell. Instances for hardware that ``-m``
asks for and the run lacks (``-m rocm`` on a CPU) are *not* deselected: they still end as
skips that name what was needed and what was found. Nor are an unavailable backend's: its
skips are its ``unavailable`` cells.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import pytest

from pytest_qconform.cases.claims import target_device, unclaimed
from pytest_qconform.cases.instances import nothing_claimed
from pytest_qconform.hardware.targets import Target, requested_hardware
from pytest_qconform.session import state


@dataclass
class NotHere:
    """What collection left out, for the one summary line."""

    other_device: Counter = field(default_factory=Counter)  # target id -> instances
    not_claimed: Counter = field(default_factory=Counter)  # backend -> instances
    opt_in: Counter = field(default_factory=Counter)  # marker -> instances that -m did not ask for
    few_devices: int = 0  # multi_gpu instances on a machine with fewer than two GPUs
    probe: str = ""

    @property
    def total(self) -> int:
        return (
            sum(self.other_device.values())
            + sum(self.not_claimed.values())
            + sum(self.opt_in.values())
            + self.few_devices
        )

    def line(self) -> str:
        """``qconform: 306 instances not applying here were deselected: ...``; empty when none."""
        if not self.total:
            return ""
        parts = []
        if self.not_claimed:
            per = ", ".join(f"{name} {n}" for name, n in sorted(self.not_claimed.items()))
            parts.append(f"{sum(self.not_claimed.values())} not claimed by their backend ({per})")
        if self.other_device:
            per = ", ".join(f"{target} {n}" for target, n in sorted(self.other_device.items()))
            parts.append(
                f"{sum(self.other_device.values())} for another device ({per}; a run reports on one "
                f"device, this one on {self.probe}; -m selects them to see them skipped)"
            )
        if self.few_devices:
            parts.append(
                f"{self.few_devices} multi_gpu (this machine has fewer than two GPUs; -m multi_gpu shows them skipped)"
            )
        if self.opt_in:
            per = ", ".join(_how_to_run(marker, n) for marker, n in sorted(self.opt_in.items()))
            parts.append(f"{sum(self.opt_in.values())} opt-in ({per})")
        return f"qconform: {self.total} instances not applying here were deselected: {'; '.join(parts)}"


NOT_HERE = pytest.StashKey[NotHere]()  # what collection left out, read by the recorder for its summary
# Markers of checks a run includes only when -m names them (the distributed ones spawn processes;
# the large ones reach sizes beyond the default run's budget).
OPT_IN_MARKERS: tuple[str, ...] = ("distributed", "large")
# Opt-in markers an option also includes, beside the rest of the run (-m would run only them):
# one run, one report, so the matrix merges its large cells with the others (a second report of
# the same machine would supersede the first).
OPT_IN_OPTIONS: dict[str, str] = {"large": "qconform_large"}
_WORKER_KEY = "qconform_not_here"  # pytest-xdist: the workers collect, the controller prints the line


def _how_to_run(marker: str, count: int) -> str:
    """``-m large runs its 145, --qconform-large beside the rest``."""
    option = OPT_IN_OPTIONS.get(marker)
    beside = f", --{option.replace('_', '-')} beside the rest" if option else ""
    return f"-m {marker} runs its {count}{beside}"


def from_worker(config: pytest.Config, workeroutput: dict[str, Any]) -> None:
    """On the pytest-xdist controller, which collects nothing: take what a worker's collection
    left out. Every worker collects the same items, so the first to say it says it for all."""
    found = workeroutput.get(_WORKER_KEY)
    if found is not None and NOT_HERE not in config.stash:
        config.stash[NOT_HERE] = NotHere(
            other_device=Counter(found["other_device"]),
            not_claimed=Counter(found["not_claimed"]),
            opt_in=Counter(found["opt_in"]),
            few_devices=found["few_devices"],
            probe=found["probe"],
        )


def _requested(target: Target, markexpr: str) -> bool:
    asked = set(requested_hardware(markexpr))
    return any(name in asked for name in target.marker_names)


def _opted_out(config: pytest.Config, item: pytest.Item) -> str | None:
    """The opt-in marker of an item whose marker neither ``-m`` names nor its option asks for."""
    words = set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", config.getoption("markexpr") or ""))
    asked = words | {m for m, option in OPT_IN_OPTIONS.items() if config.getoption(option, default=False)}
    return next((m for m in OPT_IN_MARKERS if item.get_closest_marker(m) and m not in asked), None)


def not_applying(config: pytest.Config, item: pytest.Item, caps_cache: dict) -> tuple[str, str] | None:
    """("other-device", target id), ("not-claimed", backend) or ("opt-in", marker) for an
    item this run leaves out."""
    marker = _opted_out(config, item)
    if marker is not None:
        return ("opt-in", marker)
    if item.get_closest_marker("multi_gpu") and state.probe(config).device_count < 2:
        if "multi_gpu" not in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", config.getoption("markexpr") or ""):
            return ("few-devices", "multi_gpu")
    params = getattr(getattr(item, "callspec", None), "params", {})
    target, name = params.get("qtarget"), params.get("qbackend")
    if not isinstance(target, Target) or name is None:
        return None
    if target.skip_reason:
        if target.other_device and not _requested(target, config.getoption("markexpr") or ""):
            return ("other-device", target.id)
        return None
    if nothing_claimed(item):  # the check's one cell saying what its backend lacks: kept
        return None
    key = (name, target.id)
    if key not in caps_cache:
        backend = state.backend(config, name)
        caps_cache[key] = backend.capabilities(target_device(target)) if backend.availability().available else None
    caps = caps_cache[key]
    if caps is None:
        return None
    if unclaimed(caps, target, params.get("spec"), params.get("dtype")):
        return ("not-claimed", name)
    return None


def deselect(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Drop the instances that cannot apply here; remember how many of which kind."""
    summary = NotHere(probe=state.probe(config).summary())
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    cache: dict[Any, Any] = {}
    for item in items:
        found = not_applying(config, item, cache)
        if found is None:
            keep.append(item)
            continue
        drop.append(item)
        kind, what = found
        if kind == "few-devices":
            summary.few_devices += 1
            continue
        {"other-device": summary.other_device, "not-claimed": summary.not_claimed, "opt-in": summary.opt_in}[kind][
            what
        ] += 1
    config.stash[NOT_HERE] = summary
    workeroutput = getattr(config, "workeroutput", None)  # set on a pytest-xdist worker
    if workeroutput is not None:
        workeroutput[_WORKER_KEY] = {
            "other_device": dict(summary.other_device),
            "not_claimed": dict(summary.not_claimed),
            "opt_in": dict(summary.opt_in),
            "few_devices": summary.few_devices,
            "probe": summary.probe,
        }
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
