"""Proof that every conformance check can fail: the suites against the mutant zoo.

Five runs of the real suites, with the correct plain-PyTorch backends (NF4, and a CPU
stand-in for hqq-gemlite: HQQ's layer in gemlite's converted layout) and the mutants
registered through the ``pytest_qconform_backends`` hook: the original suites against
the mutants of their classes; the suites of issue 18 (inputs users have: every
blocksize, layouts, storage, parameters, value ranges, layer shapes), the layer suites
of issue 19 (forward modes, state, checkpoints, moves, models in sequence), and the
compiled and captured paths and the lifecycle sequences of issue 26, the workloads of
issue 36, and the multi-device (two GPUs) and distributed (two gloo ranks) suites of issue
37, each against the mutants whose ``suites`` name them. The run reports say, per backend and operation, what
the suites concluded. Each mutant must fail the operation whose check targets its bug
class, and each correct backend must pass all of every run; a mutant of a setting users pass
(issue 51: ``SETTING_MUTANTS``) must also pass every check when the setting's axis is held at
its default, so that the axis is what catches it; the mutants of sizes real runs reach (issue 51:
``SIZE_MUTANTS``, run against the rows ladder and the 65536-row call at K = 14336 with
``--qconform-large``) must pass the matmul suite without them. A mutant whose class needs a
GPU (``needs_gpu``: CUDA graphs, a check whose float64 activation a CPU does not hold) is
left out of a run without one, and its test skips saying so.
"""

from __future__ import annotations

import json
import os
import textwrap
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from zoo import (
    BAD_DATA_SUITES,
    DISTRIBUTED_SUITES,
    KERNEL_MUTANTS,
    KERNEL_SUITES,
    LAYER_SUITES,
    LIBRARY_MUTANTS,
    LIFECYCLE_SUITES,
    LOOP_SUITES,
    MULTI_GPU_SUITES,
    MUTANTS,
    PATH_SUITES,
    PROVENANCE_SUITES,
    SETTING_MUTANTS,
    SIZE_MUTANTS,
    SIZE_SUITES,
    TC_ROUTE_MUTANTS,
    TC_ROUTE_SUITES,
    USER_INPUT_SUITES,
    WORKLOAD_SUITES,
    WS_ROUTE_MUTANTS,
    TritonTcRoute,
    TritonWsRoute,
)

# The zoo's runs beside the original suites': each runs these suites against the mutants of
# their classes (the mutants whose ``suites`` name them).
GROUPS = {
    "user-input": USER_INPUT_SUITES,
    "layers": LAYER_SUITES,
    "paths": PATH_SUITES,
    "lifecycle": LIFECYCLE_SUITES,
    "workloads": WORKLOAD_SUITES,
    "multi-gpu": MULTI_GPU_SUITES,
    "distributed": DISTRIBUTED_SUITES,
    "bad-data": BAD_DATA_SUITES,
    "provenance": PROVENANCE_SUITES,  # issue 50, item 1
    "loops": LOOP_SUITES,  # issue 51, item 1
    "sizes": SIZE_SUITES,  # issue 51, item 3
}


def _group(mutant) -> str:
    """The run a mutant belongs to: ``original`` or the label of the suites it names."""
    suites = getattr(mutant, "suites", None)
    return "original" if suites is None else next(label for label, group in GROUPS.items() if group == suites)


GPU = torch.cuda.is_available()
GPUS = torch.cuda.device_count()
# Whether a group's checks run on this machine: the multi-device suite needs two GPUs; the
# distributed one two ranks (gloo on a CPU, NCCL on two GPUs: on a one-GPU host it skips).
GROUP_RUNS_HERE = {"multi-gpu": GPUS >= 2, "distributed": not GPU or GPUS >= 2}
# Mutants whose class only a GPU can show (CUDA graphs), or only two (``needs_gpus``), or whose
# group does not run here: left out of the run.
RUN_MUTANTS = tuple(
    m
    for m in MUTANTS
    if (GPU or not getattr(m, "needs_gpu", False))
    and GPUS >= getattr(m, "needs_gpus", 0)
    and GROUP_RUNS_HERE.get(_group(m), True)
)

