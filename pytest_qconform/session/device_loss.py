"""A device left unusable by a test is contained like a crash, not charged to later tests.

A GPU kernel that faults (a misaligned or illegal address, a device-side assert) leaves
the process's CUDA context unusable: every later CUDA call raises the same sticky error.
Left alone, one faulting case turns every later test of the session into a failure of
whichever backend happens to run next (554 of them in one H100 run). So when a test's
phase raises, its device is probed (a synchronize and a one-element kernel); if that
fails too, the device is lost for this process:

- under pytest-xdist the worker ends itself at once, before the test's report is sent:
  xdist reports the test as crashed and starts a fresh worker (a fresh context), and
  ``short_circuit`` ends that backend's remaining tests of the operation as after any
  crash;
- in one process the test is reported ``crashed`` with the device's error, and every
  later test on that device fails at once as ``crashed after an earlier crash in
  <test>``, naming the remedy (``-n 1``).

Registered by the plugin under ``--qconform`` only.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Generator

import pytest

from pytest_qconform.session import outcomes, state
from pytest_qconform.vocabulary import Verdict

LOST = pytest.StashKey[tuple[str, str, str]]()  # (device, nodeid of the test that lost it, the error)
WORKER_EXIT_CODE = 75
REMEDY = "run with -n 1 --max-worker-restart=100 (pytest-xdist) so that such a fault costs one worker, not the session"


def device_error(device: str) -> str | None:
    """The error a trivial operation on ``device`` raises now, or None while it works.
    Only a CUDA device that this process has already used can be lost."""
    if not device.startswith("cuda") or "torch" not in sys.modules:
        return None
    import torch

    if not torch.cuda.is_initialized():
        return None
    try:
        torch.cuda.synchronize(device)
        torch.ones(1, device=device).add_(1).cpu()
    except Exception as exc:  # the sticky error, whatever class this torch raises it as
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


def _device_of(item: pytest.Item) -> str | None:
    """The device the test runs on: its target's, or the run's one device for a test that
    takes no target (a report covers one device: see targets.build_targets)."""
    callspec = getattr(item, "callspec", None)
    target = callspec.params.get("qtarget") if callspec is not None else None
    if target is not None:
        return target.torch_device
    devices = {t.torch_device for t in item.config.stash.get(state.TARGETS, ()) if t.torch_device}
    return devices.pop() if len(devices) == 1 else None


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    lost = item.config.stash.get(LOST, None)
    if lost is None or _device_of(item) != lost[0]:
        return
    device, nodeid, error = lost
    outcomes.short_circuit(
        item,
        Verdict.CRASHED,
        nodeid,
        f"not run: {device} is unusable in this process after that test's fault ({error}); {REMEDY}",
    )


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    report = yield
    device = _device_of(item)
    if call.excinfo is None or device is None or item.config.stash.get(LOST, None) is not None:
        return report
    error = device_error(device)
    if error is None:
        return report
    message = f"{outcomes.DEVICE_LOST_PREFIX} {device} became unusable in {item.nodeid} ({error})"
    if hasattr(item.config, "workerinput"):
        sys.stderr.write(f"qconform: {message}; ending this worker so that the next test gets a fresh one\n")
        sys.stderr.flush()
        os._exit(WORKER_EXIT_CODE)
    item.config.stash[LOST] = (device, item.nodeid, error)
    report.longrepr = f"{report.longrepr}\n{message}; later tests on it end at once: {REMEDY}"
    outcomes.declare(report.user_properties, Verdict.CRASHED)
    return report
