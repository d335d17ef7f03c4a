"""The compile check's results: the record (JSON, versioned), the registers/spills/occupancy
table (docs/kernels-compiled.md) and the matrix's "compiled, not run" rows.

The results say that our kernels *compile* for an arch, never how they compute there: the
matrix shows them apart from verdicts, only for archs without a run report, and only for
our kernels (``triton-nf4``); everything else on such an arch stays "not run".
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pytest_qconform.report.sections import ArchStatus, Section
from qconform_triton_nf4.compile.resources import Resources

KIND = "qconform-compile-check"
SCHEMA_VERSION = 1
BACKEND = "triton-nf4"
COMPILED_SYMBOL = "🛠"


class CompileReportError(ValueError):
    """A results file that cannot be read: names the file and the problem."""


@dataclass(frozen=True)
class Variant:
    """One compiled (or failed) kernel variant: ``error`` is the compiler's message."""

    kernel: str  # "nf4_gemv._gemv_4bit_rows_kernel"
    specialization: dict[str, str]  # constexprs and tensor element types -> value
    num_warps: int | None
    resources: Resources | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"kernel": self.kernel, "specialization": self.specialization, "error": self.error}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Variant:
        return cls(data["kernel"], dict(data["specialization"]), None, None, data["error"])


def _span(values: Iterable[int]) -> tuple[int, int]:
    ordered = sorted(values)
    return ordered[0], ordered[-1]


