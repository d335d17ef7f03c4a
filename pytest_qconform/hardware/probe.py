"""What hardware and software this run has: one frozen record, computed once per session.

The probe is the only place that asks torch about the device. Everything downstream
(markers, targets, skip reasons, the report) reads the record, so a simulated probe
drives exactly the same gating as a real one.
"""

from __future__ import annotations

import dataclasses
import json
import platform
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from pytest_qconform.hardware import archs

SIMULATE_ENV = "QCONFORM_SIMULATE"


@dataclass(frozen=True)
class BackendStatus:
    """One backend's load result: its version, or the exact reason it cannot load."""

    name: str
    available: bool
    version: str | None
    reason: str = ""
    notes: tuple[str, ...] = ()  # warnings and log lines loading it emitted (startup_notes.py)

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"available": self.available, "version": self.version, "reason": self.reason}
        if self.notes:
            data["notes"] = list(self.notes)
        return data


@dataclass(frozen=True)
class Probe:
    """The run's hardware and software. ``simulated`` probes computed nothing on ``arch``."""

    device_kind: str  # "cpu" | "cuda" | "rocm"
    arch: str  # "sm90", "gfx1200", or the CPU's machine ("x86_64")
    family: str | None
    device_name: str
    host: str
    torch: str | None
    cuda: str | None
    hip: str | None
    bf16: bool
    default_blocksize: int
    simulated: bool = False
    triton: str | None = None
    python: str = platform.python_version()
    # torch's CPU kernel level ("AVX512", "AVX2", "DEFAULT", ...): CPU backends pick code
    # paths by it, so a CPU known failure can be narrowed to it.
    cpu_capability: str | None = None
    # The GPU's memory in bytes (``total_memory``): sizes what a runner can hold (the warm-up's
    # workers, the largest shapes); None on a CPU or simulated probe.
    device_memory: int | None = None
    # The GPU driver's version (NVIDIA kernel module, or amdgpu's), where the host exposes it:
    # a backend can work with one driver and fail with another on the same arch and wheels.
    driver: str | None = None
    backends: tuple[BackendStatus, ...] = field(default=())
    notes: tuple[str, ...] = ()  # warnings and log lines probing the hardware emitted
    # The GPUs this process sees (0 on a CPU or simulated probe) and how they are linked: one
    # line per device and one per pair (peer access, and the link nvidia-smi names: NV18,
    # PIX, SYS, ...). The multi-device and distributed cells need two (docs/running.md).
    device_count: int = 0
    topology: tuple[str, ...] = ()

    def with_notes(self, notes: list[str] | tuple[str, ...]) -> Probe:
        return dataclasses.replace(self, notes=tuple(notes))

    @property
    def has_gpu(self) -> bool:
        return self.device_kind in ("cuda", "rocm") and not self.simulated

    def with_backends(self, statuses: tuple[BackendStatus, ...]) -> Probe:
        return dataclasses.replace(self, backends=statuses)

    def backend(self, name: str) -> BackendStatus | None:
        return next((b for b in self.backends if b.name == name), None)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["backends"] = {b.name: b.to_dict() for b in self.backends}
        data["notes"] = list(self.notes)
        data["topology"] = list(self.topology)
        data["schema_version"] = 1
        return data

    def summary(self) -> str:
        """One line: what a skip reason says was found."""
        sim = " (simulated, no device)" if self.simulated else ""
        return f"{self.device_kind} {self.arch}{sim}, torch {self.torch}"

    def lines(self) -> list[str]:
        """The human-readable report used by the run header and ``qconform doctor``."""
        facts = archs.facts_for(self.arch)
        out = [
            f"qconform probe: {self.device_kind} {self.arch}"
            + (f" ({self.family})" if self.family else "")
            + (" [SIMULATED: nothing runs on this device]" if self.simulated else ""),
            f"  device: {self.device_name}"
            + (f" ({self.device_memory / 2**30:.1f} GiB)" if self.device_memory else "")
            + f"  host: {self.host}",
            f"  torch {self.torch}  cuda {self.cuda}  hip {self.hip}  triton {self.triton}  python {self.python}"
            + (f"  driver {self.driver}" if self.driver else ""),
            f"  devices: {self.device_count}" + (f" ({'; '.join(self.topology)})" if self.topology else ""),
            f"  bf16: {'yes' if self.bf16 else 'no'}  default 4-bit blocksize: {self.default_blocksize}"
            + (f"  wave size: {facts.wave_size}" if facts else "")
            + f"  cpu capability: {self.cpu_capability}",
        ]
        for b in self.backends:
            state = f"{b.version}" if b.available else f"unavailable: {b.reason}"
            out.append(f"  backend {b.name}: {state}")
        from pytest_qconform.hardware.startup_notes import one_line

        notes = one_line({"probe": self.notes, **{b.name: b.notes for b in self.backends}})
        if notes:
            out.append(f"  {notes}")
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _module_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - any metadata problem means "unknown"
        return None