# The correct backends, each in every run: the NF4 base of most mutants, and the CPU stand-in
# for hqq-gemlite (HQQ's layer in gemlite's converted layout) under the gemlite mutants.
CORRECT = ("torch-nf4-correct", "torch-gemlite4-correct")
# A mutant runs only the checks of its class (the operation it ``catches``): the one its test
# reads. Its other instances judge nothing the zoo asks, and ran most of the zoo's time. And
# once one of them fails in a process, the mutant is caught: its later instances there skip
# (they cannot take the fail out of its verdicts, and were 137 of the original run's 150 s
# of tests, the correct backends' 13). The correct backends run every check of every run.
CONFTEST = textwrap.dedent("""
    import pytest
    from qconform_example_nf4.backend import TorchNF4Backend
    from torch_gemlite4 import TorchGemlite4Backend
    from zoo import MUTANTS, CorrectTorchNF4, narrowed
    from pytest_qconform.session.outcomes import case_key_of

    CATCHES = {m.name: m.catches for m in MUTANTS}

    # Skips a mutant's instances once one has failed in this process. A plugin: a conftest's
    # test hooks apply only to the tests under its folder, and the suites are not.
    class CaughtMutantsStop:
        def __init__(self):
            self.caught = set()

        @pytest.hookimpl(tryfirst=True)
        def pytest_runtest_setup(self, item):
            key = case_key_of(item)
            if key is not None and key.backend in self.caught:
                pytest.skip(f"zoo: {key.backend} already failed a check of its class in this process")

        def pytest_runtest_logreport(self, report):
            key = case_key_of(report)
            if report.failed and key is not None and key.backend in CATCHES:
                self.caught.add(key.backend)

    def pytest_configure(config):
        config.pluginmanager.register(CaughtMutantsStop(), "zoo-caught-mutants-stop")

    def pytest_qconform_backends(config):
        correct = CorrectTorchNF4
        gemlite = type("CorrectGemlite", (TorchGemlite4Backend,), {"name": "torch-gemlite4-correct"})
        return {m.name: narrowed(m) for m in (correct, gemlite, *MUTANTS)}

    @pytest.hookimpl(trylast=True)
    def pytest_collection_modifyitems(config, items):
        def outside_its_class(item):
            key = case_key_of(item)
            return key is not None and key.backend in CATCHES and key.operation != CATCHES[key.backend]

        drop = [item for item in items if outside_its_class(item)]
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = [item for item in items if not outside_its_class(item)]
""")


def _run_zoo(root, names: list[str], keyword: str, *extra: str) -> dict:
    import os
    import subprocess
    import sys
    from pathlib import Path

    tests_dir = Path(__file__).parent
    example = tests_dir.parent / "examples" / "downstream" / "src"
    out = root / "out"
    args = [
        sys.executable,
        "-m",
        "pytest",
        "--qconform",
        "-p",
        "no:cacheprovider",
        "-q",
        "--tb=no",
        f"--qconform-report-dir={out}",
        "-o",
        "addopts=",
        *[f"--qconform-backend={n}" for n in names],
        "-k",
        keyword,
        *extra,
    ]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(tests_dir), str(example), os.environ.get("PYTHONPATH")))),
    }
    proc = subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, timeout=1500)
    reports = list(out.glob("*.json"))
    assert len(reports) == 1, f"no report written:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return json.loads(reports[0].read_text())


# The -m expression a run's suites need (their checks are deselected without it).
GROUP_MARKERS = {"multi-gpu": "multi_gpu", "distributed": "distributed"}
# The tests that judge the correct backends over every run's cells.
WHOLE_ZOO_TESTS = ("test_correct_backend_passes_every_check", "test_every_claimed_axis_value_is_checked")


