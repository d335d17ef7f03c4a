"""A matmul plan's whole call in one native call: layout check, output allocation, launch.

Why: after the plans and bound launches (issue 27, issue 38), an eager call of a tiny
matmul on the H100 host cost 14.2 us, of which Triton's generated C ``launch`` took ~5
(it parses every argument from a Python tuple per call), ``x.new_empty`` ~3 and our Python
(plan key, lookup, closures) ~6 (bench/notes.md, "Issue 38"). tinygemm's ATen op is one
native call that allocates and launches; this is ours. ``native_launch.cpp`` keeps, per
plan, the compiled kernel's ``CUfunction``, its grid and a parameter buffer with every
argument that does not change between calls (the weight's pointers, the sizes and
strides) already packed; a call checks in C++ that x and bias are laid out as the plan's
(dtype, sizes, strides, pointer alignment, device: the plan key, so the adapter needs
no key to use it), allocates the output with ``at::empty``, patches the three pointers
that change (x, bias, out) and calls ``cuLaunchKernel`` on the current stream of x's
device. It returns None where the layout differs or autograd would record the call, and
the caller takes its validated route.

Same kernel, same arguments: the results are bit-equal to the Triton launch's
(tests/test_triton_plans.py and bench/host_cost.py check it on the GPU). The parameter
list is built from the compiled kernel's signature as Triton's own launcher builds it
(and as torch inductor's static launcher does): every argument that is not a
constexpr, then the hidden global and profile scratch pointers where this Triton
appends them (null: our kernels use no scratch; a kernel that does keeps Triton's
launch). Triton's launch hooks (profilers) do not see native launches; a hook set when a
plan is built keeps that plan on Triton's launch.

Built on first use with ``torch.utils.cpp_extension.load`` into torch's extensions
folder (cached across processes: a fresh machine compiles once, ~30-60 s). Where it
cannot be built or loaded (no compiler, a CPU or ROCm build of torch, an unknown
Triton) or ``QCONFORM_TRITON_NATIVE_LAUNCH=0`` is set, ``module()`` is
None and the plans keep Triton's C launch: the same results, ~5 us more per call.
"""

from __future__ import annotations

import os
import struct
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

ENV_SWITCH = "QCONFORM_TRITON_NATIVE_LAUNCH"  # "0": never build or use the native launch
SOURCE = Path(__file__).with_name("native_launch.cpp")

# Triton's parameter types -> how one 8-byte slot holds the value (little-endian, zero padded).
_PACK: dict[str, str] = {"i32": "<i4x", "u32": "<I4x", "i64": "<q", "u64": "<Q", "fp32": "<f4x"}

Launch = Callable[[torch.Tensor, "torch.Tensor | None"], "torch.Tensor | None"]


NAME = "qconform_nf4_launch_v1"  # the extension's name: its folder in torch's extensions folder
_LOADED: list[Any] = []  # the module (or None where it cannot be had), once decided


def module(*, wait: bool = False) -> Any | None:
    """The built extension, or None where it cannot be had here (module docstring); why it
    could not is in ``unavailable_reason()``.

    While another process builds it (the GPU warm-up's first worker, on a fresh machine:
    16-19 s on the H100 host), a caller that does not ``wait`` gets None for now, and asks
    again at its next plan: each pytest-xdist worker of a cold H100 run otherwise spent its
    first 5-9 s on torch's build lock (docs/run-times.md), for a launch a test does not need
    (Triton's gives the same results, ~5 us later)."""
    if _LOADED:
        return _LOADED[0]
    reason = _unavailable_before_build()
    if reason is not None:
        _REASON[0] = reason
        _LOADED.append(None)
        return None
    try:
        from torch.utils import cpp_extension

        if not wait and os.path.exists(os.path.join(cpp_extension._get_build_directory(NAME, False), "lock")):
            _REASON[0] = "another process is building it (Triton's launch until it is built)"
            return None
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            built = cpp_extension.load(
                name=NAME,
                sources=[str(SOURCE)],
                extra_cflags=["-O2"],
                extra_ldflags=["-ldl"],
                verbose=False,
            )
    except Exception as exc:  # noqa: BLE001 - any build or load failure means the Triton launch
        _REASON[0] = f"the native launch did not build or load: {type(exc).__name__}: {str(exc)[:400]}"
        built = None
    _LOADED.append(built)
    return built


_REASON: list[str | None] = [None]


def unavailable_reason() -> str | None:
    """Why ``module()`` is None (after it was asked), else None."""
    return _REASON[0]


