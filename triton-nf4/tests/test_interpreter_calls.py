"""Triton's interpreter with ``interpreter_calls`` installed: a kernel launch patches
``triton.language`` once, however many ``@triton.jit`` helpers it calls, computes the same,
and leaves the language as it found it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402  (after TRITON_INTERPRET)

from qconform_triton_nf4 import kernels  # noqa: E402
from qconform_triton_nf4.kernels import interpreter_calls  # noqa: E402

pytestmark = pytest.mark.skipif(not kernels.interpreter_active(), reason="Triton's interpreter is off (a GPU)")
BLOCK = 16


@triton.jit
def _double(v):
    return v * 2


@triton.jit
def _no_helper_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets) * 16)


@triton.jit
def _helper_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    v = _double(_double(_double(_double(tl.load(x_ptr + offsets)))))
    tl.store(out_ptr + offsets, v)


def _builtin_patches(monkeypatch: pytest.MonkeyPatch, kernel, x: torch.Tensor) -> tuple[int, torch.Tensor]:
    """How many ``_patch_builtin`` scans one launch of ``kernel`` makes, and its output."""
    from triton.runtime import interpreter

    scans = []
    original = interpreter._patch_builtin
    monkeypatch.setattr(interpreter, "_patch_builtin", lambda *a: scans.append(a) or original(*a))
    out = torch.empty_like(x)
    kernel[(1,)](x, out, BLOCK=BLOCK)
    monkeypatch.setattr(interpreter, "_patch_builtin", original)
    return len(scans), out


def test_helper_calls_do_not_patch_the_language_again(monkeypatch: pytest.MonkeyPatch) -> None:
    assert interpreter_calls.install()  # installed with the kernels; installing again is a no-op
    x = torch.arange(BLOCK, dtype=torch.float32)
    plain_scans, plain = _builtin_patches(monkeypatch, _no_helper_kernel, x)
    helper_scans, helped = _builtin_patches(monkeypatch, _helper_kernel, x)
    assert plain_scans > 0
    assert helper_scans == plain_scans  # four helper calls, no scan of their own
    assert torch.equal(plain, x * 16) and torch.equal(helped, x * 16)


def test_a_launch_leaves_the_language_as_it_found_it() -> None:
    before = {name: getattr(tl, name) for name in ("load", "store", "arange", "multiple_of", "max_contiguous")}
    x = torch.arange(BLOCK, dtype=torch.float32)
    _helper_kernel[(1,)](x, torch.empty_like(x), BLOCK=BLOCK)
    assert {name: getattr(tl, name) for name in before} == before
