"""The compile check (triton-nf4/qconform_triton_nf4/compile/check.py): a kernel that does not
compile fails with the arch and the compiler's message; the committed results, doc and matrix
section are this checkout's (by fingerprint: the whole check, every kernel for every listed arch,
runs in `nox -s compile-check`, which .ci/run runs)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

# This process may run the kernels interpreted (other test modules do): Triton must be first
# imported with the variable set, whoever imports it first. The check itself runs in children.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

from pytest_qconform.hardware import archs  # noqa: E402
from pytest_qconform.matrix.markdown import section_lines  # noqa: E402
from pytest_qconform.report.sections import read_section, write_section  # noqa: E402
from qconform_triton_nf4 import kernel_calls
from qconform_triton_nf4.compile import check as compile_check
from qconform_triton_nf4.compile.bf16_rounding import truncating_instructions  # noqa: E402
from qconform_triton_nf4.compile.report import (  # noqa: E402
    ArchResult,
    CompileCheck,
    CompileReportError,
    Variant,
    doc_markdown,
    read_results,
    section,
    write_results,
)
from qconform_triton_nf4.compile.resources import Resources, amd_resources, nvidia_occupancy  # noqa: E402
from qconform_triton_nf4.unsupported_targets import unsupported_targets  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
COMMITTED = ROOT / "triton-nf4" / "compiled" / "compile-check.json"
SECTION = ROOT / "reports" / "sections" / "triton-nf4.json"
DOC = ROOT / "docs" / "kernels-compiled.md"
REGENERATE = (
    "regenerate them with `nox -s compile-check` and commit triton-nf4/compiled/, reports/sections/triton-nf4.json "
    "and docs/kernels-compiled.md"
)


def _without_interpreter() -> dict[str, str]:
    """This process may run the kernels interpreted; the check compiles them, in a child."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def _calls() -> list[dict]:
    """What the check replays: the packaged kernel-call log and the extra calls."""
    return kernel_calls.load(kernel_calls.DEFAULT_RUN_CALLS) + compile_check.extra_calls()


def test_the_committed_results_are_this_checkouts(tmp_path: Path) -> None:
    """The committed results are the whole check's, made from what this checkout holds: their
    fingerprint (kernel sources, calls, Triton, the listed archs, the unsupported targets, the
    check's sources) is this checkout's. The check itself (minutes per arch on a cold cache)
    runs in `nox -s compile-check`, which .ci/run runs and then requires to leave the
    committed files as they are; here a stale census fails in a second."""
    committed = read_results(COMMITTED)
    assert committed.fingerprint == compile_check.fingerprint(_calls()), (
        f"{COMMITTED.relative_to(ROOT)} is from other kernel sources, calls, archs or Triton than this checkout: "
        f"{REGENERATE}"
    )
    assert committed.ok, "the committed check failed: a kernel does not compile for a listed arch"
    assert [r.arch for r in committed.archs] == list(archs.KNOWN_ARCHS)
    for r in committed.archs:
        assert r.wave_size == archs.KNOWN_ARCHS[r.arch].wave_size
        assert r.ok or r.unsupported, f"{r.arch}: neither compiled nor a recorded unsupported target"
    reached = {k.kernel for r in committed.archs for k in r.kernels}
    assert reached == compile_check.launch_sites(), "every kernel launched in the package is compiled"
    assert DOC.read_text(encoding="utf-8") == doc_markdown(committed), f"{DOC.relative_to(ROOT)} is stale: {REGENERATE}"
    assert read_section(SECTION) == section(committed), f"{SECTION.relative_to(ROOT)} is stale: {REGENERATE}"