@dataclass(frozen=True)
class KernelSummary:
    """One kernel on one arch: its variants, and the range of what the compiled ones need."""

    kernel: str
    variants: int
    compiled: int
    registers: tuple[int, int] | None = None  # (min, max) over the compiled variants
    spills: int | None = None  # max
    occupancy: tuple[int, int] | None = None  # (min, max)
    occupancy_max: int | None = None  # NVIDIA: the SM's resident-warp limit

    @classmethod
    def of(cls, kernel: str, variants: list[Variant]) -> KernelSummary:
        good = [v.resources for v in variants if v.resources is not None]
        if not good:
            return cls(kernel, len(variants), 0)
        return cls(
            kernel,
            len(variants),
            len(good),
            _span(r.registers for r in good),
            max(r.spills for r in good),
            _span(r.occupancy for r in good),
            good[0].occupancy_max,
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KernelSummary:
        pair = lambda key: tuple(data[key]) if data.get(key) is not None else None  # noqa: E731
        return cls(
            data["kernel"],
            int(data["variants"]),
            int(data["compiled"]),
            pair("registers"),
            data.get("spills"),
            pair("occupancy"),
            data.get("occupancy_max"),
        )


@dataclass(frozen=True)
class ArchResult:
    """One arch: a summary per kernel, every variant that failed, calls the replay could not make."""

    arch: str
    kind: str  # "rocm" | "cuda"
    family: str
    wave_size: int
    kernels: tuple[KernelSummary, ...]
    failed: tuple[Variant, ...] = ()
    replay_errors: tuple[str, ...] = ()
    # Set when this Triton rejects the arch as a target (unsupported_targets.toml): the reason,
    # and what each compile error says.
    unsupported: str | None = None
    unsupported_message: str | None = None
    # (kernel, instruction) for each compiled kernel whose machine code holds an instruction
    # that rounds bf16 toward zero (bf16_rounding.py): its bf16 results cannot round to nearest.
    truncating_bf16: tuple[tuple[str, str], ...] = ()
    seconds: float | None = field(default=None, compare=False)  # printed, not stored: results stay reproducible

    @classmethod
    def of(
        cls, arch: str, kind: str, family: str, wave_size: int, variants: Iterable[Variant], **kwargs: Any
    ) -> ArchResult:
        """From every variant compiled (or not) for the arch."""
        by_kernel: dict[str, list[Variant]] = {}
        for variant in variants:
            by_kernel.setdefault(variant.kernel, []).append(variant)
        summaries = tuple(KernelSummary.of(k, by_kernel[k]) for k in sorted(by_kernel))
        failed = tuple(
            sorted(
                (v for v in sum(by_kernel.values(), []) if v.error is not None),
                key=lambda v: (v.kernel, json.dumps(v.specialization, sort_keys=True)),
            )
        )
        return cls(arch, kind, family, wave_size, summaries, failed, **kwargs)

    @property
    def variants(self) -> int:
        return sum(k.variants for k in self.kernels)

    @property
    def compiled(self) -> int:
        return sum(k.compiled for k in self.kernels)

    def fails_as_expected(self, variant: Variant) -> bool:
        return bool(self.unsupported_message and variant.error and self.unsupported_message in variant.error)

    @property
    def ok(self) -> bool:
        """Every variant compiled (an unsupported arch is never ok)."""
        return not self.replay_errors and not self.unsupported and bool(self.kernels) and not self.failed

    @property
    def as_expected(self) -> bool:
        """Nothing for the check to fail on: ok, or unsupported and failing as recorded."""
        if self.unsupported:
            return (
                not self.replay_errors
                and bool(self.kernels)
                and self.compiled == 0
                and all(map(self.fails_as_expected, self.failed))
            )
        return self.ok

    def to_dict(self) -> dict[str, Any]:
        return {
            "arch": self.arch,
            "kind": self.kind,
            "family": self.family,
            "wave_size": self.wave_size,
            "ok": self.ok,
            "unsupported": self.unsupported,
            "unsupported_message": self.unsupported_message,
            "kernels": [k.to_dict() for k in self.kernels],
            "failed": [v.to_dict() for v in self.failed],
            "replay_errors": list(self.replay_errors),
            "truncating_bf16": [list(pair) for pair in self.truncating_bf16],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ArchResult:
        return cls(
            data["arch"],
            data["kind"],
            data["family"],
            int(data["wave_size"]),
            tuple(KernelSummary.from_dict(k) for k in data["kernels"]),
            tuple(Variant.from_dict(v) for v in data.get("failed", ())),
            tuple(data.get("replay_errors", ())),
            data.get("unsupported"),
            data.get("unsupported_message"),
            tuple((str(k), str(i)) for k, i in data.get("truncating_bf16", ())),
        )

    def truncation_note(self) -> str | None:
        """One sentence on the truncating instructions found, or None."""
        if not self.truncating_bf16:
            return None
        from qconform_triton_nf4.compile.bf16_rounding import TRUNCATING_BF16

        kernels = ", ".join(sorted({f"`{k.rsplit('.', 1)[-1]}`" for k, _ in self.truncating_bf16}))
        instructions = sorted({i for _, i in self.truncating_bf16})
        why = "; ".join(f"`{i}` {TRUNCATING_BF16.get(i, 'truncates')}" for i in instructions)
        return (
            f"{self.arch}: {kernels} execute {why}: our bf16 results on {self.arch} are expected to fail the "
            f"rounding check (compiled, not run)"
        )


@dataclass(frozen=True)
class CompileCheck:
    """One run of the compile check over the listed archs."""

    triton: str
    fingerprint: str  # compile_check.fingerprint: kernel sources, replayed calls, Triton version
    calls: int
    archs: tuple[ArchResult, ...]
    uncovered: tuple[str, ...] = ()  # kernels launched in the package that no call reached

    @property
    def ok(self) -> bool:
        """Nothing to fail on: every arch compiled, or is unsupported as recorded; every kernel reached."""
        return not self.uncovered and all(result.as_expected for result in self.archs)

    def to_dict(self) -> dict[str, Any]:
        return {
            "kind": KIND,
            "schema_version": SCHEMA_VERSION,
            "triton": self.triton,
            "fingerprint": self.fingerprint,
            "calls": self.calls,
            "ok": self.ok,
            "uncovered": list(self.uncovered),
            "archs": [r.to_dict() for r in self.archs],
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompileCheck:
        return cls(
            data["triton"],
            data["fingerprint"],
            int(data["calls"]),
            tuple(ArchResult.from_dict(r) for r in data["archs"]),
            tuple(data.get("uncovered", ())),
        )


def is_results(data: Any) -> bool:
    """Whether parsed JSON is a compile check's results (not a run report)."""
    return isinstance(data, dict) and data.get("kind") == KIND


def is_results_file(path: Path) -> bool:
    """Whether ``path`` holds compile-check results (a JSON file whose "kind" says so)."""
    try:
        return is_results(json.loads(Path(path).read_text(encoding="utf-8")))
    except (OSError, ValueError):
        return False  # not ours: whoever reads it next names the problem


def read_results(path: Path) -> CompileCheck:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CompileReportError(f"{path}: cannot read compile-check results: {exc}") from None
    if not is_results(data):
        raise CompileReportError(f'{path}: not compile-check results (no "kind": "{KIND}")')
    if data.get("schema_version") != SCHEMA_VERSION:
        raise CompileReportError(
            f"{path}: compile-check schema_version {data.get('schema_version')!r}, "
            f"this version reads {SCHEMA_VERSION}; regenerate with nox -s compile-check"
        )
    try:
        return CompileCheck.from_dict(data)
    except (KeyError, TypeError, ValueError) as exc:
        raise CompileReportError(f"{path}: malformed compile-check results: {type(exc).__name__}: {exc}") from None


def write_results(check: CompileCheck, path: Path) -> None:
    """JSON with one arch per line (diffs stay readable), keys sorted: same results, same bytes."""
    data = check.to_dict()
    archs = data.pop("archs")
    head = json.dumps(data, sort_keys=True, ensure_ascii=False)[:-1]
    lines = ",\n".join(json.dumps(a, sort_keys=True, ensure_ascii=False, separators=(",", ":")) for a in archs)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'{head}, "archs": [\n{lines}\n]}}\n', encoding="utf-8")


# ---------------------------------------------------------------- docs/kernels-compiled.md


def _range(pair: tuple[int, int]) -> str:
    return str(pair[0]) if pair[0] == pair[1] else f"{pair[0]}–{pair[1]}"


def _kernel_cell(result: ArchResult, kernel: str) -> str:
    summary = next((k for k in result.kernels if k.kernel == kernel), None)
    if summary is None:
        return "–"
    failed = summary.variants - summary.compiled
    if summary.compiled == 0:
        return "target rejected" if result.as_expected and result.unsupported else f"❌ {failed} fail"
    assert summary.registers and summary.occupancy
    occupancy = _range(summary.occupancy) + (f"/{summary.occupancy_max}" if summary.occupancy_max else "")
    cell = f"{summary.compiled} var · {_range(summary.registers)} reg · {summary.spills} spill · occ {occupancy}"
    return cell + (f" · ❌ {failed} fail" if failed else "")


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "|".join(" --- " for _ in header) + "|"] + [
        "| " + " | ".join(row) + " |" for row in rows
    ]


def doc_markdown(check: CompileCheck) -> str:
    kernels = sorted({k.kernel for result in check.archs for k in result.kernels})
    short = {k: k.rsplit(".", 1)[-1] for k in kernels}
    rows = [
        [r.arch, r.family, str(r.wave_size), _status(r), *(_kernel_cell(r, k) for k in kernels)] for r in check.archs
    ]
    out = [
        "# Our Triton kernels, compiled for every listed arch",
        "",
        "<!-- generated by `nox -s compile-check`; do not edit by hand -->",
        "",
        f"Every variant a default run launches (the kernel-call log plus `compile_check.extra_calls()`: "
        f"{check.calls} entry-point calls), compiled with Triton {check.triton} on a CPU for each GPU arch in "
        f"`pytest_qconform/hardware/archs.py`, down to the code object (AMD: hsaco, NVIDIA: cubin). Compiled is not "
        f"run: nothing here was computed on these GPUs. Results: `triton-nf4/compiled/compile-check.json` "
        f"(fingerprint `{check.fingerprint}`), the matrix's section of them: `reports/sections/triton-nf4.json`; "
        "how it works: `triton-nf4/qconform_triton_nf4/compile/check.py`.",
        "",
        "A cell: variants compiled · registers per thread (min–max) · spills (max) · occupancy (min–max).",
        "AMD: registers are VGPRs (+ AGPRs), spills are spilled VGPRs + SGPRs, occupancy is LLVM's waves per "
        "SIMD. NVIDIA: registers from the cubin (cuobjdump), spills are bytes of local memory per thread, "
        "occupancy is resident warps per SM / the SM's maximum, from the registers and the warp and block "
        "limits (triton-nf4/qconform_triton_nf4/compile/resources.py; shared memory not applied). –: no replayed call "
        "launches the kernel on that arch (the entry points route elsewhere there: the tensor-core kernel, "
        "`_gemm_4bit_mma_kernel`, runs on NVIDIA from sm_80 only; the warp-specialized Gluon GEMM, "
        "`_gemm_4bit_ws_kernel`, on sm_90 only: its `wgmma` and TMA are Hopper's; its occupancy counts every warp at "
        "the launch's register limit, which its producer warp lowers for itself at run time).",
        "",
        *_table(["arch", "family", "wave", "all compile", *(f"`{short[k]}`" for k in kernels)], rows),
    ]
    spilling = [(r.arch, k) for r in check.archs for k in r.kernels if k.spills]
    if spilling:
        out += [
            "",
            "## Spills",
            "",
            "Kernels whose registers did not fit (AMD: registers spilled, NVIDIA: bytes of local memory "
            "per thread; max over the variants). Spills cost speed, not correctness:",
            "",
        ]
        out += [
            f"- {arch}: `{k.kernel.rsplit('.', 1)[-1]}`: {k.spills} ({_range(k.registers or (0, 0))} registers)"
            for arch, k in spilling
        ]
    truncating = [r.truncation_note() for r in check.archs if r.truncating_bf16]
    out += [
        "",
        "## bf16 rounding",
        "",
        "The AMD machine code of every variant is scanned for instructions known to round bf16 toward zero "
        "(`triton-nf4/qconform_triton_nf4/compile/bf16_rounding.py`). "
        + ("Found:" if truncating else f"None found with Triton {check.triton}."),
    ]
    out += ["", *(f"- {note}" for note in truncating)] if truncating else []
    unsupported = [r for r in check.archs if r.unsupported]
    if unsupported:
        out += [
            "",
            f"## Archs Triton {check.triton} cannot compile for",
            "",
            "Listed in `triton-nf4/qconform_triton_nf4/unsupported_targets.toml`; the check compiles the first variant of each "
            "kernel there and requires it to fail with the recorded message:",
            "",
        ]
        out += [f"- {r.arch}: {r.unsupported}" for r in unsupported]
    problems = [(r.arch, v) for r in check.archs for v in r.failed if not r.fails_as_expected(v)]
    if problems or check.uncovered:
        out += ["", "## Failures", ""]
        out += [
            f"- {arch}: `{v.kernel}` ({', '.join(f'{k}={s}' for k, s in v.specialization.items())}): "
            f"{v.error.splitlines()[-1] if v.error else ''}"
            for arch, v in problems
        ]
        out += [f"- `{name}`: reached by no replayed call, not compiled" for name in check.uncovered]
    return "\n".join(out) + "\n"


def _status(result: ArchResult) -> str:
    if result.ok:
        return "✅"
    return "⚠️ target rejected" if result.as_expected else "❌"


def write_doc(check: CompileCheck, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(doc_markdown(check), encoding="utf-8")


# ---------------------------------------------------------------- the matrix's section


def section(check: CompileCheck) -> Section:
    """What the matrix shows of the check (the core's section record): per arch our kernels'
    status in words, "compiled, not run" where every variant compiled, and the bf16 rounding
    notes. The matrix shows an arch's row only where no run report covers the arch."""
    statuses = []
    for result in check.archs:
        if result.ok:
            status = f"compiled, not run ({result.variants} variants of {len(result.kernels)} kernels)"
        elif result.unsupported:
            status = f"not run (Triton {check.triton} rejects the target)"
        else:
            status = f"not run (the compile check failed: {len(result.failed)} of {result.variants} variants)"
        statuses.append(ArchStatus(result.arch, result.ok, status))
    return Section(
        backend=BACKEND,
        source=f"the compile check, Triton {check.triton}",
        title="Compiled, not run",
        explanation=f"our Triton kernels compile for the arch, checked on a CPU with Triton {check.triton}; nothing "
        "was computed on it, so no verdict. Registers, spills, occupancy: docs/kernels-compiled.md",
        symbol=COMPILED_SYMBOL,
        archs=tuple(statuses),
        notes_title="bf16 rounding",
        notes=tuple(note for r in check.archs if (note := r.truncation_note())),
    )
