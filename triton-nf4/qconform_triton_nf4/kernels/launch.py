"""One Triton kernel launch bound once: grid and constexprs fixed, runtime arguments per call.

Why: ``kernel[grid](*args, **meta)`` does all of its work again on every call: it binds
the arguments to the signature, computes the specialization key (dtypes, pointer
alignment, integer classes of every argument), looks the compiled kernel up, checks the
globals it read and canonicalizes the grid. From Python in an eager loop that is a large
part of a small gemv's cost (bench/notes.md, "Host cost per call"). A caller that
already knows those facts cannot change between calls (``plan_gemv`` and
``plan_dequantize`` key their plans on every property Triton specializes on) launches the
compiled kernel directly: ``CompiledKernel[grid](*every_argument)``, the runner Triton's
own ``run`` ends in (Triton 3.3 and later pass every parameter, constexprs included, in
signature order).

The first call goes through ``kernel[grid]`` (it compiles, or finds the kernel in
Triton's caches) and keeps the ``CompiledKernel`` it returns. Triton's interpreter
returns none, and a kernel whose constexprs do not all follow its runtime parameters
cannot be bound this way: those keep the ordinary launch on every call.

Below the runner, a bound launch calls Triton's launcher itself (``direct_launcher``): the
runner looks the device and stream up through Python, builds launch metadata for the
launch hooks, and in Triton 3.6 always calls the hooks, which are empty ``HookChain``s
unless a profiler added one; the ``CudaLauncher`` then defines two closures for scratch
memory our kernels do not use. With no hook set and no scratch memory, the bound launch
passes the current stream (``torch._C._cuda_getCurrentRawStream`` of the current device,
what Triton's runner reads) and the compiled function straight to the generated C
``launch`` (Triton 3.6's argument order, checked on the H100) or, on another Triton, to
the ``CudaLauncher`` (whose argument order 3.3 to 3.9 share). A hook set later sends that
call through the runner (bench/notes.md, "Host cost per call, second round").
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Callable
from typing import Any

import torch


class BoundLaunch:
    """``launch(*runtime_args)`` == ``kernel[grid](*runtime_args, **meta)`` for arguments of
    the same dtypes, alignments and integer classes as the first call's."""

    __slots__ = ("_compiled", "_grid", "_kernel", "_meta", "_runner", "_tail")

    def __init__(self, kernel: Any, grid: tuple[int, ...], meta: dict[str, Any]) -> None:
        self._kernel, self._grid, self._meta = kernel, tuple(grid), meta
        self._runner: Callable[..., Any] | None = None
        self._compiled: Any = None
        self._tail: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> None:
        runner = self._runner
        if runner is not None:
            runner(*args)
            return
        compiled = self._kernel[self._grid](*args, **self._meta)
        self._bind(compiled, len(args))

    def _bind(self, compiled: Any, runtime_count: int) -> None:
        """Keep a launch of ``compiled`` with the constexpr values that follow the runtime
        arguments appended, when this Triton offers both; otherwise stay on the ordinary launch."""
        tail = constexpr_tail(self._kernel, runtime_count, self._meta)
        if compiled is None or tail is None or not hasattr(compiled, "__getitem__"):
            return
        grid = self._grid + (1,) * (3 - len(self._grid))
        runner = compiled[grid]
        self._runner = direct_launcher(compiled, grid, tail, runner) or (lambda *args: runner(*args, *tail))
        self._compiled, self._tail = compiled, tail

    def native(
        self,
        args: tuple[Any, ...],
        roles: dict[str, int],
        x: torch.Tensor,
        bias: torch.Tensor | None,
        out_shape: tuple[int, ...],
        **workspace: int,
    ) -> Any:
        """This launch as one native call that also allocates its output
        (``native_launch.make_launch``: ``launch(x, bias) -> out | None``), once bound; None
        before, or where this process has no native launch. ``args``: one call's runtime
        arguments, the per-call tensors' places (``roles``) holding anything."""
        if self._compiled is None:
            return None
        from qconform_triton_nf4.kernels.native_launch import make_launch

        grid = self._grid + (1,) * (3 - len(self._grid))
        return make_launch(self._compiled, grid, (*args, *self._tail), roles, x, bias, out_shape, **workspace)

    @property
    def bound(self) -> bool:
        """Whether calls skip ``kernel[grid]`` (after the first, on a compiled GPU kernel)."""
        return self._runner is not None


def pointers(values: tuple[Any, ...]) -> tuple[Any, ...]:
    """``values`` with each CUDA tensor replaced by its data pointer: what a plan passes a
    bound launch for the tensors that are the same on every call (the weight's), sparing the
    launcher a ``data_ptr()`` call and a pointer-attribute query per tensor and launch. Only
    for a bound launch (the first, compiling call must see tensors: Triton specializes on
    their dtypes); the plan keeps the tensors alive. NVIDIA only: Triton 3.6's CUDA launcher
    takes an int as a pointer (read there); its ROCm launcher was not checked."""
    if torch.version.hip is not None:
        return values
    return tuple(v.data_ptr() if isinstance(v, torch.Tensor) and v.is_cuda else v for v in values)


# Triton versions whose generated C ``launch`` takes (grid x3, stream, function, cooperative,
# pdl, global scratch, profile scratch, kernel metadata, launch metadata, enter hook, exit
# hook, *arguments): read in Triton 3.6's nvidia/driver.py and run on the H100.
C_LAUNCH_VERSIONS: tuple[str, ...] = ("3.6.",)


def _hooks_idle(runtime: Any) -> bool:
    """No launch hook is set (Triton 3.6: empty ``HookChain``s; earlier: None)."""
    for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return False
    return True