# The options a run's suites need: the rows ladder's top is large on a CPU (opt-in).
GROUP_OPTIONS = {"sizes": ("--qconform-large",)}


def _markers(label: str) -> tuple[str, ...]:
    """The ``-m`` a run's suites need (their checks are deselected without it), and their options."""
    return (("-m", GROUP_MARKERS[label]) if label in GROUP_MARKERS else ()) + GROUP_OPTIONS.get(label, ())


def _keyword(label: str) -> str:
    """The ``-k`` expression of a run's suites."""
    if label == "original":
        return "not (" + " or ".join(name for suites in GROUPS.values() for name in suites) + ")"
    return " or ".join(GROUPS[label])


@pytest.fixture(scope="module")
def zoo_report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """Run the suites against the zoo (module scope: the runs are the expensive part),
    the runs' cells in one report. Each selected mutant runs in its group's run, beside the
    correct backends; a selection without the correct backends' tests (``-k`` on a
    mutant's name) runs only its mutants' groups and only those mutants, so one mutant is
    checked in minutes. The whole module runs every group with every mutant."""
    selected = [item for item in request.session.items if item.module is request.module]
    whole = any(item.originalname in WHOLE_ZOO_TESTS for item in selected)
    chosen = {
        item.callspec.params["mutant"]
        for item in selected
        if item.originalname == "test_mutant_is_caught_by_its_check" and hasattr(item, "callspec")
    }
    labels = ["original", *GROUPS]
    runs = []
    for label in labels:
        if not GROUP_RUNS_HERE.get(label, True):
            continue  # its checks cannot run here; its mutants are left out (RUN_MUTANTS) and skip saying so
        names = [m.name for m in RUN_MUTANTS if _group(m) == label and m in chosen]
        if names or whole:
            runs.append((label, names))
    roots = []
    for label, _ in runs:
        roots.append(tmp_path_factory.mktemp(f"zoo-{label}"))
        (roots[-1] / "conftest.py").write_text(CONFTEST)
    # The runs are independent processes: side by side, one per core (they were the longest
    # setup of the project's tests, one after another); merged in the runs' order as before.
    # The original suites' run is most of the work: on two cores or more it spreads its tests
    # over two pytest-xdist workers (the report is the serial run's, tests/test_xdist.py).
    cores = os.cpu_count() or 1

    def run(root, label: str, names: list[str]) -> dict:
        spread = ("-n", "2") if label == "original" and cores >= 2 else ()
        return _run_zoo(root, [*CORRECT, *names], _keyword(label), *_markers(label), *spread)

    with ThreadPoolExecutor(max_workers=max(1, min(len(runs), cores))) as pool:
        reports = list(pool.map(lambda found: run(found[0], *found[1]), zip(roots, runs)))
    cells, coverage = [], []
    for report in reports:
        cells += report["cells"]
        coverage += _merged_by_operation(report.get("coverage", []), coverage)
    return {"cells": cells, "coverage": coverage}


def _merged_by_operation(new: list[dict], earlier: list[dict]) -> list[dict]:
    """``new`` coverage entries, with an operation that an earlier run also covered merged
    into that entry in place (the runs split one operation's checks between them)."""
    index = {(e["backend"], e["operation"]): e for e in earlier}
    added = []
    for entry in new:
        old = index.get((entry["backend"], entry["operation"]))
        if old is None:
            added.append(entry)
            continue
        for key in ("values", "claimed"):
            for axis, found in entry[key].items():
                old[key][axis] = sorted(set(old[key].get(axis, [])) | set(found))
        old["unchecked"] = {
            axis: [v for v in found if v not in old["values"].get(axis, [])] for axis, found in old["claimed"].items()
        }
        old["unchecked"] = {axis: found for axis, found in old["unchecked"].items() if found}
    return added


def _verdicts(report: dict, backend: str) -> dict[str, set[str]]:
    by_operation: dict[str, set[str]] = {}
    for cell in report["cells"]:
        if cell["backend"] == backend:
            by_operation.setdefault(cell["operation"], set()).add(cell["verdict"])
    return by_operation