def test_the_fingerprint_follows_what_decides_the_results(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A changed kernel source, call, arch or Triton version gives another fingerprint, so the
    test above fails on a stale census."""
    import dataclasses
    import importlib.metadata
    import shutil

    calls = _calls()
    base = compile_check.fingerprint(calls)
    assert compile_check.fingerprint(calls) == base
    assert compile_check.fingerprint(calls[1:]) != base
    kernels = tmp_path / "kernels"
    shutil.copytree(compile_check.KERNELS_DIR, kernels, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(compile_check, "KERNELS_DIR", kernels)
    assert compile_check.fingerprint(calls) == base
    (kernels / "nf4_dequant.py").write_text((kernels / "nf4_dequant.py").read_text() + "\n# edited\n")
    assert compile_check.fingerprint(calls) != base
    monkeypatch.undo()
    first = next(iter(archs.KNOWN_ARCHS))
    monkeypatch.setitem(archs.KNOWN_ARCHS, first, dataclasses.replace(archs.KNOWN_ARCHS[first], wave_size=16))
    assert compile_check.fingerprint(calls) != base
    monkeypatch.undo()
    real_version = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.0" if name == "triton" else real_version(name))
    assert compile_check.fingerprint(calls) != base


PLANTED = textwrap.dedent("""
    import json, sys
    from qconform_triton_nf4.compile import check as compile_check
    from qconform_triton_nf4 import kernel_calls
    from qconform_triton_nf4.kernels import nf4_gemv
    calls = [c for c in kernel_calls.load(kernel_calls.DEFAULT_RUN_CALLS) if c["fn"] == "gemv_4bit"][:1]
    if sys.argv[1] == "ptx":  # the PTX warp shuffle on every platform, ROCm included
        nf4_gemv.ptx_shuffle_ok = lambda device: True
        arch = "gfx1100"
    else:  # the tensor-core kernel's inline mma.sync on ROCm (NVIDIA-only PTX)
        real_capture = compile_check.capture_launches
        compile_check.capture_launches = lambda calls, kind, mma_ptx=False, ws=False: real_capture(calls, kind, True, ws)
        calls, arch = compile_check.extra_calls()[:1], "gfx942"
    result = compile_check.check_arch(arch, calls)
    check = compile_check.CompileCheck("test", "test", len(calls), (result,))
    print(json.dumps(compile_check.failures(check)))
""")


@pytest.mark.parametrize(
    "bug, arch, kernel, message",
    [
        ("ptx", "gfx1100", "_gemv_4bit_words_kernel", "shfl.sync.idx.b32"),
        ("mma", "gfx942", "_gemm_4bit_mma_kernel", "mma.sync"),
    ],
)
def test_a_kernel_that_does_not_compile_fails_with_the_arch_and_the_compiler_message(
    bug: str, arch: str, kernel: str, message: str
) -> None:
    """Planted bugs of the class the check exists for: NVIDIA-only code on the ROCm path."""
    result = subprocess.run(
        [sys.executable, "-c", PLANTED, bug], capture_output=True, text=True, env=_without_interpreter(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    failures = json.loads(result.stdout.strip().splitlines()[-1])
    assert failures, "the planted bug compiled"
    assert all(f.startswith(f"{arch} (rocm, wave") for f in failures)
    assert any(kernel in f and message in f for f in failures), failures


def _arch_result(arch: str = "gfx1200", errors: tuple[str | None, ...] = (None,), **kwargs) -> ArchResult:
    resources = Resources(registers=40, spills=0, shared=0, occupancy=16)
    variants = [Variant("nf4_gemv._k", {"BLOCK": str(i)}, 4, None if e else resources, e) for i, e in enumerate(errors)]
    facts = archs.KNOWN_ARCHS[arch]
    return ArchResult.of(arch, facts.kind, facts.family, facts.wave_size, variants, **kwargs)


def test_compiler_messages_name_sources_relative_to_the_checkout() -> None:
    """The committed results are compared with a fresh check in CI's checkout, elsewhere."""
    source = compile_check.KERNELS_DIR / "nf4_dequant.py"
    message = compile_check._compiler_message(
        RuntimeError(f"{source}:118:1: PassManager::run failed"),
        f"{source}:118:1: error: unsupported target: 'gfx1030'\ndef k(\n",
    )
    assert str(compile_check.KERNELS_DIR) not in message
    assert (
        message.splitlines()[0]
        == "triton-nf4/qconform_triton_nf4/kernels/nf4_dequant.py:118:1: error: unsupported target: 'gfx1030'"
    )
    assert (
        message.splitlines()[-1]
        == "RuntimeError: triton-nf4/qconform_triton_nf4/kernels/nf4_dequant.py:118:1: PassManager::run failed"
    )


def test_failures_name_an_uncovered_kernel_and_a_stale_unsupported_entry() -> None:
    stale = _arch_result("gfx1030", unsupported="RDNA2 is not a target", unsupported_message="unsupported target")
    check = CompileCheck("3.9.0", "f", 1, (stale,), uncovered=("nf4_gemv._new_kernel",))
    messages = compile_check.failures(check)
    assert any("gfx1030" in m and "remove the entry" in m for m in messages)
    assert any(
        m.startswith("nf4_gemv._new_kernel: launched in triton-nf4/qconform_triton_nf4/kernels but reached by no")
        for m in messages
    )
    assert not check.ok


def test_an_unsupported_target_passes_only_when_it_fails_as_recorded() -> None:
    recorded = dict(unsupported="RDNA2 is not a target", unsupported_message="unsupported target: 'gfx103")
    rejected = _arch_result("gfx1030", ("error: unsupported target: 'gfx1030'",), **recorded)
    other = _arch_result("gfx1030", ("input_precision must be one of",), **recorded)
    assert rejected.as_expected and not rejected.ok
    assert not other.as_expected and compile_check.failures(CompileCheck("3.9.0", "f", 1, (other,)))


def test_unsupported_targets_file_is_read_and_a_bad_entry_named(tmp_path: Path) -> None:
    entries = unsupported_targets()
    assert {"gfx1030", "gfx1031"} <= set(entries) and entries["gfx1030"].triton
    bad = tmp_path / "bad.toml"
    bad.write_text('[[target]]\narchs = ["gfx9999"]\ntriton = "3.9.0"\nmessage = "x"\nreason = "y"\n')
    with pytest.raises(ValueError, match=r"bad.toml: \[\[target\]\] 1: .*unknown arch 'gfx9999'"):
        unsupported_targets(bad)


def test_unknown_arch_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unknown arch 'gfx9999'; known archs: gfx906"):
        compile_check.gpu_targets(["gfx9999"])
    result = subprocess.run(
        [sys.executable, "-m", "qconform_triton_nf4.compile.check", "--arch", "gfx9999"],
        capture_output=True,
        text=True,
        env=_without_interpreter(),
        cwd=ROOT,
    )
    assert result.returncode == 2 and "unknown arch 'gfx9999'" in result.stderr


def test_results_round_trip_and_a_run_report_is_not_taken_for_them(tmp_path: Path) -> None:
    check = CompileCheck("3.9.0", "f", 2, (_arch_result(), _arch_result("sm90", ("boom",))))
    path = tmp_path / "compile-check.json"
    write_results(check, path)
    assert read_results(path).to_dict() == check.to_dict()
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"schema_version": 1, "probe": {}, "cells": []}))
    with pytest.raises(CompileReportError, match="not compile-check results"):
        read_results(report)


