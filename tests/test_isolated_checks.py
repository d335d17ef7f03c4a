"""The helpers behind the large-tensor checks: the sliced reference decoding, and the
child process that turns a crash into a failure (suites/_isolated.py, suites/_large.py)."""

from __future__ import annotations

import os
import types

import numpy as np
import pytest
import torch
from pytest_qconform.reference import bnb4, hqq4
from pytest_qconform.suites import _large
from pytest_qconform.suites._isolated import run_isolated
from pytest_qconform.suites._large import random_state, slice_blocks, slice_groups

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


def test_hqq_slices_decode_like_the_whole():
    """Slices of whole groups of HQQ's layout, whose 4-bit values come from the high nibbles
    (Q's first half of rows), the low ones (its second half) or both, repacked as HQQ packs."""
    packed = random_state(QuantSpec("hqq4", 64, axis=1), (30, 512), seed=1)  # 240 groups: halves of 120
    whole = hqq4.decode(packed).reshape(-1)
    for step in (128, 64 * 10, 64 * 120, 64 * 122, packed.shape[0] * packed.shape[1]):
        for start in range(0, whole.numel(), step):
            part = slice_groups(packed, start, step)
            assert torch.equal(hqq4.decode(part), whole[start : start + part.shape[0]]), (step, start)
    with pytest.raises(ValueError, match="not an even number of whole groups"):
        slice_groups(packed, 0, 64 * 3)
    with pytest.raises(ValueError, match="only axis 1"):
        slice_groups(random_state(QuantSpec("hqq4", 64, axis=0), (30, 512), seed=1), 0, 128)


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


def _example_backend(wrong_after: int | None = None):
    """The example backend of examples/downstream (it adopts bytes through ``from_packed``), or
    a twin whose matmul leaves the outputs of weight rows past ``wrong_after`` zero."""
    from qconform_example_nf4.backend import TorchNF4Backend

    return _truncating(TorchNF4Backend, wrong_after)


def _truncating(base: type, wrong_after: int | None):
    """``base()``, or with ``wrong_after`` a twin whose matmul leaves the outputs of weight
    rows past it zero."""
    if wrong_after is None:
        return base()

    class Truncates(base):
        def matmul(self, x, q, bias, compute_dtype):
            y = super().matmul(x, q, bias, compute_dtype).clone()
            y[..., wrong_after:] = 0
            return y

    return Truncates()


def test_the_large_tensor_check_runs_every_route_and_the_gradient_in_slices(monkeypatch):
    """``check_large_tensor`` at a CPU's size: slices of 64 weight rows (the 2^31-element run's
    are 2048), one matmul per route, the gradient summed over the slices; a correct backend
    passes, and one wrong only in the last slice's weight rows fails there."""
    pytest.importorskip("qconform_example_nf4")
    monkeypatch.setattr(_large, "CHUNK_ELEMENTS", 1 << 15)
    spec, shape = QuantSpec("nf4", 64, True), (300, 512)  # 5 slices of weight rows, 2 nested groups of bytes
    qcheck, properties = _checker()
    _large.check_large_tensor(_example_backend(), qcheck, spec, shape, "cpu", (1, 2, 33), backward=True)
    assert properties and all(value <= 1 for _, value in properties)
    qcheck, _ = _checker()
    with pytest.raises(AssertionError, match=r"matmul of 2\^31\+ elements at 1 rows, weight rows 256\.\.299"):
        _large.check_large_tensor(_example_backend(wrong_after=290), qcheck, spec, shape, "cpu", (1, 2))


def test_route_rows_take_one_activation_per_declared_route():
    from pytest_qconform.backends.base import Capabilities

    caps = Capabilities(("nf4",), (64,), False, (torch.bfloat16,), ("cuda",), max_gemv_rows=32, dispatch_rows=(4, 5))
    assert _large.route_rows(caps) == (1, 4, 5, 32, 33, 300)


def _hqq_backend(wrong_after: int | None = None):
    """HQQ's adapter (its PyTorch backend on a CPU), or a twin whose matmul leaves the
    outputs of weight rows past ``wrong_after`` zero."""
    pytest.importorskip("hqq")
    from pytest_qconform.backends.hqq import HqqBackend

    return _truncating(HqqBackend, wrong_after)


def test_the_large_tensor_check_reads_hqq_layout_in_slices(monkeypatch):
    """``check_large_tensor`` on HQQ's own layer at a CPU's size: random bytes in HQQ's layout
    adopted through ``from_packed``, its dequantization and matmuls against slices of whole
    groups, the gradient summed over them; a twin wrong only in the last weight rows fails there."""
    monkeypatch.setattr(_large, "CHUNK_ELEMENTS", 1 << 15)
    spec, shape = QuantSpec("hqq4", 64, axis=1), (300, 512)  # 5 slices of 64 weight rows
    qcheck, properties = _checker()
    _large.check_large_tensor(_hqq_backend(), qcheck, spec, shape, "cpu", (1, 5), backward=True)
    assert properties and all(value <= 1 for _, value in properties)
    qcheck, _ = _checker()
    with pytest.raises(AssertionError, match=r"matmul of 2\^31\+ elements at 1 rows, weight rows 256\.\.299"):
        _large.check_large_tensor(_hqq_backend(wrong_after=290), qcheck, spec, shape, "cpu", (1,))


def test_hqq_adopts_its_own_layout_bit_for_bit():
    """``from_packed`` then ``export_packed`` gives the bytes, scales and zeros it was handed;
    another layout is refused as not read."""
    backend = _hqq_backend()
    packed = random_state(QuantSpec("hqq4", 64, axis=1), (16, 256), seed=4)
    adopted = backend.export_packed(backend.from_packed(packed, torch.device("cpu")))
    for field in ("packed", "scale", "zero"):
        assert np.array_equal(getattr(adopted, field), getattr(packed, field)), field
    assert adopted.shape == packed.shape
    with pytest.raises(NotImplementedError, match="HQQ's layout only"):
        backend.from_packed(random_state(QuantSpec("nf4", 64), (4, 64), seed=1), torch.device("cpu"))