# The operations each correct backend must have computed cells of (the gemlite stand-in
# claims no dequantize, backward, serialization or layer, as gemlite's converted layer).
EXPECTED_OPERATIONS = {
    "torch-nf4-correct": {
        "quantize",
        "dequantize",
        "matmul",
        "matmul-fp32-input",
        "backward",
        "sequencing",
        "interop",
        "quantize-layout",
        "storage",
        "parameters",
        "value-range",
        "real-shapes",
        "layer-quantize",
        "layer-forward",
        "layer-state",
        "checkpoint",
        "device-move",
        "layer-sequencing",
        "compiled",
        "lifecycle",
        "workload:generate",
        "workload:serving",
        "provenance",
        "nonfinite-quantize",
        "row-isolation",
        "corrupt-checkpoint",
        "workload:loop",
    }
    | ({"distributed:ddp", "distributed:fsdp"} if GROUP_RUNS_HERE["distributed"] else set())
    | ({"captured", "workload:compiled", "workload:captured"} if GPU else set())
    | (
        {"multi-gpu:quantize", "multi-gpu:dequantize", "multi-gpu:matmul", "multi-gpu:backward"} if GPUS >= 2 else set()
    ),
    "torch-gemlite4-correct": {"quantize", "matmul", "matmul-fp32-input", "parameters"},
}


@pytest.mark.parametrize("correct", CORRECT)
def test_correct_backend_passes_every_check(zoo_report: dict, correct: str) -> None:
    verdicts = _verdicts(zoo_report, correct)
    assert verdicts, f"{correct} produced no cells"
    failing = {op: v for op, v in verdicts.items() if v - {"pass", "not-claimed"}}
    assert not failing, f"{correct} did not pass: {failing}"
    assert EXPECTED_OPERATIONS[correct] <= {op for op, v in verdicts.items() if "pass" in v}, verdicts


@pytest.mark.parametrize("correct", CORRECT)
def test_every_claimed_axis_value_is_checked(zoo_report: dict, correct: str) -> None:
    """The default profile checks every value a correct backend claims on every axis a
    check declares (the covering arrays come from the claims; a skip or a narrowed
    selection would leave a value unchecked, and the report's coverage says which)."""
    coverage = [entry for entry in zoo_report["coverage"] if entry["backend"] == correct]
    assert coverage, f"the report records no coverage for {correct}"
    unchecked = {entry["operation"]: entry["unchecked"] for entry in coverage if entry["unchecked"]}
    assert not unchecked, f"claimed axis values no check ran on, per operation: {unchecked}"


@pytest.mark.parametrize("mutant", MUTANTS, ids=lambda m: m.name)
def test_mutant_is_caught_by_its_check(zoo_report: dict, mutant) -> None:
    if mutant not in RUN_MUTANTS:
        pytest.skip(f"{mutant.name}: its class ({mutant.catches}) cannot run on this machine ({GPUS} GPU(s))")
    verdicts = _verdicts(zoo_report, mutant.name)
    assert "fail" in verdicts.get(mutant.catches, set()), (
        f"{mutant.name} ({mutant.__doc__.strip().splitlines()[0]}) was not caught by the "
        f"{mutant.catches} suite: {verdicts}"
    )