AMDGCN = """
    ; NumVgprs: 93
    ; Occupancy: 12
    .agpr_count:     4
    .sgpr_count:     51
    .sgpr_spill_count: 1
    .vgpr_count:     93
    .vgpr_spill_count: 2
"""


def test_amd_resources_come_from_the_amdgcn_metadata() -> None:
    assert amd_resources(AMDGCN, 4096) == Resources(registers=97, spills=3, shared=4096, occupancy=12, sgprs=51)
    with pytest.raises(ValueError, match="no .*vgpr_count"):
        amd_resources("; Occupancy: 1", 0)


@pytest.mark.parametrize(
    "capability, registers, warps, expected",
    [
        (90, 56, 4, (36, 64)),  # 56 x 32 = 1792 registers a warp: 9 programs of 4 warps in 64 K
        (90, 32, 4, (64, 64)),  # the register file allows 128 warps: capped at the SM's 64
        (75, 32, 4, (32, 32)),  # Turing: 32 warps per SM
        (86, 255, 8, (8, 48)),  # 255 -> 8192 registers a warp: 8 warps
        (90, 16, 1, (32, 64)),  # one-warp programs: capped by 32 blocks per SM
    ],
)
def test_nvidia_occupancy_follows_the_register_file_and_the_sm_limits(capability, registers, warps, expected):
    assert nvidia_occupancy(capability, registers, warps) == expected


