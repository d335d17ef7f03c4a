"""The helpers behind the large-tensor checks: the sliced reference decoding, and the
child process that turns a crash into a failure (suites/_isolated.py, suites/_large.py)."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bnb4
from pytest_qconform.suites._isolated import run_isolated
from pytest_qconform.suites._large import random_state, slice_blocks

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.session.fixtures import Checker


@pytest.mark.parametrize("spec", (QuantSpec("nf4", 64), QuantSpec("fp4", 128, True)), ids=QuantSpec.label)
def test_slices_decode_like_the_whole(spec):
    packed = random_state(spec, (3, 64 * 256 + 10), seed=1)  # 3 nested groups and a partial last block
    whole = bnb4.decode(packed).reshape(-1)
    step = spec.blocksize * 256
    for start in range(0, packed.numel, step):
        part = slice_blocks(packed, start, step)
        assert torch.equal(bnb4.decode(part), whole[start : start + part.numel])
    with pytest.raises(ValueError, match="does not start a group"):
        slice_blocks(packed, spec.blocksize + 2, step)  # mid-block


def _exits(backend, qcheck) -> None:
    os._exit(3)


def _fails(backend, qcheck) -> None:
    qcheck.within(torch.ones(2), torch.zeros(2), torch.full((2,), 0.5), "planted error")


def _passes(backend, qcheck) -> None:
    qcheck.within(torch.zeros(2), torch.zeros(2), torch.ones(2), "no error")
    assert backend.name == "hqq"


def _checker() -> tuple[Checker, list]:
    properties: list = []
    return Checker(types.SimpleNamespace(user_properties=properties)), properties


def test_a_child_that_dies_is_a_failure_naming_its_exit_code():
    qcheck, _ = _checker()
    with pytest.raises(AssertionError, match="exited with code 3"):
        run_isolated(f"{__name__}:_exits", types.SimpleNamespace(name="hqq"), qcheck)


def test_a_child_failure_and_its_error_multiple_come_back():
    qcheck, properties = _checker()
    with pytest.raises(AssertionError, match="in a child process: AssertionError: planted error: error is 2"):
        run_isolated(f"{__name__}:_fails", types.SimpleNamespace(name="hqq"), qcheck)
    assert properties and properties[-1][1] == pytest.approx(2.0)
    qcheck, properties = _checker()
    run_isolated(f"{__name__}:_passes", types.SimpleNamespace(name="hqq"), qcheck)
    assert properties[-1][1] == 0.0


def test_random_state_has_the_layout_the_reference_reads():
    packed = random_state(QuantSpec("nf4", 64, True), (4, 1000), seed=2)
    assert np.asarray(packed.packed).size == 2000 and bnb4.decode(packed).shape == (4, 1000)
