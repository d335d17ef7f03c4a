"""Facts per GPU architecture that the suites rely on, each with its source.

One table, so that a fact (bf16 support, the platform's default 4-bit blocksize) is
stated once and every suite, marker and skip reason reads it from here.
"""

from __future__ import annotations

from dataclasses import dataclass

# Sources, cited by key in ArchFacts.source.
SOURCES: dict[str, str] = {
    "dlm-rocm": "DocumentLanguageModel ROCm page, 'Supported GPUs' table (shared/seeds/002): bf16 per gfx arch",
    "unsloth-amd": "unsloth AMD heuristic (shared/seeds/000): 4-bit blocksize 64 on CUDA, 128 on ROCm; "
    "earlier bitsandbytes releases, whose Params4bit source unsloth inspects for `blocksize = 64 if not "
    "HIP_ENVIRONMENT else 128`; bitsandbytes 0.50.2 defaults to 64 on every platform "
    "(bitsandbytes/nn/modules.py, Params4bit.__new__), so checkpoints of both kinds exist",
    "nvidia-bf16": "NVIDIA: bf16 arithmetic from compute capability 8.0 (Ampere) on",
    "rdna4-hqq": "QLoRA on RDNA4 via HQQ (shared/seeds/004): no bitsandbytes binary for gfx1200/gfx1201",
    "cpu": "bitsandbytes CPU backend and torch CPU: blocksize 64 default, bf16 supported by torch on CPU",
    "triton-amd": "Triton 3.9's HIP backend (triton/backends/amd/compiler.py, HIPOptions): wave size 32 on gfx10 "
    "and later (RDNA), 64 before (GCN, CDNA); a ROCm device reports the same as its warpSize property",
}

CUDA_DEFAULT_BLOCKSIZE = 64
ROCM_DEFAULT_BLOCKSIZE = 128
CPU_DEFAULT_BLOCKSIZE = 64


@dataclass(frozen=True)
class ArchFacts:
    """What the suites need to know about one architecture."""

    name: str  # marker name: "gfx1200", "sm90"
    kind: str  # "cuda" | "rocm"
    family: str  # marker name: "rdna4", "hopper"
    bf16: bool
    default_blocksize: int
    source: tuple[str, ...]
    note: str = ""
    # Threads that execute in lockstep (a warp / wavefront): what Triton compiles a kernel
    # for (``GPUTarget(..., warp_size)``) and what a kernel's cross-lane code must assume.
    wave_size: int = 32


def _rocm(name: str, family: str, bf16: bool, note: str = "") -> ArchFacts:
    major = int(name.removeprefix("gfx")[:-2])  # gfx90a -> 9, gfx1200 -> 12 (the last two are minor, stepping)
    wave_size = 32 if major >= 10 else 64  # RDNA (gfx10 on) runs wave32 under Triton and HIP; GCN, CDNA wave64
    return ArchFacts(
        name, "rocm", family, bf16, ROCM_DEFAULT_BLOCKSIZE, ("dlm-rocm", "unsloth-amd", "triton-amd"), note, wave_size
    )


def _cuda(name: str, family: str, bf16: bool) -> ArchFacts:
    return ArchFacts(name, "cuda", family, bf16, CUDA_DEFAULT_BLOCKSIZE, ("nvidia-bf16", "unsloth-amd"))


KNOWN_ARCHS: dict[str, ArchFacts] = {
    facts.name: facts
    for facts in (
        _rocm("gfx906", "vega20", False),
        _rocm("gfx908", "cdna1", False),
        _rocm("gfx90a", "cdna2", True),
        _rocm("gfx942", "cdna3", True),
        _rocm("gfx1030", "rdna2", False),
        _rocm("gfx1031", "rdna2", False),
        _rocm("gfx1100", "rdna3", True),
        _rocm("gfx1101", "rdna3", True),
        _rocm("gfx1102", "rdna3", True),
        _rocm("gfx1200", "rdna4", True, "no bitsandbytes binary (rdna4-hqq)"),
        _rocm("gfx1201", "rdna4", True, "no bitsandbytes binary (rdna4-hqq)"),
        _cuda("sm70", "volta", False),
        _cuda("sm75", "turing", False),
        _cuda("sm80", "ampere", True),
        _cuda("sm86", "ampere", True),
        _cuda("sm89", "ada", True),
        _cuda("sm90", "hopper", True),
        _cuda("sm100", "blackwell", True),
        _cuda("sm120", "blackwell", True),
    )
}

DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm")
FAMILIES: tuple[str, ...] = tuple(sorted({f.family for f in KNOWN_ARCHS.values()}))


def facts_for(arch: str) -> ArchFacts | None:
    """The facts of a known arch, or None for an arch this table does not know."""
    return KNOWN_ARCHS.get(arch)


def normalize_gcn_arch(gcn_arch_name: str) -> str:
    """``gfx90a:sramecc+:xnack-`` -> ``gfx90a``: ROCm appends target features after colons."""
    return gcn_arch_name.split(":", 1)[0].strip().lower()


def cuda_arch(major: int, minor: int) -> str:
    """Compute capability (9, 0) -> ``sm90``."""
    return f"sm{major}{minor}"


def cuda_capability(arch: str) -> tuple[int, int]:
    """``sm90`` -> (9, 0), ``sm120`` -> (12, 0): the inverse of ``cuda_arch``."""
    digits = arch.removeprefix("sm")
    return int(digits[:-1]), int(digits[-1])
