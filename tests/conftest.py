"""Shared helpers for the plugin's own tests."""

import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# Imported once, here, before any pytester fixture snapshots sys.modules. The plugin imports
# neither torch nor the backend contract when off, so otherwise the first in-process run
# (runpytest) imports them, the snapshot's restore drops them, and the next run imports them
# again: torch a second time into one process segfaults ("module functions cannot set
# METH_CLASS or METH_STATIC"), and a conftest's Availability is no longer the plugin's.
import pytest_qconform.session.state  # noqa: F401  (torch and backends.base under it)

# Likewise triton and our kernels: a second import of triton's language modules leaves the
# interpreter patching the new ones while the kernels hold the old ("Cannot call
# @triton.jit'd outside of the scope of a kernel"). Without a GPU the kernels run in
# Triton's interpreter, as the plugin arranges for a run; the test files say the same.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
try:
    import qconform_triton_nf4.kernels  # noqa: F401
except ImportError:  # no triton: the tests that need it skip
    pass

from fake_backend import FAKE_BACKEND

# The example downstream backend is the correct base of the mutant zoo; import it from
# the checkout without installing it (the nox session installs it for real).
EXAMPLE_SRC = Path(__file__).resolve().parent.parent / "examples" / "downstream" / "src"
if str(EXAMPLE_SRC) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_SRC))

FAKE_BACKEND_CONFTEST = FAKE_BACKEND + textwrap.dedent("""
    class MissingBackend(FakeBackend):
        name = "missing"

        def availability(self):
            return Availability(False, None, "missinglib: import failed: ModuleNotFoundError")

    def pytest_qconform_backends(config):
        return {"fake": FakeBackend, "missing": MissingBackend}
""")


@pytest.fixture
def fake_backend_project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester project whose conftest registers a fake and an unavailable backend."""
    pytester.makeconftest(FAKE_BACKEND_CONFTEST)
    return pytester
