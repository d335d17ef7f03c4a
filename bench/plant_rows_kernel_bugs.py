"""Plant one bug at a time in the rows kernel (gemv v8) and show that its test catches each.

Every mutant is a one-line edit of ``pytest_qconform/kernels/nf4_gemv.py`` applied to a
copy of the package and its tests in a scratch folder (the working tree is never touched),
where ``tests/test_kernels.py::test_gemv_rows_kernel_configurations`` runs with the copy
first on sys.path (bf16 x, both step sizes; under TRITON_INTERPRET=1 on a CPU). The unmutated copy
must pass and every mutant must fail; the script exits 1 otherwise. Not planted: dropping
the clamp of rows past N. Those rows are never stored, so the bug is an out-of-bounds
read that no output shows; it is a job for compute-sanitizer on a GPU, not for this test.

    .venv/bin/python bench/plant_rows_kernel_bugs.py
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KERNEL = Path("pytest_qconform") / "kernels" / "nf4_gemv.py"
SELECT = "test_gemv_rows_kernel_configurations and bfloat16"

# name -> (text in nf4_gemv.py, its replacement): each the kind of slip the kernel invites.
MUTANTS = {
    "nibble order (low nibble first)": (
        "shifted = words >> (8 * (j // 2) + 4 * (1 - j % 2))", "shifted = words >> (8 * (j // 2) + 4 * (j % 2))"),
    "x halves swapped": (
        "x_value(x_low if j < 4 else x_high, j % 4, X_DTYPE)", "x_value(x_high if j < 4 else x_low, j % 4, X_DTYPE)"),
    "prefetch reads the current step": (
        "at_next = (i_next % steps) * PAIRS", "at_next = (i % steps) * PAIRS"),
    "prefetch keeps the current item": (
        "m_next, rows_next, _ = _rows_of_item(tl.program_id(0) + (i_next // steps) * grid, M, N)",
        "m_next, rows_next, _ = _rows_of_item(tl.program_id(0) + (i // steps) * grid, M, N)"),
    "row 3 stored to row 2": (
        "_store_row(out_row + 3, acc3, bias_ptr, first_row + 3, N, HAS_BIAS, BF16_BITS)",
        "_store_row(out_row + 2, acc3, bias_ptr, first_row + 3, N, HAS_BIAS, BF16_BITS)"),
    "absmax block of the wrong step": (
        "block = (step * WORDS + 2 * p) // WORDS_PER_BLOCK", "block = (2 * p) // WORDS_PER_BLOCK"),
    "absmax block from the pair index": (
        "block = (step * WORDS + 2 * p) // WORDS_PER_BLOCK", "block = (step * WORDS + p) // WORDS_PER_BLOCK"),
    "x of a pair's two words swapped": (
        "a_low, a_high, b_low, b_high = x", "b_low, b_high, a_low, a_high = x"),
}


def test_passes(mutation: tuple[str, str] | None) -> bool:
    """Run the rows-kernel test against a copy of the package with ``mutation`` applied."""
    with tempfile.TemporaryDirectory() as tmp:
        for folder in ("pytest_qconform", "tests"):
            shutil.copytree(ROOT / folder, Path(tmp) / folder, ignore=shutil.ignore_patterns("__pycache__"))
        if mutation is not None:
            source = (Path(tmp) / KERNEL).read_text()
            old, new = mutation
            if source.count(old) != 1:
                raise RuntimeError(f"the mutation's text is not in {KERNEL} exactly once: {old!r}")
            (Path(tmp) / KERNEL).write_text(source.replace(old, new))
        env = {**os.environ, "PYTHONPATH": f"{tmp}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
               "TRITON_INTERPRET": "1", "PYTHONDONTWRITEBYTECODE": "1"}
        args = [sys.executable, "-m", "pytest", "-q", "--tb=no", "-p", "no:cacheprovider", "-o", "addopts=",
                "tests/test_kernels.py", "-k", SELECT]
        proc = subprocess.run(args, cwd=tmp, env=env, capture_output=True, text=True, timeout=900)
        if proc.returncode not in (0, 1) or " passed" not in proc.stdout and " failed" not in proc.stdout:
            raise RuntimeError(f"pytest exited {proc.returncode}:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
        return proc.returncode == 0


def main() -> int:
    if not test_passes(None):
        print("the unmutated kernel fails its test: the mutants mean nothing", file=sys.stderr)
        return 1
    print("| planted bug | caught |\n| --- | --- |")
    missed = 0
    for name, mutation in MUTANTS.items():
        caught = not test_passes(mutation)
        missed += not caught
        print(f"| {name} | {'yes' if caught else 'NO'} |", flush=True)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
