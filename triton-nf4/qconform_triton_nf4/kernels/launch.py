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
"""

from __future__ import annotations

import inspect
from typing import Any


class BoundLaunch:
    """``launch(*runtime_args)`` == ``kernel[grid](*runtime_args, **meta)`` for arguments of
    the same dtypes, alignments and integer classes as the first call's."""

    __slots__ = ("_grid", "_kernel", "_meta", "_runner", "_tail")

    def __init__(self, kernel: Any, grid: tuple[int, ...], meta: dict[str, Any]) -> None:
        self._kernel, self._grid, self._meta = kernel, tuple(grid), meta
        self._runner: Any = None
        self._tail: tuple[Any, ...] = ()

    def __call__(self, *args: Any) -> None:
        if self._runner is not None:
            self._runner(*args, *self._tail)
            return
        compiled = self._kernel[self._grid](*args, **self._meta)
        self._bind(compiled, len(args))

    def _bind(self, compiled: Any, runtime_count: int) -> None:
        """Keep ``compiled``'s runner and the constexpr values that follow the runtime
        arguments, when this Triton offers both; otherwise stay on the ordinary launch."""
        tail = constexpr_tail(self._kernel, runtime_count, self._meta)
        if compiled is None or tail is None or not hasattr(compiled, "__getitem__"):
            return
        grid = self._grid + (1,) * (3 - len(self._grid))
        self._runner, self._tail = compiled[grid], tail

    @property
    def bound(self) -> bool:
        """Whether calls skip ``kernel[grid]`` (after the first, on a compiled GPU kernel)."""
        return self._runner is not None


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
