"""Triton's CPU interpreter without its per-call re-patching of ``triton.language``.

Why: when an interpreted kernel calls a ``@triton.jit`` helper, Triton (3.9 checked)
patches ``triton.language`` again for the helper (``interpreter._patch_lang``: an
``inspect.getmembers`` scan of four modules), although the kernel's launch patched the same
modules a moment before and restores them when it ends; the helper's own patches are never
restored at all. Our tensor-core kernel calls its helpers a few thousand times per launch,
and the scans were a third of its interpreted time (7.8 of 22 s in one layer check, a
cProfile of ``test_layer_forward_in_every_mode``). triton-viz skips the same re-patching for
the same reason (Deep-Learning-Profiling-Tools/triton-viz#407).

So, inside a launch, a helper whose ``triton.language`` modules the launch has patched
already is called without patching them again. Every operation still runs through the
interpreter's patched functions, so results are the same bit for bit; a helper that sees a
module the launch did not patch is patched as before. Installed only where the kernels were
built for the interpreter, and only if this Triton has the pieces it wraps.
"""

from __future__ import annotations

import functools
import inspect
import threading
from typing import Any

_state = threading.local()


_modules_of: dict[Any, frozenset[int]] = {}  # per jit function: its globals' language modules


def _language_modules(fn: Any, tl: Any) -> frozenset[int]:
    """The ``triton.language`` modules ``fn``'s globals hold: what ``_patch_lang`` patches.
    Read once per function (a module's imports do not change while its kernels run)."""
    found = _modules_of.get(fn)
    if found is None:
        found = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
        _modules_of[fn] = found
    return found


def install() -> bool:
    """Wrap the interpreter's launch and ``_patch_lang`` once; False where this Triton lacks them."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:
        return False
    executor = getattr(interpreter, "GridExecutor", None)
    patch_lang = getattr(interpreter, "_patch_lang", None)
    scope_type = getattr(interpreter, "_LangPatchScope", None)
    if executor is None or patch_lang is None or scope_type is None:
        return False
    if getattr(patch_lang, "_qconform_wrapped", False):
        return True
    launch = executor.__call__

    @functools.wraps(launch)
    def launch_tracking_patches(self: Any, *args: Any, **kwargs: Any) -> Any:
        _state.patched = frozenset()
        try:
            return launch(self, *args, **kwargs)
        finally:
            _state.patched = None

    @functools.wraps(patch_lang)
    def patch_lang_once_per_launch(fn: Any) -> Any:
        patched = getattr(_state, "patched", None)
        modules = _language_modules(fn, tl)
        if patched is not None and modules and modules <= patched:
            return scope_type()  # nothing changed, nothing to restore
        scope = patch_lang(fn)
        if patched is not None:
            _state.patched = patched | modules
        return scope

    patch_lang_once_per_launch._qconform_wrapped = True  # type: ignore[attr-defined]
    executor.__call__ = launch_tracking_patches
    interpreter._patch_lang = patch_lang_once_per_launch
    return True
