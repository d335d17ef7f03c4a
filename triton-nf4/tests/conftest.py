"""Shared set-up for the Triton wing's own tests."""

import os

import torch

# Imported once, here, before any pytester fixture snapshots sys.modules: a second import of
# torch into one process segfaults, and a second import of triton's language modules leaves the
# interpreter patching the new ones while the kernels hold the old ("Cannot call @triton.jit'd
# outside of the scope of a kernel"). Without a GPU the kernels run in Triton's interpreter, as
# the wing's plugin arranges for a run; the test files say the same.
import pytest_qconform.backends.base  # noqa: F401  (torch under it)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import qconform_triton_nf4.kernels  # noqa: F401
except ImportError:  # no triton: the tests that need it skip
    pass
