"""Registers, spills, shared memory and occupancy of one compiled Triton kernel, read from
what the compiler produced (no GPU needed).

AMD: the AMDGCN assembly carries the kernel's metadata (``.vgpr_count``, ``.sgpr_count``,
``.agpr_count``, ``.vgpr_spill_count``, ``.sgpr_spill_count``) and LLVM's own occupancy
estimate (``; Occupancy: N``: waves per SIMD, from registers and LDS for the kernel's
workgroup size). NVIDIA: ``cuobjdump --dump-resource-usage`` (shipped with Triton) on the
cubin gives registers and local memory per thread (spills land there: our kernels keep no
arrays in local memory), and occupancy is computed from the registers with the CUDA
occupancy rules below; shared memory is reported but not applied as a limit (our kernels
use at most a few KiB against 64-228 KiB per SM).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# NVIDIA per-SM limits by compute capability: (max resident warps, max resident blocks).
# Warps: CUDA C++ Programming Guide, "Technical Specifications per Compute Capability".
# Blocks: cuda_occupancy.h (CUDA 13.0, in triton/backends/nvidia/include),
# cudaOccMaxBlocksPerMultiprocessor. Every listed arch has 64 K 32-bit registers per SM,
# allocated per warp in units of 256 (cudaOccRegAllocationGranularity).
NVIDIA_SM_LIMITS: dict[int, tuple[int, int]] = {
    70: (64, 32),
    75: (32, 16),
    80: (64, 32),
    86: (48, 16),
    89: (48, 24),
    90: (64, 32),
    100: (64, 32),
    120: (48, 24),
}
NVIDIA_REGISTERS_PER_SM = 65536
NVIDIA_REGISTER_UNIT = 256


@dataclass(frozen=True)
class Resources:
    """What one compiled variant asks of the hardware.

    ``registers``: per thread (AMD: VGPRs, plus AGPRs where the arch has them; ``sgprs``
    separately). ``spills``: AMD: registers spilled (VGPR + SGPR); NVIDIA: bytes of local
    memory per thread. ``shared``: bytes per program (LDS / shared memory). ``occupancy``:
    AMD: waves per SIMD (LLVM); NVIDIA: resident warps per SM of ``occupancy_max``.
    """

    registers: int
    spills: int
    shared: int
    occupancy: int
    occupancy_max: int | None = None
    sgprs: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Resources:
        fields: dict[str, Any] = {
            k: data.get(k) for k in ("registers", "spills", "shared", "occupancy", "occupancy_max", "sgprs")
        }
        return cls(**fields)


def _amdgcn_number(asm: str, pattern: str, default: int | None = None) -> int:
    match = re.search(pattern, asm, re.MULTILINE)
    if match is None:
        if default is not None:
            return default
        raise ValueError(f"AMDGCN assembly has no {pattern!r}: Triton's output format changed")
    return int(match.group(1))


def amd_resources(amdgcn: str, shared: int) -> Resources:
    """Resources of an AMD kernel from its AMDGCN assembly and Triton's ``shared`` bytes."""
    vgprs = _amdgcn_number(amdgcn, r"^\s*\.vgpr_count:\s+(\d+)")
    agprs = _amdgcn_number(amdgcn, r"^\s*\.agpr_count:\s+(\d+)", default=0)
    spills = _amdgcn_number(amdgcn, r"^\s*\.vgpr_spill_count:\s+(\d+)") + _amdgcn_number(
        amdgcn, r"^\s*\.sgpr_spill_count:\s+(\d+)"
    )
    return Resources(
        registers=vgprs + agprs,
        spills=spills,
        shared=shared,
        occupancy=_amdgcn_number(amdgcn, r";\s*Occupancy:\s+(\d+)"),
        sgprs=_amdgcn_number(amdgcn, r"^\s*\.sgpr_count:\s+(\d+)"),
    )


def cuobjdump_usage(cubin: bytes, cuobjdump: str) -> dict[str, int]:
    """``REG``, ``LOCAL``, ``SHARED``, ... of the one function in ``cubin``."""
    with tempfile.TemporaryDirectory(prefix="qconform-cubin-") as folder:
        path = Path(folder) / "kernel.cubin"
        path.write_bytes(cubin)
        out = subprocess.run(
            [cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True, check=True
        ).stdout
    match = re.search(r"Function [^:]+:\s*\n\s*(.+)", out)
    if match is None:
        raise ValueError(f"cuobjdump printed no function resource line: {out.strip()[:200]}")
    return {key: int(value) for key, value in re.findall(r"(\w+)(?:\[\d+\])?:(\d+)", match.group(1))}


def nvidia_occupancy(capability: int, registers: int, num_warps: int) -> tuple[int, int]:
    """(resident warps per SM, the SM's maximum) for a kernel of ``registers`` per thread
    in programs of ``num_warps`` warps, by the register file and the warp and block caps."""
    max_warps, max_blocks = NVIDIA_SM_LIMITS[capability]
    per_warp = -(-max(registers, 1) * 32 // NVIDIA_REGISTER_UNIT) * NVIDIA_REGISTER_UNIT
    blocks = min(NVIDIA_REGISTERS_PER_SM // (per_warp * num_warps), max_blocks, max_warps // num_warps)
    return blocks * num_warps, max_warps


def nvidia_resources(cubin: bytes, shared: int, capability: int, num_warps: int, cuobjdump: str) -> Resources:
    """Resources of an NVIDIA kernel from its cubin; ``shared``: Triton's dynamic shared bytes."""
    usage = cuobjdump_usage(cubin, cuobjdump)
    warps, max_warps = nvidia_occupancy(capability, usage["REG"], num_warps)
    return Resources(
        registers=usage["REG"],
        spills=usage.get("LOCAL", 0),
        shared=shared + usage.get("SHARED", 0),
        occupancy=warps,
        occupancy_max=max_warps,
    )
