"""Proof that every conformance check can fail: the suites against the mutant zoo.

One pytester run of the real suites, with the correct plain-PyTorch backend and every
mutant registered through the ``pytest_qconform_backends`` hook; the run report then
says, per backend and operation, what the suites concluded. Each mutant must fail the
operation whose check targets its bug class, and the correct backend must pass all.
"""
from __future__ import annotations

import json
import textwrap

import pytest

from zoo import MUTANTS

CONFTEST = textwrap.dedent("""
    from qconform_example_nf4.backend import TorchNF4Backend
    from zoo import MUTANTS

    def pytest_qconform_backends(config):
        backends = {"torch-nf4-correct": type("Correct", (TorchNF4Backend,), {"name": "torch-nf4-correct"})}
        backends.update({m.name: m for m in MUTANTS})
        return backends
""")


@pytest.fixture(scope="module")
def zoo_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the suites once against the zoo (module scope: the run is the expensive part)."""
    import subprocess
    import sys
    from pathlib import Path

    root = tmp_path_factory.mktemp("zoo")
    (root / "conftest.py").write_text(CONFTEST)
    tests_dir = Path(__file__).parent
    example = tests_dir.parent / "examples" / "downstream" / "src"
    names = ["torch-nf4-correct"] + [m.name for m in MUTANTS]
    args = [sys.executable, "-m", "pytest", "--qconform", "-p", "no:cacheprovider", "-q", "--tb=no",
            f"--qconform-report-dir={root / 'out'}", "-o", "addopts=",
            *[f"--qconform-backend={n}" for n in names]]
    env = {**__import__("os").environ, "PYTHONPATH": f"{tests_dir}:{example}"}
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    reports = list((root / "out").glob("*.json"))
    assert len(reports) == 1, f"no report written:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(reports[0].read_text())


def _verdicts(report: dict, backend: str) -> dict[str, set[str]]:
    by_operation: dict[str, set[str]] = {}
    for cell in report["cells"]:
        if cell["backend"] == backend:
            by_operation.setdefault(cell["operation"], set()).add(cell["verdict"])
    return by_operation


def test_correct_backend_passes_every_check(zoo_report: dict) -> None:
    verdicts = _verdicts(zoo_report, "torch-nf4-correct")
    assert verdicts, "the correct backend produced no cells"
    failing = {op: v for op, v in verdicts.items() if v - {"pass"}}
    assert not failing, f"the correct backend did not pass: {failing}"
    expected = {"quantize", "dequantize", "matmul", "matmul-fp32-input", "backward", "sequencing", "interop",
                "layer-quantize", "layer-forward", "layer-state", "checkpoint", "device-move", "layer-sequencing"}
    assert expected <= set(verdicts)


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_caught_by_its_check(zoo_report: dict, mutant) -> None:
    verdicts = _verdicts(zoo_report, mutant.name)
    assert "fail" in verdicts.get(mutant.catches, set()), (
        f"{mutant.name} ({mutant.__doc__.strip().splitlines()[0]}) was not caught by the "
        f"{mutant.catches} suite: {verdicts}")


# Measured by bench/sensitivity.py (bench/results/sensitivity-cpu.json, docs/sensitivity.md):
# the smallest systematic relative matmul error the ci profile catches, per dtype.
SMALLEST_CAUGHT_EPS = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -10, "fp32": 2.0 ** -18}


def test_matmul_suite_catches_systematic_error_at_the_documented_threshold(tmp_path) -> None:
    """Guards the documented sensitivity: a matmul off by the documented relative error
    in every dtype fails the matmul suite in every dtype (one run, eps per dtype)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests_dir = Path(__file__).parent
    (tmp_path / "conftest.py").write_text(
        "from zoo import ScaledMatmul\n"
        "def pytest_qconform_backends(config):\n"
        "    return {ScaledMatmul.name: ScaledMatmul}\n")
    env = {**os.environ, "QCONFORM_MUTANT_EPS": json.dumps(SMALLEST_CAUGHT_EPS),
           "PYTHONPATH": f"{tests_dir}:{tests_dir.parent / 'examples' / 'downstream' / 'src'}"}
    args = [sys.executable, "-m", "pytest", "--qconform", "-q", "--tb=no", "-p", "no:cacheprovider",
            "-o", "addopts=", f"--qconform-report-dir={tmp_path / 'out'}",
            "--qconform-backend=mutant-scaled-matmul", "-k", "test_matmul_matches_reference and nf4-b64 and not dq"]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    verdicts = {cell["dtype"]: cell["verdict"] for cell in report["cells"] if cell["operation"] == "matmul"}
    assert verdicts == {"bf16": "fail", "fp16": "fail", "fp32": "fail"}, (verdicts, proc.stdout[-3000:])