# Measured by bench/sensitivity.py (bench/results/sensitivity-cpu.json, docs/sensitivity.md):
# the smallest systematic relative matmul error the ci profile catches, per dtype.
SMALLEST_CAUGHT_EPS = {"bf16": 2.0**-8, "fp16": 2.0**-10, "fp32": 2.0**-18}


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
        "    return {ScaledMatmul.name: ScaledMatmul}\n"
    )
    env = {
        **os.environ,
        "QCONFORM_MUTANT_EPS": json.dumps(SMALLEST_CAUGHT_EPS),
        "PYTHONPATH": os.pathsep.join(
            filter(
                None,
                (
                    str(tests_dir),
                    str(tests_dir.parent / "examples" / "downstream" / "src"),
                    os.environ.get("PYTHONPATH"),
                ),
            )
        ),
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
        "-o",
        "addopts=",
        f"--qconform-report-dir={tmp_path / 'out'}",
        "--qconform-backend=mutant-scaled-matmul",
        "-k",
        # Not where a weight has fewer distinct magnitudes than output columns (2-8 blocks of
        # 16 codes: blocksizes 1024-4096 at these shapes): there the direction check does not
        # apply (suites/test_matmul.py), and the threshold is the bound's (docs/sensitivity.md).
        "test_matmul_matches_reference and nf4 and not -b1024 and not -b2048 and not -b4096",
    ]
    proc = subprocess.run(args, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    report = json.loads(next((tmp_path / "out").glob("*.json")).read_text())
    verdicts: dict[str, set[str]] = {}
    for cell in report["cells"]:
        if cell["operation"] == "matmul":
            verdicts.setdefault(cell["dtype"], set()).add(cell["verdict"])
    assert verdicts == {"bf16": {"fail"}, "fp16": {"fail"}, "fp32": {"fail"}}, (verdicts, proc.stdout[-3000:])


KERNEL_CONFTEST = textwrap.dedent("""
    from zoo import KERNEL_MUTANTS, narrowed

    def pytest_qconform_backends(config):
        return {m.name: narrowed(m) for m in KERNEL_MUTANTS}
""")


@pytest.fixture(scope="module")
def kernel_zoo_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The checks of our kernels' mutants (``KERNEL_SUITES``) against them and the real
    triton-nf4, in one run (on the CPU the kernels run in Triton's interpreter)."""
    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("zoo-kernels")
    (root / "conftest.py").write_text(KERNEL_CONFTEST)
    return _run_zoo(root, ["triton-nf4"] + [m.name for m in KERNEL_MUTANTS], " or ".join(KERNEL_SUITES))


def test_our_kernels_pass_the_checks_their_mutants_fail(kernel_zoo_report: dict) -> None:
    verdicts = _verdicts(kernel_zoo_report, "triton-nf4")
    assert verdicts.get("quantize") == {"pass"}, verdicts


@pytest.mark.parametrize("mutant", KERNEL_MUTANTS, ids=lambda m: m.name)
def test_kernel_mutant_is_caught_by_its_check(kernel_zoo_report: dict, mutant) -> None:
    _assert_caught(kernel_zoo_report, mutant)


def _assert_caught(report: dict, mutant) -> None:
    """``mutant``'s cells of the operation it names (``catches``) include a fail in ``report``."""
    verdicts = _verdicts(report, mutant.name)
    assert "fail" in verdicts.get(mutant.catches, set()), (
        f"{mutant.name} ({mutant.__doc__.strip().splitlines()[0]}) was not caught by the "
        f"{mutant.catches} suite: {verdicts}"
    )


TC_ROUTE_CONFTEST = textwrap.dedent("""
    from qconform_triton_nf4.kernels import nf4_tc_gemm
    from zoo import TC_ROUTE_MUTANTS, TritonTcRoute, narrowed

    def pytest_qconform_backends(config):
        # the route on in Triton's interpreter at sm_90's rows, in this run only
        nf4_tc_gemm.TC_MAX_ROWS["interpreter"] = nf4_tc_gemm.TC_MAX_ROWS["sm90"]
        return {m.name: narrowed(m) for m in (TritonTcRoute, *TC_ROUTE_MUTANTS)}
""")


@pytest.fixture(scope="module")
def tc_route_zoo_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The route check (``TC_ROUTE_SUITES``) against the real triton-nf4 with its tensor-core
    GEMM route on in the interpreter, and against that route's mutants, in one run."""
    pytest.importorskip("triton")
    root = tmp_path_factory.mktemp("zoo-tc-route")
    (root / "conftest.py").write_text(TC_ROUTE_CONFTEST)
    names = [TritonTcRoute.name] + [m.name for m in TC_ROUTE_MUTANTS]
    return _run_zoo(root, names, " or ".join(TC_ROUTE_SUITES))


def test_the_tc_route_passes_the_check_its_mutants_fail(tc_route_zoo_report: dict) -> None:
    verdicts = _verdicts(tc_route_zoo_report, TritonTcRoute.name)
    assert verdicts.get("matmul") == {"pass"}, verdicts


@pytest.mark.parametrize("mutant", TC_ROUTE_MUTANTS, ids=lambda m: m.name)
def test_tc_route_mutant_is_caught_by_its_check(tc_route_zoo_report: dict, mutant) -> None:
    _assert_caught(tc_route_zoo_report, mutant)


WS_ROUTE_CONFTEST = textwrap.dedent("""
    from zoo import WS_ROUTE_MUTANTS, TritonWsRoute, narrowed

    def pytest_qconform_backends(config):
        return {m.name: narrowed(m) for m in (TritonWsRoute, *WS_ROUTE_MUTANTS)}
""")


@pytest.fixture(scope="module")
def ws_route_zoo_report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The route check (``TC_ROUTE_SUITES``) on an sm_90 GPU against the real triton-nf4,
    whose route there takes the warp-specialized GEMM, and against that route's mutants."""
    pytest.importorskip("triton")
    from qconform_triton_nf4.kernels import nf4_ws_gemm

    if not (GPU and nf4_ws_gemm.runs_on(torch.device("cuda"))):
        pytest.skip("the warp-specialized GEMM runs on sm_90 GPUs only (Gluon: no interpreter)")
    root = tmp_path_factory.mktemp("zoo-ws-route")
    (root / "conftest.py").write_text(WS_ROUTE_CONFTEST)
    names = [TritonWsRoute.name] + [m.name for m in WS_ROUTE_MUTANTS]
    return _run_zoo(root, names, " or ".join(TC_ROUTE_SUITES))


def test_the_ws_route_passes_the_check_its_mutants_fail(ws_route_zoo_report: dict) -> None:
    verdicts = _verdicts(ws_route_zoo_report, TritonWsRoute.name)
    assert verdicts.get("matmul") == {"pass"}, verdicts


@pytest.mark.parametrize("mutant", WS_ROUTE_MUTANTS, ids=lambda m: m.name)
def test_ws_route_mutant_is_caught_by_its_check(ws_route_zoo_report: dict, mutant) -> None:
    _assert_caught(ws_route_zoo_report, mutant)


# -- bugs planted in the libraries (issue 36): one run each, the real backend under the mutant's name --

LIBRARY_CONFTEST = """
from zoo import LIBRARY_MUTANTS

MUTANT = {name!r}

def pytest_qconform_backends(config):
    mutant = next(m for m in LIBRARY_MUTANTS if m.name == MUTANT)
    mutant.plant()
    return {{mutant.name: mutant.backend()}}
"""


@pytest.mark.parametrize("mutant", LIBRARY_MUTANTS, ids=lambda m: m.name)
def test_library_mutant_is_caught_by_its_workload(tmp_path, mutant) -> None:
    """The planted library bug fails its workload's cell, for that bug (the failure matches
    ``mutant.expect``): the instances selected are ones the unpatched backend passes here
    (the main job runs them)."""
    import re

    pytest.importorskip("peft")
    if getattr(mutant, "needs_gpu", False) and not GPU:
        pytest.skip(f"{mutant.name} plants its bug into a GPU-only library: needs a GPU")
    (tmp_path / "conftest.py").write_text(LIBRARY_CONFTEST.format(name=mutant.name))
    report = _run_zoo(tmp_path, [mutant.name], mutant.selection, f"--qconform-profile={mutant.profile}")
    cells = [c for c in report["cells"] if c["backend"] == mutant.name and c["operation"] == mutant.catches]
    failed = [c for c in cells if c["verdict"] == "fail"]
    assert failed, (
        f"{mutant.name} was not caught by {mutant.catches}: {[(c['operation'], c['verdict']) for c in report['cells']]}"
    )
    messages = [c["first_failure"]["message"] for c in failed]
    assert any(re.search(mutant.expect, m) for m in messages), f"{mutant.name} failed for another reason: {messages}"


# -- issue 51, item 2: a setting's bug is caught by its axis, and missed without it --------------------------------

SETTING_CONFTEST = textwrap.dedent("""
    from zoo import SETTING_MUTANTS, CorrectTorchNF4, narrowed

    MUTANT = {name!r}

    def pytest_qconform_backends(config):
        mutant = next(m for m in SETTING_MUTANTS if m.name == MUTANT)
        return {{m.name: narrowed(m) for m in (CorrectTorchNF4, mutant)}}
""")


@pytest.mark.parametrize("mutant", SETTING_MUTANTS, ids=lambda m: m.name)
def test_setting_mutant_is_missed_with_its_axis_at_the_default(tmp_path, mutant) -> None:
    """The other half of ``test_mutant_is_caught_by_its_check`` for a setting's bug: the checks
    that took the setting before it was an axis of the route check (``mutant.missed_by``: the
    storage or parameter suite, at their fixed rows) and the route check with the setting held
    at its default value (``mutant.held_at_default`` drops the route check's instances of the
    other values) pass the mutant, every cell; only the axis catches it."""
    (tmp_path / "conftest.py").write_text(SETTING_CONFTEST.format(name=mutant.name))
    report = _run_zoo(tmp_path, [CORRECT[0], mutant.name], mutant.held_at_default)
    verdicts = _verdicts(report, mutant.name)
    assert set(mutant.missed_by) <= {op for op, found in verdicts.items() if "pass" in found}, verdicts
    assert all(found <= {"pass", "not-claimed"} for found in verdicts.values()), (
        f"{mutant.name} was caught without its axis: {verdicts}"
    )
    assert _verdicts(report, CORRECT[0]), "the correct backend ran no check"


# -- issue 51, item 3: a size's bug is caught by the rows ladder, and missed without it ------------------------------

# The matmul suite without the rows ladder: the declared routes (``test_matmul_every_route``), the drawn
# and listed rows of the matmul checks, K = 14336 (large on a CPU: not run here). Not the lm_head widths:
# their rows are at most 128 (fixed), and each instance there costs seconds. And the backward suite's main
# check (its drawn rows and shapes), for the gradient's mutant.
SIZE_MISSED_WITHOUT = "(test_matmul.py and not rows_ladder and not lm_head_widths) or test_gradients_match_reference"
SIZE_CONFTEST = textwrap.dedent("""
    from zoo import SIZE_MUTANTS, narrowed

    def pytest_qconform_backends(config):
        return {m.name: narrowed(m) for m in SIZE_MUTANTS}
""")


def test_size_mutants_are_missed_without_the_ladder(tmp_path) -> None:
    """The other half of ``test_mutant_is_caught_by_its_check`` for the sizes' bugs (a tier
    at undeclared row counts, a grid dimension capped at 65535, offsets exact only up to
    2^24, a split-K tier past 2^29 activation elements): the matmul suite without the rows
    ladder and the large checks (and the backward suite's main check) passes every one, every
    cell; only the ladder's rungs catch the first three (its 2049 and 4095, its 65536 and
    65537), and only the 65536-row call at K = 14336 the two tiers past 2^29 activation
    elements, forward and backward (GPU checks: ``needs_gpu``; the ladder's top, 65537 x 256,
    is 58 times below the tier)."""
    (tmp_path / "conftest.py").write_text(SIZE_CONFTEST)
    report = _run_zoo(tmp_path, [m.name for m in SIZE_MUTANTS], SIZE_MISSED_WITHOUT)
    for mutant in SIZE_MUTANTS:
        verdicts = _verdicts(report, mutant.name)
        assert verdicts.get(mutant.catches) == {"pass"}, f"{mutant.name} was caught without the ladder: {verdicts}"
