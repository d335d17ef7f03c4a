"""The hardware targets a run parametrizes its tests over, and their markers.

A target is present (tests run on it) or absent (tests are generated, marked and
skipped with the reason). Absent targets exist so that ``pytest --qconform -m gfx1200``
on a machine without that GPU reports every selected test as skipped with a reason,
instead of a silent "no tests ran".
"""

from __future__ import annotations

import dataclasses
import os
import platform
import re
from dataclasses import dataclass

from pytest_qconform.hardware import archs
from pytest_qconform.hardware.probe import Probe
from pytest_qconform.vocabulary import OTHER_DEVICE_PREFIX

CPU_MACHINES: tuple[str, ...] = ("x86_64", "aarch64", "arm64", "ppc64le", "s390x")


def hardware_marker_names() -> dict[str, str]:
    """Every hardware marker with its ``pytest --markers`` description."""
    names = {
        "cpu": "runs on the CPU (bitsandbytes CPU backend, HQQ PyTorch, Triton interpreter)",
        "cuda": "needs an NVIDIA GPU through CUDA",
        "rocm": "needs an AMD GPU through ROCm/HIP",
    }
    for facts in archs.KNOWN_ARCHS.values():
        names[facts.name] = f"needs a {facts.kind} device of arch {facts.name} ({facts.family})"
    for family in archs.FAMILIES:
        members = ", ".join(sorted(f.name for f in archs.KNOWN_ARCHS.values() if f.family == family))
        names[family] = f"needs a GPU of the {family} family ({members})"
    for machine in CPU_MACHINES:
        names[machine] = f"runs on a CPU of machine type {machine}"
    return names


@dataclass(frozen=True)
class Target:
    """One device the suites are instantiated for."""

    kind: str  # "cpu" | "cuda" | "rocm"
    arch: str | None  # None: any arch of this kind/family was asked for
    family: str | None
    torch_device: str | None  # "cpu", "cuda:0"; None when absent or simulated
    bf16: bool
    default_blocksize: int
    skip_reason: str | None = None  # set when nothing can run on this target
    other_device: bool = False  # another device than the run's: its instances make no cell

    @property
    def id(self) -> str:
        return "-".join(p for p in (self.kind, self.arch or self.family) if p and p != self.kind) or self.kind

    @property
    def marker_names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.kind, self.arch, self.family) if n)


def cpu_target() -> Target:
    machine = platform.machine() or "cpu"
    return Target("cpu", machine if machine != "cpu" else None, None, "cpu", True, archs.CPU_DEFAULT_BLOCKSIZE)


def device_target(probe: Probe) -> Target | None:
    """The probe's GPU as a target; a simulated one is present for gating but skipped."""
    if probe.device_kind == "cpu":
        return None
    reason = None
    if probe.simulated:
        reason = (
            f"simulated {probe.arch}: the probe is simulated (--qconform-simulate), "
            f"no {probe.arch} device exists in this run, so nothing was computed on it"
        )
    device = None if probe.simulated else f"cuda:{_use_worker_device()}"
    return Target(probe.device_kind, probe.arch, probe.family, device, probe.bf16, probe.default_blocksize, reason)


def worker_device_index(worker: str | None, device_count: int) -> int:
    """The GPU an xdist worker computes on: ``gwN`` uses ``N % device_count``; 0 outside xdist.

    Spreads ``pytest --qconform -n K`` over a host's GPUs, one worker per GPU in turn.
    The probe describes GPU 0, so this assumes the host's GPUs are alike; on a mixed host,
    run one job per arch with ``CUDA_VISIBLE_DEVICES`` (or ``HIP_VISIBLE_DEVICES``) set.
    """
    if device_count < 1:
        raise ValueError(f"worker_device_index: device_count must be >= 1, got {device_count}")
    if not worker:
        return 0
    match = re.fullmatch(r"gw(\d+)", worker)
    if match is None:
        raise ValueError(
            f"PYTEST_XDIST_WORKER={worker!r} is not a pytest-xdist worker id like 'gw3'; unset it outside pytest-xdist"
        )
    return int(match.group(1)) % device_count


def _use_worker_device() -> int:
    """Pick this process's GPU and make it the current device.

    Making it current matters: Triton kernels (and other libraries) launch on the current
    device, and a launch on GPU 0 with tensors on GPU 1 is an illegal memory access that
    spoils the worker's CUDA context for every test after it.
    """
    import torch

    index = worker_device_index(os.environ.get("PYTEST_XDIST_WORKER"), max(torch.cuda.device_count(), 1))
    if torch.cuda.is_available():
        torch.cuda.set_device(index)
    return index


def requested_hardware(markexpr: str) -> list[str]:
    """Hardware marker names that appear in a ``-m`` expression, in order."""
    known = hardware_marker_names()
    seen: list[str] = []
    for token in re.findall(r"[A-Za-z_][A-Za-z0-9_]*", markexpr or ""):
        if token in known and token not in seen:
            seen.append(token)
    return seen


def absent_target(name: str, probe: Probe) -> Target:
    """A target for hardware the ``-m`` expression asks for but this run lacks."""
    found = probe.summary()
    facts = archs.facts_for(name)
    if facts is not None:
        return Target(
            facts.kind,
            facts.name,
            facts.family,
            None,
            facts.bf16,
            facts.default_blocksize,
            f"needs a {facts.kind} device of arch {facts.name}; this run found {found}",
        )
    if name in archs.FAMILIES:
        member = next(f for f in archs.KNOWN_ARCHS.values() if f.family == name)
        return Target(
            member.kind,
            None,
            name,
            None,
            member.bf16,
            member.default_blocksize,
            f"needs a GPU of the {name} family; this run found {found}",
        )
    if name in ("cuda", "rocm"):
        blocksize = archs.ROCM_DEFAULT_BLOCKSIZE if name == "rocm" else archs.CUDA_DEFAULT_BLOCKSIZE
        return Target(name, None, None, None, True, blocksize, f"needs a {name} device; this run found {found}")
    return Target(
        "cpu",
        name,
        None,
        None,
        True,
        archs.CPU_DEFAULT_BLOCKSIZE,
        f"needs a CPU of machine type {name}; this run found {platform.machine()}",
    )


def build_targets(probe: Probe, markexpr: str = "") -> tuple[Target, ...]:
    """The probe's device first, then one absent target per hardware name ``-m`` asks for.

    A run computes on one device, the probe's: its report is one column of the matrix,
    labelled with the probe's arch, so CPU results from a GPU host (or from a simulated
    GPU probe) must not land in it. On a GPU host the CPU instances are therefore
    generated but skipped with the reason; a CPU runner (or the same host with the GPU
    hidden, ``CUDA_VISIBLE_DEVICES=``) produces the CPU column.
    """
    gpu = device_target(probe)
    cpu = cpu_target()
    if gpu is None:
        targets = [cpu]
    else:
        why = f"simulated {probe.arch} run" if probe.simulated else f"run on {probe.device_kind} {probe.arch}"
        cpu = dataclasses.replace(
            cpu,
            torch_device=None,
            other_device=True,
            skip_reason=(
                f"{OTHER_DEVICE_PREFIX} this is a {why}: a run reports on one device, so its CPU instances run "
                "on a CPU runner (or here with the GPU hidden: CUDA_VISIBLE_DEVICES= / HIP_VISIBLE_DEVICES=)"
            ),
        )
        targets = [gpu, cpu]
    for name in requested_hardware(markexpr):
        if not any(name in t.marker_names for t in targets):
            targets.append(absent_target(name, probe))
    return tuple(targets)
