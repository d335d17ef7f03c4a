"""Compile every Triton kernel we ship for every GPU arch the project lists, on any machine.

Why: the first users of this suite run it on self-hosted AMD runners, and no AMD GPU is
lent to the project, so the kernels' ROCm code path (code-table loads instead of the PTX
shuffle, wave64 on CDNA against wave32 on RDNA) would otherwise first be compiled there.
Triton compiles for any target without the device (``GPUTarget("hip", "gfx1200", 32)``
gives AMDGCN and a code object on a CPU machine), so CI does it on its CPU.

What is compiled: the variants a default run launches. The entry-point calls of a default
run (the kernel-call log, ``default_run_kernel_calls.json``, see ``kernel_calls``) plus
``extra_calls()`` (public paths a default run does not take) are replayed on the meta
device, as a process on a ROCm or a CUDA GPU would make them (``_platform``): the entry
points choose kernels, tiles and flags with their own code, and each launch is captured
instead of run. Each captured launch is then compiled for the target by Triton itself,
``JITFunction.warmup`` under a stand-in driver that names the target, so signature,
specialization and options are what a launch on that device would get, down to the code
object (AMD: hsaco, NVIDIA: cubin through ptxas). Kernels are found, not listed: every
kernel launched in ``triton-nf4/qconform_triton_nf4/kernels`` must be reached by a replayed call, or the
check fails saying which (a new kernel is covered once the log is recorded again).
The AMD machine code of each compiled variant is also scanned for instructions that round
bf16 toward zero (``bf16_rounding``); a hit is written into the results and the matrix
as that arch's expected bf16 rounding failure, not as a compile failure.

CLI (``nox -s compile-check`` runs it and writes the committed results, the matrix's section
of them and docs/kernels-compiled.md)::

    python -m qconform_triton_nf4.compile.check [--arch ARCH ...] [--jobs N] [--json FILE] [--doc FILE]

Exit status 1 if a kernel does not compile for a listed arch (each failure printed with
the arch, the kernel, its specialization and the compiler's message), 2 on bad input.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import hashlib
import json
import os
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from pytest_qconform.hardware import archs
from pytest_qconform.report.sections import write_section
from qconform_triton_nf4 import kernel_calls
from qconform_triton_nf4.compile.bf16_rounding import truncating_instructions
from qconform_triton_nf4.compile.report import ArchResult, CompileCheck, Variant, section, write_doc, write_results
from qconform_triton_nf4.compile.resources import amd_resources, nvidia_resources
from qconform_triton_nf4.unsupported_targets import rejection

KERNELS_DIR = Path(__file__).parent.parent / "kernels"
# What ``torch.version.hip`` holds in the replay of a ROCm process (any version string: the
# entry points only ask whether it is set).
ROCM_HIP_VERSION = "6.4.0-simulated"
# The entry points size some tiles by the device's multiprocessor count: replaying with the
# fewest and with more than any GPU has reaches the choices of every device.
MULTIPROCESSOR_COUNTS = (1, 1 << 16)
MESSAGE_LINES = 12


@dataclass(frozen=True)
class Launch:
    """One captured kernel launch: what ``kernel[grid](*args, **kwargs)`` was given."""

    kernel: Any  # triton.runtime.JITFunction
    grid: Any
    args: tuple
    kwargs: dict

    @property
    def kernel_name(self) -> str:
        return f"{self.kernel.module.rsplit('.', 1)[-1]}.{self.kernel.__name__}"


def gpu_targets(names: Sequence[str] | None = None) -> list[archs.ArchFacts]:
    """The listed GPU archs (all of ``archs.KNOWN_ARCHS`` by default); ValueError naming an unknown one."""
    if not names:
        return list(archs.KNOWN_ARCHS.values())
    unknown = [n for n in names if n not in archs.KNOWN_ARCHS]
    if unknown:
        raise ValueError(f"unknown arch {', '.join(map(repr, unknown))}; known archs: {', '.join(archs.KNOWN_ARCHS)}")
    return [archs.KNOWN_ARCHS[n] for n in names]


def triton_target(facts: archs.ArchFacts) -> Any:
    """``GPUTarget`` of an arch: ("hip", "gfx1200", 32) or ("cuda", 90, 32)."""
    from triton.backends.compiler import GPUTarget

    if facts.kind == "rocm":
        return GPUTarget("hip", facts.name, facts.wave_size)
    return GPUTarget("cuda", int(facts.name.removeprefix("sm")), facts.wave_size)


def launch_sites() -> set[str]:
    """``module.kernel`` for every ``kernel[grid](...)`` and every ``BoundLaunch(kernel, ...)``
    (a launch bound once, ``kernels/launch.py``) in the kernels package's source: the
    kernels we ship, whatever they are called and however they are launched."""
    sites = set()
    for path in sorted(KERNELS_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.Call):
                continue
            if isinstance(node.func, ast.Subscript) and isinstance(node.func.value, ast.Name):
                sites.add(f"{path.stem}.{node.func.value.id}")
            elif (
                isinstance(node.func, ast.Name)
                and node.func.id == "BoundLaunch"
                and node.args
                and isinstance(node.args[0], ast.Name)
            ):
                sites.add(f"{path.stem}.{node.args[0].id}")
    return sites


def extra_calls() -> list[dict]:
    """Entry-point calls beyond a default run's log: ``quantize_calls()``, ``tc_gemm_calls()``,
    and ``gemv_4bit`` with ``MAX_ROWS`` rows, one call per x dtype, on a weight deep enough
    (8 chunks of 64 columns) that the tensor-core kernel splits K, so its split-sum variant
    is compiled too (a default run's weights are at most 256 deep there)."""
    import torch

    from qconform_triton_nf4.kernels import MAX_ROWS

    meta = torch.device("meta")
    rows, features, depth, blocksize = MAX_ROWS, 64, 512, 64
    weight = (
        torch.empty(features * depth // 2, dtype=torch.uint8, device=meta),
        torch.empty(features * depth // blocksize, dtype=torch.float32, device=meta),
    )
    code = torch.empty(16, dtype=torch.float32, device=meta)
    calls = [
        kernel_calls.record(
            "gemv_4bit",
            (torch.empty(rows, depth, dtype=dtype, device=meta), *weight),
            {"blocksize": blocksize, "shape": (features, depth), "code": code},
        )
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
    ]
    return calls + tc_gemm_calls() + ws_gemm_calls() + quantize_calls()


def tc_gemm_calls() -> list[dict]:
    """``tc_gemm_4bit`` calls beyond the log's (the GPU run's route, ``nf4_tc_gemm.TC_MAX_ROWS``:
    33-64 rows on sm_90, and fewer rows in layouts the fused kernels do not read; its weights
    are at most 1024 deep). 64 rows of each x dtype (the table's configuration for them) on a
    weight deep enough (64 steps of K) that the plan splits K, and on one of a single step,
    which it cannot split: both the split-sum variant and the one that rounds in place are
    compiled."""
    import torch

    meta = torch.device("meta")
    rows, features, blocksize = 64, 64, 64
    code = torch.empty(16, dtype=torch.float32, device=meta)
    return [
        kernel_calls.record(
            "tc_gemm_4bit",
            (
                torch.empty(rows, depth, dtype=dtype, device=meta),
                torch.empty(features * depth // 2, dtype=torch.uint8, device=meta),
                torch.empty(features * depth // blocksize, dtype=torch.float32, device=meta),
            ),
            {"blocksize": blocksize, "shape": (features, depth), "code": code},
        )
        for dtype in (torch.bfloat16, torch.float16)
        for depth in (4096, 64)
    ]


def ws_gemm_calls() -> list[dict]:
    """``ws_gemm_4bit`` calls (sm_90 only: the replay skips them elsewhere): each row class
    of its table (24, 64, 128 and 256 rows) in bf16 on a weight deep enough that the plan splits
    K, and in fp16 on one it cannot split; double quantization with a bias, and blocksize 32
    (K steps of 32)."""
    import torch

    from qconform_triton_nf4.double_quant import NESTED_BLOCKSIZE

    meta = torch.device("meta")
    features = 64
    code = torch.empty(16, dtype=torch.float32, device=meta)

    def call(rows: int, depth: int, dtype: torch.dtype, blocksize: int = 64, nested: bool = False) -> dict:
        blocks = features * depth // blocksize
        kwargs: dict = {"blocksize": blocksize, "shape": (features, depth), "code": code}
        if nested:
            kwargs |= {
                "nested_absmax": torch.empty(-(-blocks // NESTED_BLOCKSIZE), dtype=torch.float32, device=meta),
                "nested_code": torch.empty(256, dtype=torch.float32, device=meta),
                "offset": 0.0,
                "bias": torch.empty(features, dtype=dtype, device=meta),
            }
        return kernel_calls.record(
            "ws_gemm_4bit",
            (
                torch.empty(rows, depth, dtype=dtype, device=meta),
                torch.empty(features * depth // 2, dtype=torch.uint8, device=meta),
                torch.empty(blocks, dtype=torch.uint8 if nested else torch.float32, device=meta),
            ),
            kwargs,
        )

    return [call(rows, 4096, torch.bfloat16) for rows in (24, 64, 128, 256)] + [
        call(64, 64, torch.float16),
        call(64, 4096, torch.bfloat16, nested=True),
        call(64, 4096, torch.bfloat16, blocksize=32),
    ]


def quantize_calls() -> list[dict]:
    """``quantize_4bit`` calls: a default run quantizes through the kernel, but the log
    records the entry points that read the packed format. Each weight dtype and format
    (NF4 has one zero code, FP4 a signed zero), the smallest and largest blocksize, and a
    weight whose last program is partial."""
    import torch

    from qconform_triton_nf4.double_quant import code_table
    from qconform_triton_nf4.kernels import SUPPORTED_BLOCKSIZES
    from qconform_triton_nf4.kernels.nf4_quantize import code_boundaries

    meta = torch.device("meta")
    cases = [
        (fmt, dtype, 64, (3, 4096))
        for fmt in ("nf4", "fp4")
        for dtype in (torch.bfloat16, torch.float16, torch.float32)
    ]
    cases += [("nf4", torch.bfloat16, max(SUPPORTED_BLOCKSIZES), (3, 4096)), ("nf4", torch.bfloat16, 64, (3, 4000))]
    return [
        kernel_calls.record(
            "quantize_4bit",
            (torch.empty(shape, dtype=dtype, device=meta),),
            {"blocksize": blocksize, "boundaries": code_boundaries(code_table(fmt, "cpu"))},
        )
        for fmt, dtype, blocksize, shape in cases
    ]


@contextlib.contextmanager
def _platform(kind: str, multiprocessors: int, mma_ptx: bool, ws: bool = False) -> Iterator[None]:
    """Make the entry points decide as in a process on a ``kind`` ("rocm"/"cuda") GPU with
    ``multiprocessors`` multiprocessors: a ROCm build of torch sets ``torch.version.hip``;
    ``ptx_shuffle_ok`` is asked about a CUDA-type device (meta tensors are not one), so
    its own rule decides; the device size, whether the tensor-core kernel's PTX runs
    (``mma_ptx``: NVIDIA from sm_80) and whether the warp-specialized GEMM does (``ws``:
    sm_90), come from here instead of the absent device."""
    import torch

    from qconform_triton_nf4.kernels import nf4_gemv, nf4_mma, nf4_ws_gemm

    for module, name in (
        (nf4_gemv, "ptx_shuffle_ok"),
        (nf4_gemv, "_multiprocessors"),
        (nf4_mma, "mma_ptx_ok"),
        (nf4_ws_gemm, "runs_on"),
    ):
        if not hasattr(module, name):
            raise RuntimeError(
                f"compile_check: {module.__name__} has no {name}() any more; update _platform, "
                "which answers the entry points' device questions for the replay"
            )
    saved = (
        torch.version.hip,
        nf4_gemv.ptx_shuffle_ok,
        nf4_gemv._multiprocessors,
        nf4_mma.mma_ptx_ok,
        nf4_ws_gemm.runs_on,
    )
    shuffle_ok = nf4_gemv.ptx_shuffle_ok
    torch.version.hip = ROCM_HIP_VERSION if kind == "rocm" else None
    nf4_gemv.ptx_shuffle_ok = lambda device: shuffle_ok(torch.device("cuda"))
    nf4_gemv._multiprocessors = lambda device: multiprocessors
    nf4_mma.mma_ptx_ok = lambda device: mma_ptx
    nf4_ws_gemm.runs_on = lambda device: ws
    try:
        yield
    finally:
        (
            torch.version.hip,
            nf4_gemv.ptx_shuffle_ok,
            nf4_gemv._multiprocessors,
            nf4_mma.mma_ptx_ok,
            nf4_ws_gemm.runs_on,
        ) = saved


@contextlib.contextmanager
def _captured(launches: list[Launch]) -> Iterator[None]:
    """Record kernel launches instead of running them."""
    from triton.runtime.jit import JITFunction

    original = JITFunction.run

    def capture(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> None:
        launches.append(Launch(self, grid, args, kwargs))

    JITFunction.run = capture
    try:
        yield
    finally:
        JITFunction.run = original


def capture_launches(
    calls: list[dict], kind: str, mma_ptx: bool = False, ws: bool = False
) -> tuple[list[Launch], list[str]]:
    """The launches ``calls`` make in a ``kind`` process (``mma_ptx``: on a GPU where the
    tensor-core kernel runs its PTX; ``ws``: where the warp-specialized GEMM runs, whose
    calls are replayed there only: ``kernel_calls.runs_here``), and one message per call that failed."""
    import torch

    from qconform_triton_nf4 import kernels

    if kernels.interpreter_active():
        raise RuntimeError(
            "compile_check: the kernels were imported with TRITON_INTERPRET=1, so they are not "
            "compiled; run the check in a process without it (python -m qconform_triton_nf4.compile.check)"
        )
    meta = torch.device("meta")
    launches: list[Launch] = []
    errors: list[str] = []
    for multiprocessors in MULTIPROCESSOR_COUNTS:
        with _platform(kind, multiprocessors, mma_ptx, ws), _captured(launches):
            for index, call in enumerate(calls):
                if not kernel_calls.runs_here(call, meta):  # under _platform: the arch compiled for
                    continue
                try:
                    args = [kernel_calls.decode(a, meta) for a in call["args"]]
                    kwargs = {k: kernel_calls.decode(v, meta) for k, v in call["kwargs"].items()}
                    getattr(kernels, call["fn"])(*args, **kwargs)
                except Exception as exc:  # noqa: BLE001 - every call is tried; each failure is reported
                    message = f"call {index} ({call['fn']}) cannot be replayed: {type(exc).__name__}: {exc}"
                    if message not in errors:
                        errors.append(message)
    return launches, errors


class _TargetDriver:
    """Answers what ``JITFunction.run`` asks the active driver, for a target that is not here."""

    def __init__(self, target: Any) -> None:
        self.target = target

    def get_current_device(self) -> str:
        return f"{self.target.backend}:{self.target.arch}"  # keys Triton's per-device kernel cache

    def get_current_stream(self, device: Any = None) -> int:
        return 0

    def get_current_target(self) -> Any:
        return self.target


@contextlib.contextmanager
def _driver_for(target: Any) -> Iterator[None]:
    from triton.runtime.driver import driver

    previous = driver._active  # None until something asked for the machine's own driver
    driver.set_active(_TargetDriver(target))
    try:
        yield
    finally:
        driver._active = previous


def _specialization(launch: Launch) -> dict[str, str]:
    """What tells the launch's variants apart to a reader: its constexprs and the element
    types of its tensor arguments (``x_ptr: *bfloat16``), as the kernel's source names them."""
    import torch

    names = [p.name for p in launch.kernel.params]
    bound = dict(zip(names, launch.args)) | launch.kwargs
    out = {}
    for param in launch.kernel.params:
        value = bound.get(param.name, param.default)
        if param.is_constexpr:
            out[param.name] = repr(value)
        elif isinstance(value, torch.Tensor):
            out[param.name] = "*" + str(value.dtype).removeprefix("torch.")
    return out


@contextlib.contextmanager
def _stderr_into(sink: list[str]) -> Iterator[None]:
    """Collect what is written to file descriptor 2 meanwhile: MLIR and LLVM report
    compile errors there (and dump the module after them), not in the exception."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as captured:
        os.dup2(captured.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            captured.seek(0)
            sink.append(captured.read().decode("utf-8", "replace"))


def _compiler_message(exc: BaseException, stderr: str) -> str:
    """The exception's last lines, after the compiler's own ``error:`` lines from stderr,
    with this checkout's path left out of source locations (the committed results must not
    depend on where the project was cloned)."""
    checkout = str(Path(__file__).parents[3]) + os.sep
    stderr = stderr.replace(checkout, "")
    exc_text = f"{type(exc).__name__}: {exc}".replace(checkout, "")
    printed = stderr.splitlines()
    diagnostics = []  # each `error:` line and the line it quotes (an assembler names the instruction there)
    for index in [i for i, line in enumerate(printed) if "error:" in line][:2]:
        diagnostics += [line.strip() for line in printed[index : index + 2] if line.strip()]
    raised = [line for line in exc_text.splitlines() if line.strip()]
    return "\n".join(diagnostics + raised[-MESSAGE_LINES:])


def _silent_failure(compiled: Any, facts: archs.ArchFacts, stderr: str) -> str | None:
    """Why a kernel Triton returned without raising did not really compile, or None.

    LLVM can report errors and still emit a code object: AMDGPU answers an NVIDIA inline
    asm constraint (``=f``) with ``error: unknown asm constraint`` on stderr and drops the
    asm, and the code around it. So a compile that printed ``error:`` failed, and so does
    one whose machine code lacks an instruction of the kernel's inline asm; the second rule
    also holds for a variant taken from Triton's cache, which prints nothing."""
    reasons = []
    if any("error:" in line for line in stderr.splitlines()):
        reasons.append("the compiler reported errors but returned a code object")
    assembly = compiled.asm["amdgcn" if facts.kind == "rocm" else "ptx"]
    missing = sorted({op for op in _inline_asm_opcodes(compiled.asm["ttgir"]) if op not in assembly})
    if missing:
        reasons.append(
            f"inline asm missing from the {facts.name} machine code (the compiler dropped it): " + ", ".join(missing)
        )
    return "; ".join(reasons) or None


def _inline_asm_opcodes(ttgir: str) -> set[str]:
    """The first instruction of every ``tt.elementwise_inline_asm`` in Triton's IR."""
    marker = 'tt.elementwise_inline_asm "'
    opcodes = set()
    for line in ttgir.splitlines():
        start = line.find(marker)
        if start >= 0:
            opcodes.add(line[start + len(marker) :].split(None, 1)[0].rstrip(";"))
    return opcodes


def _resources(compiled: Any, facts: archs.ArchFacts) -> Any:
    shared = int(compiled.metadata.shared)
    if facts.kind == "rocm":
        return amd_resources(compiled.asm["amdgcn"], shared)
    from triton import knobs

    return nvidia_resources(
        compiled.asm["cubin"],
        shared,
        int(facts.name.removeprefix("sm")),
        int(compiled.metadata.num_warps),
        knobs.nvidia.cuobjdump.path,
    )


def _first_per_kernel(launches: list[Launch]) -> list[Launch]:
    seen: dict[str, Launch] = {}
    for launch in launches:
        seen.setdefault(launch.kernel_name, launch)
    return list(seen.values())


def check_arch(arch: str, calls: list[dict]) -> ArchResult:
    """Compile every variant ``calls`` launch for ``arch``; never raises for a kernel. On an
    arch this Triton is known to reject, only the first variant of each kernel is tried."""
    from importlib.metadata import version

    from qconform_triton_nf4.kernels.nf4_mma import MMA_CAPABILITY
    from qconform_triton_nf4.kernels.nf4_ws_gemm import WS_ARCH

    facts = archs.KNOWN_ARCHS[arch]
    started = time.perf_counter()
    mma_ptx = facts.kind == "cuda" and archs.cuda_capability(arch) >= MMA_CAPABILITY
    ws = arch == WS_ARCH
    launches, replay_errors = capture_launches(calls, facts.kind, mma_ptx, ws)
    expected = rejection(arch, version("triton"))
    if expected is not None:
        launches = _first_per_kernel(launches)
    target = triton_target(facts)
    variants: dict[str, Variant] = {}
    truncating: set[tuple[str, str]] = set()
    with _driver_for(target):
        for launch in launches:
            specialization = _specialization(launch)
            failure_key = f"{launch.kernel_name}:{json.dumps(specialization, sort_keys=True)}"
            if failure_key in variants:
                continue  # failed already: Triton does not cache a failure, and it would fail again
            stderr: list[str] = []
            try:
                with _stderr_into(stderr):
                    compiled = launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
                problem = _silent_failure(compiled, facts, "".join(stderr))
                if problem is not None:
                    raise RuntimeError(problem)
                if facts.kind == "rocm":
                    truncating.update(
                        (launch.kernel_name, op) for op in truncating_instructions(compiled.asm["amdgcn"])
                    )
                key = compiled.hash
                if key not in variants:
                    variants[key] = Variant(
                        launch.kernel_name,
                        specialization,
                        int(compiled.metadata.num_warps),
                        _resources(compiled, facts),
                    )
            except Exception as exc:  # noqa: BLE001 - a kernel that does not compile is a result, not a crash
                variants[failure_key] = Variant(
                    launch.kernel_name, specialization, None, None, _compiler_message(exc, "".join(stderr))
                )
    return ArchResult.of(
        arch,
        facts.kind,
        facts.family,
        facts.wave_size,
        variants.values(),
        replay_errors=tuple(replay_errors),
        unsupported=expected.reason if expected else None,
        unsupported_message=expected.message if expected else None,
        truncating_bf16=tuple(sorted(truncating)),
        seconds=round(time.perf_counter() - started, 1),
    )


# The check's own sources: what it replays, compiles and reads from the code objects.
CHECK_SOURCES = ("check.py", "resources.py", "bf16_rounding.py")


def fingerprint(calls: list[dict]) -> str:
    """A hash of everything that decides the results: the kernel sources, the replayed calls,
    Triton's version, the listed archs (name, kind, family, wave size), the unsupported
    targets and the check's own sources. The committed results carry it, so that a test can
    say in a second that they are stale (tests/test_compile_check.py), without compiling."""
    from importlib.metadata import version

    from qconform_triton_nf4.unsupported_targets import UNSUPPORTED_TARGETS

    digest = hashlib.sha256()
    sources = sorted(KERNELS_DIR.glob("*.py")) + [Path(__file__).with_name(name) for name in CHECK_SOURCES]
    for path in [*sources, UNSUPPORTED_TARGETS]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    targets = [[f.name, f.kind, f.family, f.wave_size] for f in archs.KNOWN_ARCHS.values()]
    digest.update(json.dumps([calls, version("triton"), targets], sort_keys=True).encode())
    return digest.hexdigest()[:20]


def _check_arch_in_worker(arch: str, calls: list[dict]) -> ArchResult:
    os.environ.pop("TRITON_INTERPRET", None)  # spawned: nothing imported the kernels yet
    return check_arch(arch, calls)


def run_check(arch_names: Sequence[str] | None = None, calls: list[dict] | None = None, jobs: int = 1) -> CompileCheck:
    """The whole check: every arch (in ``jobs`` processes) against the log plus ``extra_calls``."""
    from importlib.metadata import version

    facts = gpu_targets(arch_names)
    calls = (kernel_calls.load(kernel_calls.DEFAULT_RUN_CALLS) if calls is None else calls) + extra_calls()
    if jobs > 1:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=get_context("spawn")) as pool:
            results = list(pool.map(_check_arch_in_worker, [f.name for f in facts], [calls] * len(facts)))
    else:
        results = [check_arch(f.name, calls) for f in facts]
    reached = {k.kernel for result in results for k in result.kernels}
    uncovered = tuple(sorted(launch_sites() - reached)) if arch_names is None else ()
    return CompileCheck(version("triton"), fingerprint(calls), len(calls), tuple(results), uncovered)


def failures(check: CompileCheck) -> list[str]:
    """One message per problem: a kernel that does not compile for an arch, a call that
    cannot be replayed, a kernel no call reaches."""
    out = []
    for result in check.archs:
        out += [f"{result.arch}: {message}" for message in result.replay_errors]
        if result.unsupported is not None:
            out += [
                f"{result.arch}: {k.kernel} compiles with this Triton, but unsupported_targets.toml says the "
                "arch cannot be compiled for: remove the entry"
                for k in result.kernels
                if k.compiled
            ]
        for variant in result.failed:
            if not result.fails_as_expected(variant):
                spec = " ".join(f"{k}={v}" for k, v in variant.specialization.items() if not v.startswith("*"))
                out.append(
                    f"{result.arch} ({result.kind}, wave{result.wave_size}): {variant.kernel} does not "
                    f"compile [{spec}]:\n    " + (variant.error or "").replace("\n", "\n    ")
                )
    out += [
        f"{name}: launched in triton-nf4/qconform_triton_nf4/kernels but reached by no replayed call, so it was not "
        "compiled; record the kernel-call log again on a GPU (nox -s kernel-calls) or add a call that "
        "reaches it to compile_check.extra_calls()"
        for name in check.uncovered
    ]
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m qconform_triton_nf4.compile.check",
        description="Compile our Triton kernels for every listed GPU arch.",
    )
    parser.add_argument("--arch", action="append", help="only this arch (repeatable; default: every listed arch)")
    parser.add_argument("--calls", type=Path, help="a kernel-call log (default: the packaged default-run log)")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="processes (default: one per CPU)")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--section", type=Path, help="write the matrix's section of the results here (into reports/)")
    parser.add_argument("--doc", type=Path, help="write the Markdown table of registers, spills, occupancy here")
    options = parser.parse_args(argv)
    if os.environ.pop("TRITON_INTERPRET", None) and "qconform_triton_nf4.kernels" in sys.modules:
        print("compile_check: error: run in a process without TRITON_INTERPRET=1", file=sys.stderr)
        return 2
    try:
        calls = kernel_calls.load(options.calls) if options.calls else None
        check = run_check(options.arch, calls, max(1, options.jobs))
    except (ValueError, kernel_calls.CallLogError) as exc:
        print(f"compile_check: error: {exc}", file=sys.stderr)
        return 2
    if options.json:
        write_results(check, options.json)
    if options.doc:
        write_doc(check, options.doc)
    if options.section:
        write_section(section(check), options.section)
    problems = failures(check)
    for result in check.archs:
        print(f"{result.arch}: {result.compiled}/{result.variants} variants compiled ({result.seconds} s)")
        if result.truncating_bf16:
            print(f"  bf16 rounding: {result.truncation_note()}")
    for problem in problems:
        print(f"FAILED {problem}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
