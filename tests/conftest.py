"""Shared helpers for the plugin's own tests."""
import sys
import textwrap
from pathlib import Path

import pytest

# The example downstream backend is the correct base of the mutant zoo; import it from
# the checkout without installing it (the nox session installs it for real).
EXAMPLE_SRC = Path(__file__).resolve().parent.parent / "examples" / "downstream" / "src"
if str(EXAMPLE_SRC) not in sys.path:
    sys.path.insert(0, str(EXAMPLE_SRC))

FAKE_BACKEND_CONFTEST = textwrap.dedent('''
    import torch
    from pytest_qconform.backends.base import Availability, Backend, Capabilities

    class FakeBackend(Backend):
        """A backend with no library behind it: enough to test gating and reporting."""
        name = "fake"

        def availability(self):
            return Availability(True, "1.0")

        def capabilities(self, device):
            return Capabilities(("nf4",), (64,), False, (torch.float32,), ("cpu",))

        def quantize(self, weight, spec): raise NotImplementedError
        def dequantize(self, q, dtype): raise NotImplementedError
        def matmul(self, x, q, bias, compute_dtype): raise NotImplementedError
        def export_packed(self, q): raise NotImplementedError

    class MissingBackend(FakeBackend):
        name = "missing"

        def availability(self):
            return Availability(False, None, "missinglib: import failed: ModuleNotFoundError")

    def pytest_qconform_backends(config):
        return {"fake": FakeBackend, "missing": MissingBackend}
''')


@pytest.fixture
def fake_backend_project(pytester: pytest.Pytester) -> pytest.Pytester:
    """A pytester project whose conftest registers a fake and an unavailable backend."""
    pytester.makeconftest(FAKE_BACKEND_CONFTEST)
    return pytester
