"""triton-nf4 works, or says why not, whatever was imported before the plugin configured.

Each run is a subprocess: this process has triton imported already (in interpreter mode).
"""

from __future__ import annotations

import json
import os

import pytest

pytest.importorskip("triton")
torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles the kernels: no interpreter")

SELECT = (
    "--qconform",
    "--qconform-backend=triton-nf4",
    "--qconform-report-dir=out",
    "-p",
    "no:cacheprovider",
    # One NF4 fp32 instance of each check on the 64 x 128 weight: one of the CPU's covering
    # array, or an unavailable backend's one instance.
    "-k",
    "(test_matmul_matches_reference or test_dequantize_matches_reference_bytes) and nf4-nf4-b and fp32-W64x128",
)


@pytest.fixture
def fresh_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def cells(pytester: pytest.Pytester) -> dict[str, dict]:
    (path,) = (pytester.path / "out").glob("*.json")
    return {c["operation"]: c for c in json.loads(path.read_text())["cells"]}


@pytest.mark.parametrize("conftest", ["import bitsandbytes\n", "import triton\nimport triton.language as tl\n"])
def test_a_conftest_importing_triton_first_does_not_break_the_kernels(
    pytester: pytest.Pytester, fresh_env, conftest: str
) -> None:
    if conftest.startswith("import bitsandbytes"):
        pytest.importorskip("bitsandbytes")
    pytester.makeconftest(conftest)
    result = pytester.runpytest_subprocess(*SELECT)
    outcomes = result.parseoutcomes()
    assert outcomes.get("passed", 0) >= 2 and not outcomes.get("failed"), outcomes
    assert {op: c["verdict"] for op, c in cells(pytester).items()} == {"dequantize": "pass", "matmul": "pass"}


def test_triton_imported_before_pytest_configures_makes_the_backend_unavailable_saying_why(
    pytester: pytest.Pytester, fresh_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    pytester.makepyfile(early_plugin="import triton.language\n")  # a -p plugin is imported before any hook runs
    monkeypatch.setenv(
        "PYTHONPATH", os.pathsep.join(p for p in (str(pytester.path), os.environ.get("PYTHONPATH")) if p)
    )
    result = pytester.runpytest_subprocess("-p", "early_plugin", *SELECT)
    result.assert_outcomes(skipped=2)
    found = cells(pytester)
    assert {c["verdict"] for c in found.values()} == {"unavailable"}
    assert "triton was imported before TRITON_INTERPRET=1 was set" in found["matmul"]["reason"]
    result.stdout.fnmatch_lines(
        ["*backend triton-nf4: unavailable: triton-nf4: triton was imported before TRITON_INTERPRET=1 was set*"]
    )
