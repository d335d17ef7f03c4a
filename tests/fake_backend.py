"""The source of a fake backend, for the conftests that pytester projects write.

``FAKE_BACKEND`` defines ``FakeBackend`` (available, version 1.0, NF4 at blocksize 64,
fp32, CPU; every operation raises) with ``torch``, ``Availability``, ``Backend`` and
``Capabilities`` imported: tests subclass it for the behaviour they need.
"""

import textwrap

FAKE_BACKEND = textwrap.dedent('''
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

''')