def _unavailable_before_build() -> str | None:
    if os.environ.get(ENV_SWITCH, "1") == "0":
        return f"{ENV_SWITCH}=0"
    if torch.version.cuda is None or torch.version.hip is not None:
        return "not a CUDA build of torch"
    if not torch.cuda.is_available():
        return "no CUDA device"
    return None


def parameter_slots(compiled: Any, full_args: Sequence[Any]) -> list[tuple[int, str, Any]] | None:
    """The kernel's parameters as Triton's launcher passes them: (argument position, type,
    value) per non-constexpr argument of ``full_args`` (every argument, constexprs
    included, in signature order), then the hidden scratch pointers (position -1); None
    where some type or feature is not one this launch packs."""
    src = getattr(compiled, "src", None)
    fn = getattr(src, "fn", None)
    signature = getattr(src, "signature", None)
    metadata = getattr(compiled, "metadata", None)
    if fn is None or not isinstance(signature, dict) or metadata is None:
        return None
    names = list(fn.arg_names)
    if len(names) != len(full_args):
        return None
    constants = getattr(src, "constants", {}) or {}
    constant_indices = {key[0] if isinstance(key, tuple) else key for key in constants}
    constant_indices = {names.index(k) if isinstance(k, str) else k for k in constant_indices}
    slots: list[tuple[int, str, Any]] = []
    for index, name in enumerate(names):
        kind = signature.get(name, signature.get(index))
        if kind is None:
            return None
        if kind == "constexpr" or index in constant_indices:
            continue
        value = full_args[index]
        if kind.startswith("*"):
            slots.append((index, "ptr", value))
        elif kind in _PACK:
            slots.append((index, kind, value))
        else:
            return None
    for scratch in ("global_scratch_size", "profile_scratch_size"):
        if hasattr(metadata, scratch):
            if getattr(metadata, scratch):
                return None
            slots.append((-1, "ptr", 0))
    if getattr(metadata, "num_ctas", 1) != 1 or any(d != 1 for d in getattr(metadata, "cluster_dims", (1,)) or (1,)):
        return None
    if getattr(metadata, "launch_cooperative_grid", False) or getattr(metadata, "launch_pdl", False):
        return None
    return slots


def _pack(kind: str, value: Any) -> bytes:
    if kind == "ptr":
        address = value.data_ptr() if isinstance(value, torch.Tensor) else int(value or 0)
        return struct.pack("<Q", address)
    return struct.pack(_PACK[kind], value)


def make_launch(
    compiled: Any,
    grid: tuple[int, ...],
    full_args: Sequence[Any],
    roles: dict[str, int],
    x: torch.Tensor,
    bias: torch.Tensor | None,
    out_shape: Sequence[int],
    *,
    work_numel: int = 0,
    counter_numel: int = 0,
) -> Launch | None:
    """A native ``launch(x, bias) -> out | None`` of ``compiled`` on ``grid`` for calls laid
    out as ``x`` and ``bias``, or None where this process has no native launch or the kernel
    is not one it packs. ``full_args``: one call's arguments in signature order (the tensors
    that do not change between calls at their places); ``roles``: the argument positions of
    ``x``, ``bias``, ``out`` and, where the kernel has them, ``work`` (a fresh fp32
    workspace of ``work_numel`` per call) and ``counters`` (``counter_numel`` int32s per
    stream, zero before each launch, left zero by the kernel)."""
    native = module()
    if native is None or not _hooks_idle():
        return None
    function = getattr(compiled, "function", None)
    metadata = getattr(compiled, "metadata", None)
    slots = parameter_slots(compiled, full_args)
    if slots is None or function is None or metadata is None:
        return None
    positions = {position: slot for slot, (position, _, _) in enumerate(slots) if position >= 0}
    try:
        indices = [positions.get(roles[r], -1) if r in roles else -1 for r in ("x", "bias", "out", "work", "counters")]
    except KeyError:
        return None
    if min(indices[0], indices[2]) < 0 or ("bias" in roles and indices[1] < 0):
        return None
    packed = b"".join(_pack(kind, None if i in indices else value) for i, (_, kind, value) in enumerate(slots))
    absent = full_args[roles["bias"]] if "bias" in roles and bias is None else 0
    keep = tuple(v for v in full_args if isinstance(v, torch.Tensor) and v is not x)
    return native.make(
        int(function),
        grid,
        32 * int(metadata.num_warps),
        int(metadata.shared),
        packed,
        indices,
        x,
        bias,
        tuple(out_shape),
        work_numel,
        counter_numel,
        absent.data_ptr() if isinstance(absent, torch.Tensor) else int(absent),
        keep,
    )


def _hooks_idle() -> bool:
    """No Triton launch hook is set (a profiler's): a native launch would not call it."""
    try:
        from triton import knobs
    except ImportError:
        return True
    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True
