"""The plugin's gating, markers, options and header, tested through pytester."""

import json
import textwrap

import pytest
from fake_backend import FAKE_BACKEND

SUITE = """
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_gated(qtarget, qbackend):
    assert qtarget.torch_device is not None
"""

SUITE_NEEDING_FP4 = """
import pytest
from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.suites._cases import require_claim

@pytest.mark.qconform_operation("dequantize")
def test_fp4(qtarget, qbackend):
    require_claim(qbackend, qtarget, QuantSpec("fp4"))
"""

WIDE_FAKE = """
class WideBackend(FakeBackend):
    def capabilities(self, device):
        return Capabilities(("nf4", "fp4"), (64,), False, (torch.float32, torch.bfloat16), ("cpu",))

def pytest_qconform_backends(config):
    return {"fake": WideBackend}
"""

SUITE_WITH_FORMAT_AND_DTYPE = """
import pytest
import torch
from pytest_qconform.backends.base import QuantSpec

@pytest.mark.qconform_operation("dequantize")
@pytest.mark.parametrize("spec", [QuantSpec("nf4"), QuantSpec("fp4")], ids=lambda s: s.label())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cell(qtarget, qbackend, spec, dtype):
    pass
"""

BACKENDS = ["--qconform-backend=fake", "--qconform-backend=missing", "-p", "no:cacheprovider"]


def run(pytester: pytest.Pytester, *args: str) -> pytest.RunResult:
    # An explicit path: without one, --qconform collects the shipped suites instead.
    return pytester.runpytest(str(pytester.path), "--qconform", "--qconform-no-report", *BACKENDS, *args)


def test_without_option_the_plugin_changes_nothing(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert "qconform probe" not in result.stdout.str()
    assert "qconform matrix" not in result.stdout.str()


def test_markers_are_registered_and_documented(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest("--markers")
    for line in (
        "@pytest.mark.cpu: *",
        "@pytest.mark.rocm: *",
        "@pytest.mark.gfx1200: *rdna4*",
        "@pytest.mark.sm90: *",
        "@pytest.mark.rdna4: *",
        "@pytest.mark.cdna3: *",
    ):
        result.stdout.fnmatch_lines([line])


def test_strict_markers_pass(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project, "--strict-markers")
    result.assert_outcomes(passed=1, skipped=1)


def test_cpu_run_passes_and_unavailable_backend_skips_with_reason(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project, "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*unavailable: missing: missinglib: import failed*"])


@pytest.mark.parametrize(
    "expr, needs",
    [
        ("rocm", "needs a rocm device"),
        ("gfx1200", "needs a rocm device of arch gfx1200"),
        ("rdna4", "needs a GPU of the rdna4 family"),
        ("sm90", "needs a cuda device of arch sm90"),
    ],
)
def test_absent_hardware_is_selected_and_skipped_with_reason(
    fake_backend_project: pytest.Pytester, expr: str, needs: str
) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project, "-m", expr, "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines([f"*{needs}; this run found cpu*"])
    # Selected and skipped is not checked: a mislabelled runner must not go green.
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(["qconform: nothing was checked*all 2 recorded cases were skipped*"])


def test_a_selection_matching_nothing_fails_saying_why(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project, "-m", "not cpu")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(
        [
            "qconform: nothing was checked, so this run fails (exit code 5): no conformance "
            "cell was computed; all 2 collected tests were deselected (by -k, -m, "
            "--qconform-format, --qconform-dtype, or as not applying here: see above)*"
        ]
    )


def test_a_run_whose_tests_all_skip_as_not_claimed_fails_saying_why(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE_NEEDING_FP4)
    result = fake_backend_project.runpytest(
        str(fake_backend_project.path),
        "--qconform",
        "--qconform-no-report",
        "--qconform-backend=fake",
        "-p",
        "no:cacheprovider",
    )
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED
    result.stdout.fnmatch_lines(
        [
            "qconform: nothing was checked*1 of the 1 selected tests were skipped as not "
            "applying here*'not claimed: fake does not claim format fp4'*"
        ]
    )


def test_a_run_with_a_recorded_cell_passes(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    assert run(fake_backend_project).ret == pytest.ExitCode.OK


@pytest.mark.parametrize(
    "option, passed",
    [
        ("--qconform-format=NF4", 2),
        ("--qconform-format=nf4", 2),
        ("--qconform-dtype=FP32", 2),
        ("--qconform-dtype=float32", 2),
        ("--qconform-backend=FAKE", 4),
    ],
)
def test_option_values_accept_natural_spellings(pytester: pytest.Pytester, option: str, passed: int) -> None:
    pytester.makeconftest(FAKE_BACKEND + WIDE_FAKE)
    pytester.makepyfile(test_suite=SUITE_WITH_FORMAT_AND_DTYPE)
    result = pytester.runpytest(
        str(pytester.path),
        "--qconform",
        "--qconform-no-report",
        "--qconform-backend=fake",
        option,
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=passed)
    assert result.ret == pytest.ExitCode.OK


@pytest.mark.parametrize(
    "option, allowed",
    [
        ("--qconform-format=nf5", "'nf5' is not one of nf4, fp4, hqq4"),
        ("--qconform-dtype=fp8", "'fp8' is not one of bf16, fp16, fp32"),
        ("--qconform-profile=nightly", "'nightly' is not one of ci, thorough"),
        ("--qconform-bench-shapes=huge", "'huge' is not one of full, small"),
    ],
)
def test_bad_option_values_are_usage_errors_naming_the_allowed_values(
    fake_backend_project: pytest.Pytester, option: str, allowed: str
) -> None:
    result = fake_backend_project.runpytest("--qconform", option)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"*argument {option.split('=')[0]}: {allowed} (any case)*"])


