"""Running our Triton kernels without a GPU: Triton's interpreter, set up before anything
imports triton, or a clear reason why it cannot be.

Triton decides between compiler and interpreter when ``@triton.jit`` decorates a
function, reading ``TRITON_INTERPRET`` then. That includes triton's own standard library
(``tl.cdiv``, reductions, ...), decorated when ``triton.language`` is first imported. A
downstream ``conftest.py`` that imports bitsandbytes (which imports triton) before the
plugin set the variable leaves that library compiled, and every interpreted kernel that
calls into it fails with "Cannot call @triton.jit'd outside of the scope of a kernel".

So the plugin sets the variable in ``pytest_load_initial_conftests`` (before any
conftest.py is imported) when ``--qconform`` runs without a GPU, and the triton-nf4
backend reports itself unavailable, with this module's reason, when triton was imported
even earlier (by a ``-p`` plugin, or by the process that called ``pytest.main``).
"""

from __future__ import annotations

import os
import sys

INTERPRET_ENV = "TRITON_INTERPRET"


def needs_interpreter(simulate: str | None) -> bool:
    """No GPU to compile for: a simulated probe, or torch sees none."""
    if simulate:
        return True
    try:
        import torch
    except Exception:  # noqa: BLE001 - no torch: nothing will run anyway
        return True
    return not torch.cuda.is_available()


def prepare(qconform: bool, simulate: str | None) -> None:
    """Set ``TRITON_INTERPRET=1`` for a ``--qconform`` run without a GPU (an explicit value stays)."""
    if qconform and needs_interpreter(simulate):
        os.environ.setdefault(INTERPRET_ENV, "1")


def stdlib_problem() -> str | None:
    """Why interpreted kernels cannot run in this process, or None.

    Only meaningful when the kernels run interpreted: triton's standard library must have
    been decorated for the interpreter too, i.e. triton imported after the variable was set.
    """
    if "triton.language.standard" not in sys.modules and "triton" not in sys.modules:
        return None  # not imported yet: it will be imported with the variable set
    try:
        import triton.language.standard as standard
        from triton.runtime.jit import JITFunction
    except Exception:  # noqa: BLE001 - a different triton layout: nothing to say
        return None
    compiled = sorted(name for name, value in vars(standard).items() if type(value) is JITFunction)
    if not compiled:
        return None
    return (
        f"triton was imported before {INTERPRET_ENV}=1 was set (by a -p plugin, or by the process that started "
        f"pytest), so its standard library ({', '.join(compiled[:3])}, ...) was built for the compiler and the "
        "interpreted kernels cannot call it. Set TRITON_INTERPRET=1 in the environment of the pytest command, "
        "or import triton (and bitsandbytes) only in conftest.py files"
    )