def probe_hardware(simulate: str | None = None) -> Probe:
    """Ask torch what device this run has; ``simulate`` names an arch to pretend to be."""
    host = socket.gethostname()
    try:
        import torch
    except Exception as exc:  # noqa: BLE001 - no torch: a CPU run with nothing to test
        return Probe(
            "cpu",
            platform.machine(),
            None,
            f"torch unavailable: {exc}",
            host,
            None,
            None,
            None,
            False,
            archs.CPU_DEFAULT_BLOCKSIZE,
            triton=_module_version("triton"),
        )
    torch_version = str(torch.__version__)
    triton_version = _module_version("triton")
    if simulate:
        return simulated_probe(simulate, host=host, torch_version=torch_version, triton_version=triton_version)
    cpu_capability = _cpu_capability(torch)
    hip = getattr(torch.version, "hip", None)
    cuda = getattr(torch.version, "cuda", None)
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        if hip:
            arch = archs.normalize_gcn_arch(getattr(props, "gcnArchName", "") or "unknown")
            kind = "rocm"
        else:
            arch = archs.cuda_arch(props.major, props.minor)
            kind = "cuda"
        facts = archs.facts_for(arch)
        bf16 = facts.bf16 if facts else bool(torch.cuda.is_bf16_supported())
        blocksize = (
            facts.default_blocksize
            if facts
            else (archs.ROCM_DEFAULT_BLOCKSIZE if hip else archs.CUDA_DEFAULT_BLOCKSIZE)
        )
        memory = getattr(props, "total_memory", None)
        return Probe(
            kind,
            arch,
            facts.family if facts else None,
            props.name,
            host,
            torch_version,
            None if hip else cuda,
            hip,
            bf16,
            blocksize,
            triton=triton_version,
            cpu_capability=cpu_capability,
            device_memory=int(memory) if memory else None,
            driver=gpu_driver_version("rocm" if hip else "cuda"),
            device_count=torch.cuda.device_count(),
            topology=gpu_topology(torch),
        )
    return Probe(
        "cpu",
        platform.machine() or "cpu",
        None,
        platform.processor() or platform.machine(),
        host,
        torch_version,
        cuda,
        hip,
        True,
        archs.CPU_DEFAULT_BLOCKSIZE,
        triton=triton_version,
        cpu_capability=cpu_capability,
    )


def gpu_topology(torch_module: Any) -> tuple[str, ...]:
    """Each GPU (index, name, memory) and each pair's link: whether one can access the
    other's memory directly (peer access), and the link ``nvidia-smi topo -m`` names, where
    the tool is present."""
    cuda = torch_module.cuda
    count = cuda.device_count()
    lines = []
    for index in range(count):
        props = cuda.get_device_properties(index)
        lines.append(f"cuda:{index} {props.name} {props.total_memory / 2**30:.0f} GiB")
    links = _nvidia_smi_links(count)
    for i in range(count):
        for j in range(i + 1, count):
            peer = "peer access" if cuda.can_device_access_peer(i, j) else "no peer access"
            link = f", {links[(i, j)]}" if (i, j) in links else ""
            lines.append(f"cuda:{i}-cuda:{j} {peer}{link}")
    return tuple(lines)


def _nvidia_smi_links(count: int) -> dict[tuple[int, int], str]:
    """``{(i, j): "NV18"}`` from ``nvidia-smi topo -m``'s matrix; empty without the tool."""
    import subprocess

    if count < 2:
        return {}
    try:
        text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    links = {}
    for line in text.splitlines():
        cells = re.sub(r"\x1b\[[0-9;]*m", "", line).split()
        if len(cells) > count and re.fullmatch(r"GPU\d+", cells[0]):
            i = int(cells[0][3:])
            for j in range(i + 1, min(count, len(cells) - 1)):
                links[(i, j)] = cells[1 + j]
    return links


DRIVER_FILES = {"cuda": "/proc/driver/nvidia/version", "rocm": "/sys/module/amdgpu/version"}


def gpu_driver_version(kind: str, files: dict[str, str] = DRIVER_FILES) -> str | None:
    """The kernel driver's version from the file the driver publishes; None where absent
    (a container without it, an amdgpu built into the kernel)."""
    try:
        with open(files[kind], encoding="utf-8", errors="replace") as handle:
            text = handle.read()
    except (OSError, KeyError):
        return None
    if kind == "cuda":  # "NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  Tue Mar ..."
        match = re.search(r"Kernel Module(?: for [\w-]+)?\s+([0-9][0-9.]*)", text)
        return match.group(1) if match else None
    return text.strip() or None


def _cpu_capability(torch_module: Any) -> str | None:
    try:
        return str(torch_module.backends.cpu.get_cpu_capability())
    except Exception:  # noqa: BLE001 - older torch or an odd build: unknown
        return None


def simulated_probe(
    arch: str, *, host: str = "simulated", torch_version: str | None = None, triton_version: str | None = None
) -> Probe:
    """A probe that looks like ``arch`` to every gating decision but has no device.

    A testing aid: ``--qconform-simulate=gfx1200`` lets the gating (markers, defaults,
    skip reasons) be tested without the hardware. Every test that would compute on the
    simulated device is skipped, so no result can claim to come from it.
    """
    facts = archs.facts_for(arch)
    if facts is None:
        known = ", ".join(sorted(archs.KNOWN_ARCHS))
        raise ValueError(f"cannot simulate unknown arch {arch!r}; known archs: {known}")
    return Probe(
        facts.kind,
        facts.name,
        facts.family,
        f"simulated {facts.name} (no device)",
        host,
        torch_version,
        "simulated" if facts.kind == "cuda" else None,
        "simulated" if facts.kind == "rocm" else None,
        facts.bf16,
        facts.default_blocksize,
        simulated=True,
        triton=triton_version,
    )
