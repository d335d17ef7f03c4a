"""Run one check in a child process, so that a crash there ends in a verdict.

A kernel that indexes past 2^31 elements with int32 offsets does not raise: it reads
or writes out of bounds, and on a GPU the first illegal access poisons the CUDA context
of the whole process, failing every test after it (or kills it). The child builds the
backend again from the registry (by name), runs the check with a checker of its own and
sends back the worst error multiple and the failure, if any; a child that dies is a
failure naming its exit code. A backend the registry cannot build (one registered by a
conftest hook) runs in this process instead.
"""

from __future__ import annotations

import importlib
import multiprocessing
import types
from typing import Any

import pytest

from pytest_qconform.backends import registry
from pytest_qconform.backends.base import Backend
from pytest_qconform.session.fixtures import Checker
from pytest_qconform.session.outcomes import MULTIPLE_PROPERTY

CHILD_TIMEOUT_S = 1800.0


def _resolve(ref: str) -> Any:
    module, _, name = ref.partition(":")
    return getattr(importlib.import_module(module), name)


def _child(conn: Any, ref: str, backend_name: str, args: tuple) -> None:
    item = types.SimpleNamespace(user_properties=[])
    try:
        _resolve(ref)(registry.create(backend_name), Checker(item), *args)
        outcome = ("pass", "")
    except pytest.skip.Exception as exc:
        outcome = ("skip", str(exc.msg))
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the parent as the failure
        outcome = ("fail", f"{type(exc).__name__}: {exc}")
    multiples = [value for name, value in item.user_properties if name == MULTIPLE_PROPERTY]
    conn.send((*outcome, max(multiples, default=None)))
    conn.close()


def run_isolated(ref: str, backend: Backend, qcheck: Checker, *args: Any) -> None:
    """Call ``ref(backend, checker, *args)`` (``"module:function"``) in a spawned child
    and report its outcome through ``qcheck``: a pass records the child's worst error
    multiple, a skip skips, a failure or a dead child raises AssertionError."""
    if backend.name not in registry.discover():
        _resolve(ref)(backend, qcheck, *args)
        return
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_child, args=(send, ref, backend.name, args), daemon=True)
    child.start()
    send.close()
    try:
        outcome = receive.recv() if receive.poll(CHILD_TIMEOUT_S) else None
    except EOFError:  # the child exited without a word (a library that calls exit() on a device error)
        outcome = None
    child.join(60)
    if outcome is None:
        if child.is_alive():
            child.kill()
        raise AssertionError(
            f"the check ran in a child process that exited with code {child.exitcode} (negative: "
            f"killed by that signal; None: still running after {CHILD_TIMEOUT_S:g} s) before "
            "reporting a result: a crash (its stderr is in the captured output); " + qcheck._where()
        )
    status, message, multiple = outcome
    if multiple is not None:
        qcheck.record_multiple(multiple)
    if status == "skip":
        pytest.skip(message)
    if status == "fail":
        raise AssertionError(f"in a child process: {message}; " + qcheck._where())