def test_matrix_rows_say_compiled_not_run_only_for_archs_without_a_run() -> None:
    rejected = _arch_result(
        "gfx1030", ("unsupported target: 'gfx1030'",), unsupported="RDNA2", unsupported_message="unsupported target"
    )
    check = CompileCheck(
        "3.9.0", "f", 1, (_arch_result("gfx1200"), _arch_result("gfx942", ("boom",)), rejected, _arch_result("sm90"))
    )
    text = "\n".join(section_lines(section(check), {"sm90", "x86_64"}))
    assert "| gfx1200 | rdna4 | 32 | 🛠 compiled, not run (1 variants of 1 kernels) | · not run |" in text
    assert "| gfx942 | cdna3 | 64 | · not run (the compile check failed: 1 of 1 variants) | · not run |" in text
    assert "| gfx1030 | rdna2 | 32 | · not run (Triton 3.9.0 rejects the target) | · not run |" in text
    assert "| sm90 |" not in text, "an arch with a run report shows its verdicts, not a compile result"
    assert "✅" not in text and "pass" not in text, "a compile result never looks like a verdict"
    assert section_lines(section(check), {"gfx1200", "gfx942", "gfx1030", "sm90"}) == []


def test_the_call_log_replays_as_each_platform_would() -> None:
    """ROCm takes the code-table loads and no tensor-core kernel, NVIDIA (sm_80+) the PTX
    shuffle and the tensor-core kernel's PTX, from the same calls."""
    calls = [c for c in kernel_calls.load(kernel_calls.DEFAULT_RUN_CALLS) if c["fn"] == "gemv_4bit"][:3]
    script = textwrap.dedent("""
        import json, sys
        from qconform_triton_nf4.compile import check as compile_check
        calls = json.loads(sys.argv[1]) + compile_check.extra_calls()[:1]
        out = {}
        for kind, mma_ptx in (("rocm", False), ("cuda", True)):
            launches, errors = compile_check.capture_launches(calls, kind, mma_ptx)
            assert not errors, errors
            out[kind] = {key: sorted({str(l.kwargs[key]) for l in launches if key in l.kwargs})
                         for key in ("SHUFFLE", "PTX")}
        print(json.dumps(out))
    """)
    result = subprocess.run(
        [sys.executable, "-c", script, json.dumps(calls)],
        capture_output=True,
        text=True,
        env=_without_interpreter(),
        cwd=ROOT,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout) == {
        "rocm": {"SHUFFLE": ["False"], "PTX": []},
        "cuda": {"SHUFFLE": ["True"], "PTX": ["True"]},
    }


def test_the_matrix_cli_reads_the_section_beside_the_run_reports(tmp_path: Path) -> None:
    """`nox -s matrix` scans reports/ recursively: the wing's section there is not a report, and
    the matrix renders it as the core's record, knowing nothing of the compile check."""
    from pytest_qconform.matrix.cli import main as matrix_main

    write_section(section(CompileCheck("3.9.0", "f", 1, (_arch_result("gfx1200"),))), tmp_path / "sections" / "t.json")
    for report in sorted((ROOT / "reports").glob("x86_64-*.json"))[-1:]:
        (tmp_path / report.name).write_bytes(report.read_bytes())
    out = tmp_path / "MATRIX.md"
    assert matrix_main([str(tmp_path), "--out", str(out)]) == 0
    text = out.read_text(encoding="utf-8")
    assert "| gfx1200 | rdna4 | 32 | 🛠 compiled, not run (1 variants of 1 kernels) | · not run |" in text
    assert "| x86_64 |" in text


