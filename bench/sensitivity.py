"""Measure the smallest systematic relative matmul error the matmul suite detects.

For each dtype, the real ``test_matmul_matches_reference`` runs (default ``ci`` profile,
NF4 blocksize 64, no double quant, one cell per dtype) against ``mutant-scaled-matmul``, whose output is
the correct one times ``1 + eps``; eps halves from 2**-1 down until the suite passes.
The last eps that still fails is the detection threshold. Writes a Markdown table to
stdout and JSON to the path given (default ``bench/results/sensitivity-cpu.json``).

    .venv/bin/python bench/sensitivity.py [OUT.json]
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CONFTEST = (
    "from zoo import ScaledMatmul\n"
    "def pytest_qconform_backends(config):\n"
    "    return {ScaledMatmul.name: ScaledMatmul}\n"
)


def suite_fails(dtype: str, eps: float, workdir: Path) -> bool:
    env = {
        **os.environ,
        "QCONFORM_MUTANT_EPS": repr(eps),
        "PYTHONPATH": f"{ROOT / 'tests'}:{ROOT / 'examples' / 'downstream' / 'src'}",
    }
    args = [
        sys.executable,
        "-m",
        "pytest",
        "--qconform",
        "-q",
        "--tb=no",
        "-p",
        "no:cacheprovider",
        "--qconform-no-report",
        "-o",
        "addopts=",
        "--qconform-backend=mutant-scaled-matmul",
        f"--qconform-dtype={dtype}",
        "-k",
        "test_matmul_matches_reference and nf4-b64 and not dq",
    ]
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode not in (0, 1):
        raise RuntimeError(f"pytest exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    if " passed" not in proc.stdout and " failed" not in proc.stdout:
        raise RuntimeError(f"nothing ran for {dtype}:\n{proc.stdout[-2000:]}")
    return proc.returncode == 1


def main() -> None:
    out = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "bench" / "results" / "sensitivity-cpu.json"
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "conftest.py").write_text(CONFTEST)
        for dtype in ("bf16", "fp16", "fp32"):
            if suite_fails(dtype, 0.0, Path(tmp)):
                raise RuntimeError(f"the correct output (eps 0) fails for {dtype}: the sweep means nothing")
            caught, exponent = None, 1
            while exponent < 40 and suite_fails(dtype, 2.0**-exponent, Path(tmp)):
                caught, exponent = exponent, exponent + 1
            results[dtype] = {
                "smallest_caught_eps": None if caught is None else 2.0**-caught,
                "largest_missed_eps": 2.0**-exponent,
            }
            print(f"{dtype}: caught 2**-{caught}, missed 2**-{exponent}", file=sys.stderr)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2, sort_keys=True) + "\n")
    print("| dtype | smallest systematic relative error caught | largest missed |")
    print("| --- | --- | --- |")
    for dtype, r in results.items():
        print(f"| {dtype} | {r['smallest_caught_eps']:.3g} | {r['largest_missed_eps']:.3g} |")


if __name__ == "__main__":
    main()
