"""Sessions for pytest-qconform.

``nox -s matrix`` merges the committed run reports (``nox -s matrix-screenshot`` photographs its
page for the docs); ``nox -s lint`` runs ruff and mypy;
``nox -s tests`` runs the project's own tests in the current environment; ``nox -s downstream``
installs the example downstream backend into a fresh virtualenv and runs the suites on it (and on its broken twin);
``nox -s bench`` runs the benchmark suite into reports/bench/ and plots it; ``nox -s kernel-calls``
records the Triton warm-up's call log; ``nox -s covering-arrays`` refreshes the packaged covering
arrays; ``nox -s compile-check`` compiles our Triton kernels
for every listed arch and writes the results and docs/kernels-compiled.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nox

# Where things lie in reports/ is pytest_qconform.report.storage's to know. It imports only the
# standard library, so it is imported from this checkout even where nox runs outside the project's
# environment.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from pytest_qconform.report.storage import COMMITTED as REPORTS  # noqa: E402

# The standard library's venv: no extra tool to install, the same as the README's setup; sessions with
# python=False (matrix) create no environment at all.
nox.options.default_venv_backend = "venv"


def _python(session: nox.Session) -> str:
    """The interpreter a session runs: its virtualenv's, or, for sessions without one
    (``python=False``, ``--no-venv``), the one nox itself runs in, so that
    ``.venv/bin/nox -s matrix`` uses ``.venv`` rather than whatever ``python`` PATH finds."""
    return "python" if session.venv_backend not in ("none", None) else sys.executable


@nox.session(python=False)
def matrix(session: nox.Session) -> None:
    """Merge reports/ into reports/MATRIX.md, reports/matrix.png and the browsable page
    reports/site/index.html, and rewrite the README's compact table between its markers (a row
    per backend: the full matrix grows with every cell, so it lives beside the reports).

    Runs in the current environment (pytest-qconform and matplotlib installed): the
    merge reads JSON only. Pass report files or folders to merge others:
    ``nox -s matrix -- path/to/reports``. Inside GitHub Actions it also writes the summary
    to the job's step summary (examples/ci/qconform-self-hosted.yml).

    A run meant for it takes the ``large`` checks beside the rest (``pytest --qconform
    --qconform-large``: the 2^31-element weight on a GPU, docs/running.md "Sizes real runs
    reach"): the merge counts a machine's newest report only, so a ``-m large`` report of the
    same machine would supersede its default run's.
    """
    import os

    summary = ["--step-summary"] if os.environ.get("GITHUB_STEP_SUMMARY") else []
    session.run(
        _python(session),
        "-m",
        "pytest_qconform.matrix.cli",
        *(session.posargs or [str(REPORTS.root)]),
        "--out",
        str(REPORTS.matrix_markdown),
        "--png",
        str(REPORTS.heatmap),
        "--site",
        str(REPORTS.site),
        "--readme",
        "README.md",
        *summary,
    )


# What docs/matrix-page.png shows: bitsandbytes' NF4 blocksize-64 cells on both archs, and the detail of
# a cell that passed in 0.49.2 and is a known failure in 0.50.2 (a regression, with its repro).
SCREENSHOT_VIEW = "#backend=bitsandbytes&format=nf4-b64&cell=bitsandbytes|matmul|nf4-b64-dq|fp16@sm90"


@nox.session(name="matrix-screenshot", python=False)
def matrix_screenshot(session: nox.Session) -> None:
    """Take docs/matrix-page.png of the page ``nox -s matrix`` wrote (reports/site/index.html) in
    headless Chromium (Debian's chromium and chromium-driver, selenium from the dev extra:
    tests/site_browser.py). Run it after ``nox -s matrix`` when the page or the reports change;
    extra arguments replace the view: ``nox -s matrix-screenshot -- '#arch=sm90'``."""
    session.run(
        _python(session),
        "tests/site_browser.py",
        str(REPORTS.site),
        "docs/matrix-page.png",
        *(session.posargs or [SCREENSHOT_VIEW]),
    )


@nox.session(python=False)
def lint(session: nox.Session) -> None:
    """ruff (lint and format check) and mypy, configured in pyproject.toml, in the current
    environment (the dev extra pins them through constraints/cpu.txt). .ci/run runs it first."""
    session.run(_python(session), "-m", "ruff", "check", ".")
    session.run(_python(session), "-m", "ruff", "format", "--check", ".")
    session.run(_python(session), "-m", "mypy")


@nox.session(python=False)
def tests(session: nox.Session) -> None:
    """The project's own tests (plugin, reference, mutant zoo) in the current environment.

    Same as the README's ``python -m pytest -n auto --dist loadfile``; extra arguments go to
    pytest: ``nox -s tests -- -k xdist``.
    """
    session.run(_python(session), "-m", "pytest", "-n", "auto", "--dist", "loadfile", *session.posargs)


@nox.session(name="kernel-sweeps", python=False)
def kernel_sweeps(session: nox.Session) -> None:
    """The sweeps of our Triton kernels' GPU configurations (``kernel_sweep`` tests in
    triton-nf4/tests/test_kernels.py), which the README's test command skips on a CPU: there
    Triton's interpreter takes minutes for them (the root conftest.py). ``.ci/run``
    runs this on every stop. In the current environment; extra arguments go to pytest."""
    session.run(
        _python(session),
        "-m",
        "pytest",
        "triton-nf4/tests/test_kernels.py",
        "-m",
        "kernel_sweep",
        "--kernel-sweeps",
        "-n",
        "auto",
        "-p",
        "no:randomly",
        *session.posargs,
    )


# A suite run that only records (kernel calls, gemlite configs): quiet, no report.
RECORDING_RUN = ("-m", "pytest", "--qconform", "-q", "-p", "no:cacheprovider", "--tb=line", "--qconform-no-report")


@nox.session(name="kernel-calls", python=False)
def kernel_calls(session: nox.Session) -> None:
    """Record the calls a default run makes to our Triton kernels into the packaged log
    that the GPU warm-up replays (triton-nf4/qconform_triton_nf4/warmup.py). Run it on a GPU after
    the suites or the kernels' entry points change: the draws are derandomized, but a CPU
    run gives some size-1 dimensions of x other strides, which Triton keys on (triton-nf4/bench/notes.md
    "Warm-up"). tests/test_triton_warmup.py checks that a replayed log launches the
    recorded run's kernel keys. Runs in the current environment; extra arguments go to pytest
    (``-n 15 --dist worksteal`` on a 16-core GPU runner: each worker's calls are written into
    the one log, qconform_triton_nf4/call_recording.py)."""
    session.run(
        _python(session),
        *RECORDING_RUN,
        "--qconform-warmup-workers=0",
        "--qconform-record-kernel-calls=triton-nf4/qconform_triton_nf4/default_run_kernel_calls.json",
        *session.posargs,
    )


@nox.session(name="covering-arrays", python=False)
def covering_arrays(session: nox.Session) -> None:
    """Record the covering arrays this machine's default and ``thorough`` collections ask
    for into the packaged store the workers read before building one
    (pytest_qconform/cases/covering_store.py, record_covering_arrays.py). Run it after axes.py, covertable or a
    backend's claims change, on a CPU and on a GPU (a GPU's claims ask other questions);
    tests/test_covering_store.py says when it is due."""
    session.run(_python(session), "-m", "pytest_qconform.cases.record_covering_arrays", "write")


@nox.session(name="gemlite-configs", python=False)
def gemlite_configs(session: nox.Session) -> None:
    """Record the configs gemlite's autotune chooses for every key a default run reaches,
    into the file the hqq-gemlite adapter loads on sm90 GPUs
    (pytest_qconform/backends/gemlite_configs.py says why). Run it on an H100 or H200 with
    gemlite installed after the suites' gemlite shapes or the gemlite pin change; extra
    arguments go to pytest (-n 8 spreads the autotuning over processes)."""
    session.run(
        _python(session),
        *RECORDING_RUN,
        "--qconform-backend=hqq-gemlite",
        "--qconform-record-gemlite-configs=pytest_qconform/backends/gemlite_configs_sm90.json",
        *session.posargs,
    )


@nox.session(name="compile-check", python=False)
def compile_check(session: nox.Session) -> None:
    """Compile our Triton kernels for every listed GPU arch on this machine (no GPU needed)
    and write the results (triton-nf4/compiled/compile-check.json), the matrix's section of
    them (reports/sections/triton-nf4.json) and the registers/spills/occupancy table
    (docs/kernels-compiled.md). Run it after the kernels,
    the kernel-call log, the listed archs or the Triton pin change: triton-nf4/tests/test_compile_check.py
    fails (in a second, by fingerprint) until the committed files are this checkout's. .ci/run runs
    this session and fails if it changes them. Extra arguments go to ``python -m qconform_triton_nf4.compile.check``.
    19 min on 2 CPU cores with a cold Triton cache (one process per core; 346 variants per arch
    since the log holds the quantize calls too, 2026-11-26), seconds warm."""
    session.run(
        _python(session),
        "-m",
        "qconform_triton_nf4.compile.check",
        "--json",
        "triton-nf4/compiled/compile-check.json",
        "--section",
        str(REPORTS.sections / "triton-nf4.json"),
        "--doc",
        "docs/kernels-compiled.md",
        *session.posargs,
    )


DOWNSTREAM_ARGS = ("--qconform", "-q", "-p", "no:cacheprovider", "--tb=line")


@nox.session
def downstream(session: nox.Session) -> None:
    """Use pytest-qconform as a downstream project would, in a fresh virtualenv.

    Installs the CPU torch pin, this checkout and ``examples/downstream`` (a plain-PyTorch
    NF4 backend registered only through the ``pytest_qconform.backends`` entry point
    group), then runs the suites on it from a scratch folder outside the repository (so
    no conftest.py or ini file of ours is picked up) and requires every cell of its report
    to pass. Then installs ``examples/downstream/broken`` (the same backend with its
    nibbles swapped in dequantize) and requires the run to fail, with failing dequantize
    cells in its report. Both times it also runs ``examples/downstream/scripts/watch_model.py``,
    a project's own model under ``pytest_qconform.watch`` (exit 0, then 1). About two minutes
    on 2 CPU cores, most of it installing torch.
    """
    import shutil
    import tempfile
    import time
    from pathlib import Path

    started = time.monotonic()
    root = Path(__file__).resolve().parent
    session.install("-c", "constraints/cpu.txt", "torch==2.13.0")
    # the layers extra: the checkpoint suite (safetensors) and the workload suite (transformers, PEFT)
    session.install("-c", "constraints/cpu.txt", "-e", ".[layers]")
    with tempfile.TemporaryDirectory(prefix="qconform-downstream-") as scratch_dir:
        scratch = Path(scratch_dir)
        # Build the examples from a copy: an in-tree build leaves src/*.egg-info behind, which
        # would register their entry points in any process that has examples/downstream/src on
        # sys.path (the project's own tests do).
        example = scratch / "example"
        shutil.copytree(
            root / "examples" / "downstream",
            example,
            ignore=shutil.ignore_patterns("*.egg-info", "build", "__pycache__"),
        )
        good, broken = scratch / "reports-torch-nf4", scratch / "reports-torch-nf4-broken"
        session.install(str(example))
        with session.chdir(scratch):
            session.run("pytest", *DOWNSTREAM_ARGS, "--qconform-backend=torch-nf4", f"--qconform-report-dir={good}")
            session.run(
                "python", "-m", "pytest_qconform", "check", str(good), "--backend", "torch-nf4", "--require", "pass"
            )
            # The project's own model under the call-site oracle (docs/watch.md): passes here...
            watch_script = str(example / "scripts" / "watch_model.py")
            session.run("python", watch_script, "--backend", "torch-nf4")
            session.install(str(example / "broken"))
            # ...and fails on the broken twin, naming the call.
            session.run("python", watch_script, "--backend", "torch-nf4-broken", success_codes=[1])
            # The planted bug must fail the run (exit 1), and fail it in the right place.
            session.run(
                "pytest",
                *DOWNSTREAM_ARGS,
                "--tb=no",
                "--qconform-backend=torch-nf4-broken",
                f"--qconform-report-dir={broken}",
                success_codes=[1],
            )
            session.run(
                "python",
                "-m",
                "pytest_qconform",
                "check",
                str(broken),
                "--backend",
                "torch-nf4-broken",
                "--require",
                "any",
                "--expect-fail",
                "torch-nf4-broken/dequantize",
            )
    session.log(f"downstream: done in {time.monotonic() - started:.0f} s")


@nox.session
def bench(session: nox.Session) -> None:
    """The benchmark suite (``pytest --qconform --benchmark-only``) into reports/bench/, then its plot.

    ``nox -s bench`` makes a fresh virtualenv with the CPU torch pin (constraints/cpu.txt),
    the backends and pytest-benchmark, and times the small shapes
    (``--qconform-bench-shapes=small``: the full ones are too slow on a CPU). On a GPU
    runner, time the torch you installed for the GPU instead, in your environment:
    ``nox -s bench --no-venv --no-install`` (installs nothing; full shapes when torch sees a
    GPU). Extra arguments go to pytest: ``nox -s bench -- --qconform-backend=triton-nf4``.
    Writes ``reports/bench/<arch>-<host>-<time>.json`` (its ``benchmarks``) and
    ``reports/bench/<same stem>-bench.png`` (``REPORTS.bench``: not a matrix input).
    """
    if session.venv_backend != "none":
        session.install("-c", "constraints/cpu.txt", "torch==2.13.0")
        session.install("-c", "constraints/cpu.txt", "-e", ".[backends,bench]", "-e", "./triton-nf4")
    has_gpu = session.run(_python(session), "-c", "import torch; print(int(torch.cuda.is_available()))", silent=True)
    shapes = "full" if str(has_gpu).strip().endswith("1") else "small"
    before = set(REPORTS.bench_reports())
    session.run(
        _python(session),
        "-m",
        "pytest",
        "--qconform",
        "--benchmark-only",
        f"--qconform-bench-shapes={shapes}",
        f"--qconform-report-dir={REPORTS.bench}",
        "-p",
        "no:cacheprovider",
        *session.posargs,
    )
    for report in sorted(set(REPORTS.bench_reports()) - before):
        session.run(_python(session), "-m", "pytest_qconform.benchmark.plot", str(report))