# The planted bf16 multiply below as Triton 3.6.0 compiles it for gfx1200 (recorded on the H100
# host on 2026-11-25 by compiling the same kernel; gfx1100 gives the same): one v_dot2_bf16_bf16 with a
# zeroed lane, the instruction of triton-lang/triton#11217.
TRUNCATING_AMDGCN = """
	buffer_load_u16 v2, v1, s[0:3], null offen
	buffer_load_u16 v3, v1, s[0:3], null offen
	v_dot2_bf16_bf16 v2, v2, v3, 0
	buffer_store_b16 v2, v0, s[8:11], null offen
"""
# What the scan must find in the planted multiply, by the Triton that compiled it (observed:
# 3.6.0 on the H100 host, 3.9.0 on the CPU machine); another Triton may give either.
EXPECTED_BY_TRITON = {"3.6.0": ["v_dot2_bf16_bf16"], "3.9.0": []}

# The planted bug of the class the scan exists for: a kernel that multiplies in bf16.
TRUNCATING_BF16_PROBE = textwrap.dedent("""
    import json
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from qconform_triton_nf4.compile.bf16_rounding import truncating_instructions

    @triton.jit
    def bf16_product(a_ptr, b_ptr, c_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(c_ptr + i, tl.load(a_ptr + i) * tl.load(b_ptr + i))

    source = triton.compiler.ASTSource(fn=bf16_product, constexprs={"BLOCK": 64},
                                       signature={"a_ptr": "*bf16", "b_ptr": "*bf16", "c_ptr": "*bf16", "BLOCK": "constexpr"})
    compiled = triton.compile(source, target=GPUTarget("hip", "gfx1200", 32))
    print(json.dumps(truncating_instructions(compiled.asm["amdgcn"])))
""")


def test_truncating_bf16_instructions_are_found_in_amd_machine_code() -> None:
    assert truncating_instructions(TRUNCATING_AMDGCN) == ("v_dot2_bf16_bf16",)
    assert truncating_instructions(TRUNCATING_AMDGCN.replace("v_dot2_bf16_bf16", "v_dot2_f32_bf16")) == ()
    assert truncating_instructions("; v_dot2_bf16_bf16 in a comment\n") == ()


def test_this_triton_compiles_a_bf16_multiply_as_the_scan_expects(tmp_path: Path) -> None:
    """The planted bf16 multiply, compiled for gfx1200 by this Triton: Triton releases with
    #8444 and without #11227 must be flagged, others must not (the scan agrees with the
    compiler, whichever this is)."""
    probe = tmp_path / "bf16_probe.py"  # Triton reads a kernel's source from its file
    probe.write_text(TRUNCATING_BF16_PROBE, encoding="utf-8")
    result = subprocess.run(
        [sys.executable, str(probe)], capture_output=True, text=True, env=_without_interpreter(), cwd=ROOT
    )
    assert result.returncode == 0, result.stderr[-3000:]
    found = json.loads(result.stdout.strip().splitlines()[-1])
    from importlib.metadata import version

    assert found == EXPECTED_BY_TRITON.get(version("triton"), found) and found in ([], ["v_dot2_bf16_bf16"])


def test_a_truncating_arch_is_named_in_the_results_doc_and_matrix(tmp_path: Path) -> None:
    truncating = _arch_result("gfx1200", truncating_bf16=(("nf4_gemv._k", "v_dot2_bf16_bf16"),))
    check = CompileCheck("3.6.0", "f", 1, (truncating, _arch_result("gfx942")))
    path = tmp_path / "compile-check.json"
    write_results(check, path)
    assert read_results(path).archs[0].truncating_bf16 == (("nf4_gemv._k", "v_dot2_bf16_bf16"),)
    note = truncating.truncation_note()
    assert (
        note is not None
        and note.startswith("gfx1200: `_k` execute `v_dot2_bf16_bf16` writes its bf16 result truncated")
        and "expected to fail the rounding check" in note
    )
    assert f"- {note}" in doc_markdown(check)
    assert f"- {note}" in section_lines(section(check), {"gfx1200", "gfx942"})
    assert _arch_result("gfx942").truncation_note() is None