@pytest.mark.parametrize("exists", [True, False], ids=["folder-exists", "no-folder-yet"])
def test_a_path_option_given_as_two_words_is_a_usage_error_saying_how_to_write_it(
    fake_backend_project: pytest.Pytester, exists: bool
) -> None:
    """``--qconform-report-dir out`` moves pytest's rootdir into ``out`` once the folder exists
    (pytest reads ``out`` as a test path before plugin options are known): refused, exists or
    not, so the verdict does not depend on what an earlier run left; ``=`` is accepted."""
    fake_backend_project.makepyfile(test_suite=SUITE)
    if exists:
        fake_backend_project.mkdir("out")
    here = str(fake_backend_project.path)
    result = fake_backend_project.runpytest(here, "--qconform", *BACKENDS, "--qconform-report-dir", "out")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--qconform-report-dir out: write --qconform-report-dir=out. Given as two words*"])
    attached = fake_backend_project.runpytest(here, "--qconform", *BACKENDS, "--qconform-report-dir=out")
    assert attached.ret == pytest.ExitCode.OK, attached.stdout.str()[-2000:]
    assert list((fake_backend_project.path / "out").glob("*.json")), "the report goes where = says"


def test_bad_ini_profile_is_a_usage_error(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makeini("[pytest]\nqconform_profile = nightly\n")
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*ini qconform_profile: 'nightly' is not one of ci, thorough*"])


@pytest.mark.parametrize("options", [["--qconform-backend=fake"], ["--qconform-format=nf4", "--qconform-no-report"]])
def test_plugin_options_without_qconform_are_a_usage_error(
    fake_backend_project: pytest.Pytester, options: list[str]
) -> None:
    fake_backend_project.makepyfile(test_plain="def test_plain():\n    assert True\n")
    result = fake_backend_project.runpytest(*options, "-p", "no:cacheprovider")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    flags = ", ".join(option.split("=")[0] for option in options)
    verb = "only works" if len(options) == 1 else "only work"
    result.stderr.fnmatch_lines(
        [f"*{flags} {verb} with --qconform, which is missing: without it pytest-qconform runs nothing. Add --qconform*"]
    )


def test_the_simulate_environment_variable_alone_is_not_an_option(
    fake_backend_project: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("QCONFORM_SIMULATE", "gfx1200")
    fake_backend_project.makepyfile(test_plain="def test_plain():\n    assert True\n")
    fake_backend_project.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)


def test_simulated_gfx1200_gates_like_the_real_one_and_computes_nothing(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(
        test_suite="""
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_defaults(qtarget, qbackend, qconform_probe):
    raise AssertionError("must never run on a simulated device")
"""
    )
    result = run(fake_backend_project, "--qconform-simulate=gfx1200", "-m", "gfx1200", "-rs")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # computing nothing, it checked nothing
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*SIMULATED*", "*simulated gfx1200: the probe is simulated*"])


def test_a_simulated_gpu_run_computes_nothing_at_all_not_even_on_the_cpu(fake_backend_project: pytest.Pytester) -> None:
    """Its report is labelled gfx1200, so a CPU result in it would claim to be a gfx1200
    result: without -m the CPU instances are skipped too, each saying why."""
    fake_backend_project.makepyfile(
        test_suite="""
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_defaults(qtarget, qbackend):
    raise AssertionError("must never run in a simulated run")
"""
    )
    result = run(fake_backend_project, "--qconform-simulate=gfx1200", "-rs")
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # computing nothing, it checked nothing
    result.assert_outcomes(skipped=2, deselected=2)  # two backends x (simulated gfx1200: skipped, cpu: left out)
    result.stdout.fnmatch_lines(
        [
            "qconform: 2 instances not applying here were deselected: 2 for another device "
            "(x86_64 2; a run reports on one device, this one on rocm gfx1200 (simulated, no "
            "device)*"
        ]
    )
    # Asked for with -m, they are generated and skipped, each saying why.
    result = run(fake_backend_project, "--qconform-simulate=gfx1200", "-m", "cpu", "-rs")
    result.assert_outcomes(skipped=2)
    result.stdout.fnmatch_lines(["*other device: this is a simulated gfx1200 run: a run reports on one device*"])


def test_simulated_probe_applies_the_arch_defaults(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(
        test_suite="""
def test_defaults(request):
    from pytest_qconform.session import state
    targets = request.config.stash[state.TARGETS]
    gpu = [t for t in targets if t.kind == "rocm"][0]
    assert (gpu.arch, gpu.family, gpu.default_blocksize, gpu.bf16, gpu.torch_device) == (
        "gfx1200", "rdna4", 128, True, None)
    assert state.probe(request.config).simulated
"""
    )
    result = run(fake_backend_project, "--qconform-simulate=gfx1200")
    result.assert_outcomes(passed=1)


def test_unknown_simulated_arch_is_a_usage_error(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project, "--qconform-simulate=gfx9999")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*cannot simulate unknown arch 'gfx9999'*known archs*gfx1200*"])


def test_unknown_backend_is_a_usage_error(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = fake_backend_project.runpytest("--qconform", "--qconform-backend=nosuch")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*unknown backend 'nosuch'; known backends: *fake*"])


def test_header_prints_the_probe(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = run(fake_backend_project)
    result.stdout.fnmatch_lines(
        [
            "qconform probe: cpu *",
            "*default 4-bit blocksize: 64*",
            "*backend fake: 1.0*",
            "*backend missing: unavailable: missinglib*",
        ]
    )


def test_report_is_written_with_cells(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = fake_backend_project.runpytest(
        str(fake_backend_project.path), "--qconform", *BACKENDS, "--qconform-report-dir=out"
    )
    result.assert_outcomes(passed=1, skipped=1)
    reports = list((fake_backend_project.path / "out").glob("*.json"))
    assert len(reports) == 1
    data = json.loads(reports[0].read_text())
    verdicts = {(c["backend"], c["operation"]): c["verdict"] for c in data["cells"]}
    assert verdicts == {("fake", "dequantize"): "pass", ("missing", "dequantize"): "unavailable"}
    result.stdout.fnmatch_lines([f"qconform report: *{reports[0].name}"])


def test_a_run_without_report_dir_writes_into_the_ignored_local_folder(fake_backend_project: pytest.Pytester) -> None:
    """reports/ is for evidence someone chose to merge; a plain local run must not land there."""
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = fake_backend_project.runpytest(str(fake_backend_project.path), "--qconform", *BACKENDS)
    result.assert_outcomes(passed=1, skipped=1)
    assert not (fake_backend_project.path / "reports").exists()
    (report,) = (fake_backend_project.path / ".qconform" / "reports").glob("*.json")
    assert (fake_backend_project.path / ".qconform" / ".gitignore").read_text().splitlines()[-1] == "*"
    result.stdout.fnmatch_lines([f"qconform report: *.qconform/reports/{report.name}"])


def test_collect_only_writes_no_report(fake_backend_project: pytest.Pytester) -> None:
    """Nothing ran, so there is nothing to report: no empty report lands in reports/."""
    fake_backend_project.makepyfile(test_suite=SUITE)
    result = fake_backend_project.runpytest(
        str(fake_backend_project.path), "--qconform", *BACKENDS, "--qconform-report-dir=out", "--collect-only", "-q"
    )
    assert result.ret == pytest.ExitCode.OK
    assert not (fake_backend_project.path / "out").exists()
    assert "qconform report:" not in result.stdout.str()


NOISY_CONFTEST = (
    FAKE_BACKEND
    + """
import logging
import warnings

class NoisyBackend(FakeBackend):
    name = "noisy"

    def availability(self):
        if not getattr(self, "_loaded", False):  # like an import: once
            self._loaded = True
            warnings.warn("noisylib.old_api is deprecated", DeprecationWarning)
            logging.getLogger("noisylib.ops").warning("Failed to load the fast kernel: no module named 'kernels'")
        return Availability(True, "2.0")

def pytest_qconform_backends(config):
    return {"noisy": NoisyBackend}
"""
)


def test_warnings_while_loading_backends_are_one_header_line_and_kept_in_the_report(pytester: pytest.Pytester) -> None:
    pytester.makeconftest(NOISY_CONFTEST)
    pytester.makepyfile(test_suite=SUITE)
    result = pytester.runpytest_subprocess(
        str(pytester.path),
        "--qconform",
        "--qconform-report-dir=out",
        "--qconform-backend=noisy",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=1)
    assert "deprecated" not in result.stderr.str() and "Failed to load" not in result.stderr.str()
    result.stdout.fnmatch_lines(
        [
            "  backend noisy: 2.0",
            "  start-up: 2 warning(s) while loading (noisy 2; kept in the probe's notes): "
            "log WARNING noisylib.ops: Failed to load the fast kernel: no module...; "
            "DeprecationWarning: noisylib.old_api is deprecated",
        ]
    )
    assert "noisylib.old_api" not in result.stdout.str().split("qconform probe")[0]  # nothing before the header
    (path,) = (pytester.path / "out").glob("*.json")
    notes = json.loads(path.read_text())["probe"]["backends"]["noisy"]["notes"]
    assert notes[0] == "log WARNING noisylib.ops: Failed to load the fast kernel: no module named 'kernels'"
    assert notes[1].startswith("DeprecationWarning (") and "/conftest.py:" in notes[1]
    assert notes[1].endswith("): noisylib.old_api is deprecated")


def test_instances_a_backend_does_not_claim_are_one_line_not_skips(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makepyfile(test_suite=SUITE_WITH_FORMAT_AND_DTYPE)
    result = run(fake_backend_project, "-rs")
    # fake claims nf4 in fp32 only: 3 of its 4 instances are left out; missing is unavailable, so its stay.
    result.assert_outcomes(passed=1, skipped=4, deselected=3)
    result.stdout.fnmatch_lines(
        ["qconform: 3 instances not applying here were deselected: 3 not claimed by their backend (fake 3)"]
    )
    assert "not claimed" not in "".join(line for line in result.stdout.lines if line.startswith("SKIPPED"))


def test_installed_but_off_imports_neither_torch_nor_a_backend(pytester: pytest.Pytester) -> None:
    """Every project that installs the plugin loads it on every pytest start: without
    --qconform it must not import torch (seconds of start-up) or any backend. A fresh
    process, since this one has imported torch long ago."""
    pytester.makepyfile(
        test_off=textwrap.dedent("""
        import sys

        def test_off():
            heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "bitsandbytes", "hqq", "triton"))
            assert not heavy, heavy
            assert "pytest_qconform.session.plugin" in sys.modules  # the plugin itself was loaded
    """)
    )
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
