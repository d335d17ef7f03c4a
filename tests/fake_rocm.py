"""ROCm devices simulated by faking torch's HIP attributes and device properties, so the
probe's ROCm branch (``torch.version.hip`` set, ``gcnArchName`` with feature suffixes) and
everything downstream of it run without an AMD GPU. Nothing is computed on these devices.

``DEVICES`` holds what ``torch.cuda.get_device_properties`` reports on a ROCm build for one
device of each kind (names and memory of the product the arch ships in);
``patch_torch(monkeypatch, arch)`` fakes it in this process; ``CONFTEST`` does the same in a
pytester project's conftest (for a subprocess run).
"""

from __future__ import annotations

import textwrap
import types

import pytest
from fake_backend import FAKE_BACKEND

HIP_VERSION = "6.4.43482-simulated"
GiB = 2**30

# arch -> (gcnArchName as ROCm reports it, device name, memory in bytes, compute units)
DEVICES: dict[str, tuple[str, str, int, int]] = {
    "gfx1200": ("gfx1200", "AMD Radeon RX 9060 XT", 16 * GiB, 32),
    "gfx942": ("gfx942:sramecc+:xnack-", "AMD Instinct MI300X", 192 * GiB, 304),
    "gfx1100": ("gfx1100", "AMD Radeon RX 7900 XTX", 24 * GiB, 96),
    "gfx90a": ("gfx90a:sramecc+:xnack-", "AMD Instinct MI250X", 64 * GiB, 110),
    "gfx1030": ("gfx1030", "AMD Radeon RX 6800 XT", 16 * GiB, 72),
}


def properties(arch: str) -> types.SimpleNamespace:
    gcn_arch_name, name, memory, units = DEVICES[arch]
    return types.SimpleNamespace(
        name=name, gcnArchName=gcn_arch_name, total_memory=memory, multi_processor_count=units, major=0, minor=0
    )


def patch_torch(monkeypatch: pytest.MonkeyPatch, arch: str) -> None:
    """This process's torch looks like a ROCm build with one ``arch`` device."""
    import torch

    props = properties(arch)
    monkeypatch.setattr(torch.version, "hip", HIP_VERSION)
    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_device", lambda device: None)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)


def conftest(arch: str) -> str:
    """A conftest that fakes a ROCm ``arch`` device for its session and registers ``fake``,
    a backend claiming the GPU and every dtype, so only the arch facts decide what runs."""
    gcn_arch_name, name, memory, units = DEVICES[arch]
    return FAKE_BACKEND + textwrap.dedent(f"""
        import types
        import torch

        _PROPS = types.SimpleNamespace(name={name!r}, gcnArchName={gcn_arch_name!r}, total_memory={memory},
                                       multi_processor_count={units}, major=0, minor=0)
        torch.version.hip = {HIP_VERSION!r}
        torch.version.cuda = None
        torch.cuda.is_available = lambda: True
        torch.cuda.device_count = lambda: 1
        torch.cuda.current_device = lambda: 0
        torch.cuda.set_device = lambda device: None
        torch.cuda.get_device_properties = lambda device=None: _PROPS

        class GpuFake(FakeBackend):
            def capabilities(self, device):
                return Capabilities(("nf4",), (64, 128), False, (torch.bfloat16, torch.float16, torch.float32),
                                    ("cpu", "cuda"))

        def pytest_qconform_backends(config):
            return {{"fake": GpuFake}}
    """)