def direct_launcher(
    compiled: Any, grid: tuple[int, ...], tail: tuple[Any, ...], runner: Callable[..., Any]
) -> Callable[..., None] | None:
    """``launch(*runtime_args)`` through Triton's launcher below the runner (module
    docstring), or None where it does not apply: not an NVIDIA ``CudaLauncher``, scratch
    memory, or a Triton that does not say. Falls back to ``runner`` on a call made while
    a launch hook is set."""
    try:
        import triton
        from triton import knobs
    except ImportError:
        return None
    launcher: Any = getattr(compiled, "run", None)
    if (
        torch.version.hip is not None
        or type(launcher).__name__ != "CudaLauncher"
        or getattr(launcher, "global_scratch_size", True)
        or getattr(launcher, "profile_scratch_size", True)
    ):
        return None
    function, metadata = compiled.function, compiled.packed_metadata
    grid_x, grid_y, grid_z = grid
    runtime = knobs.runtime
    current_device: Any = getattr(torch._C, "_cuda_getDevice", None)
    current_stream: Any = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if current_device is None or current_stream is None:
        return None
    c_launch: Any = getattr(launcher, "launch", None)
    if triton.__version__.startswith(C_LAUNCH_VERSIONS) and c_launch is not None:
        cooperative, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        descriptors = leading_descriptors(compiled)
        if descriptors is None:
            return None
        if descriptors:  # the C launch under Triton's encoding wrapper, the descriptors encoded here
            c_launch = _under_descriptor_wrapper(c_launch)
            if c_launch is None:
                return None
        encode, count = (DescriptorEncodings(descriptors) if descriptors else None), len(descriptors)

        def launch(*args: Any) -> None:
            if not _hooks_idle(runtime):
                runner(*args, *tail)
                return
            stream = current_stream(current_device())
            if encode is not None:
                args = (*encode(args), *args[count:])
            c_launch(
                grid_x, grid_y, grid_z, stream, function, cooperative, pdl, None, None, metadata, None, None, None,
                *args, *tail,
            )  # fmt: skip

        return launch

    def launch_through_launcher(*args: Any) -> None:
        if not _hooks_idle(runtime):
            runner(*args, *tail)
            return
        launcher(
            grid_x, grid_y, grid_z, current_stream(current_device()), function, metadata, None, None, None, *args, *tail
        )

    return launch_through_launcher


def leading_descriptors(compiled: Any) -> list[dict[str, Any]] | None:
    """The encoding metadata (``tensordesc_meta``) of ``compiled``'s tensor-descriptor
    parameters when they are its first ones ([] when it has none), or None when they are not
    leading or Triton lowered one without a ``CUtensorMap`` (no metadata to encode it by)."""
    signature = getattr(getattr(compiled, "src", None), "signature", None)
    if not isinstance(signature, dict):
        return None
    kinds = [isinstance(sig, str) and sig.startswith("tensordesc") for sig in signature.values()]
    count = sum(kinds)
    if count == 0:
        return []
    metas = getattr(compiled.metadata, "tensordesc_meta", None)
    if kinds[:count] != [True] * count or not metas or len(metas) != count or any(m is None for m in metas):
        return None
    return list(metas)


def _under_descriptor_wrapper(c_launch: Any) -> Callable[..., None] | None:
    """The generated C ``launch`` of a kernel with TMA descriptor parameters: Triton 3.6
    wraps it in a Python loop that encodes every descriptor into a ``CUtensorMap`` on every
    call (``wrap_handle_tensordesc``: ``inner``, closing over ``launcher``); None where the
    wrapper is not that one."""
    raw = inspect.getclosurevars(c_launch).nonlocals.get("launcher") if inspect.isfunction(c_launch) else None
    return raw if callable(raw) else None


class DescriptorEncodings:
    """``encode(args)``: the launch arguments of the leading TMA descriptors in ``args``,
    each encoded by Triton's own ``make_tensordesc_arg`` with its metadata, except one passed
    again at its place (the same object: the weight's, made once by its plan, which keeps its
    memory), whose encoding is reused. The last descriptor of each place is held weakly: an
    x's must not outlive its call."""

    __slots__ = ("_encode", "_last", "_metas")

    def __init__(self, metas: list[dict[str, Any]]) -> None:
        self._metas = metas
        self._last: list[tuple[Callable[[], Any], list[Any]]] = [(lambda: None, [])] * len(metas)
        from triton.backends.nvidia.driver import make_tensordesc_arg

        self._encode: Callable[..., list[Any]] = make_tensordesc_arg

    def __call__(self, args: tuple[Any, ...]) -> list[Any]:
        expanded: list[Any] = []
        for place, meta in enumerate(self._metas):
            descriptor = args[place]
            last, values = self._last[place]
            if last() is not descriptor:
                values = self._encode(descriptor, meta)
                self._last[place] = (weakref.ref(descriptor), values)
            expanded += values
        return expanded


def constexpr_tail(kernel: Any, runtime_count: int, meta: dict[str, Any]) -> tuple[Any, ...] | None:
    """The values of ``kernel``'s parameters after its first ``runtime_count`` (all of them
    constexprs, from ``meta`` or their defaults), or None when the kernel does not have that
    shape or does not say (an interpreted kernel, an unknown Triton)."""
    signature = getattr(kernel, "signature", None)
    constexprs = getattr(kernel, "constexprs", None)
    if not isinstance(signature, inspect.Signature) or constexprs is None:
        return None
    params = list(signature.parameters.values())
    if any(num < runtime_count for num in constexprs) or set(range(runtime_count, len(params))) != set(constexprs):
        return None
    tail = []
    for param in params[runtime_count:]:
        if param.name in meta:
            tail.append(meta[param.name])
        elif param.default is not inspect.Parameter.empty:
            tail.append(param.default)
        else:
            return None
    return tuple(tail)
