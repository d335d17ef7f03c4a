"""pytest-xdist: ``pytest --qconform -n 2`` gives the same matrix as a serial run.

Workers compute; only the controller records and writes the report, from the test
reports the workers send it (the cell key and error multiples travel in
``user_properties``). Also the pure choice of GPU per worker on a multi-GPU host.
"""

from __future__ import annotations

import json
import types

import pytest
import torch
from fake_backend import FAKE_BACKEND

from pytest_qconform.hardware.probe import Probe
from pytest_qconform.hardware.targets import device_target, worker_device_index

pytest.importorskip("xdist")

# Several cells, several cases per cell, every verdict the recorder folds: pass, fail,
# known-failure, skipped, unavailable (the "missing" backend), and "not claimed" cases
# that leave no cell. Error multiples are recorded at call time, on the worker.
SUITE = """
import pytest
import torch

from pytest_qconform.backends.base import QuantSpec

SPECS = [QuantSpec("nf4", 64), QuantSpec("nf4", 128), QuantSpec("fp4", 64), QuantSpec("fp4", 128, True)]
DTYPES = [torch.float32, torch.bfloat16]


@pytest.mark.qconform_operation("dequantize")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
@pytest.mark.parametrize("case", range(3))
def test_dequantize_cases(qtarget, qbackend, request, spec, dtype, case):
    request.node.user_properties.append(("qconform_multiple", 0.125 * (case + 1) * spec.blocksize / 64))
    if spec.format == "fp4" and dtype is torch.bfloat16:
        pytest.skip("not claimed: fake does not claim fp4 into bf16")
    if spec.double_quant:
        pytest.xfail("known failure: planted for the xdist test")
    if spec.blocksize == 128 and dtype is torch.bfloat16 and case == 2:
        raise AssertionError("planted failure in one case of nf4-b128/bf16")
    if spec.format == "fp4" and case == 1:
        pytest.skip("planted plain skip")


@pytest.mark.qconform_operation("matmul")
@pytest.mark.parametrize("spec", SPECS[:2], ids=lambda s: s.label())
@pytest.mark.parametrize("case", range(4))
def test_matmul_cases(qtarget, qbackend, request, spec, case):
    request.node.user_properties.append(("qconform_multiple", 0.5 + case / 8))
    assert not (spec.blocksize == 64 and case == 3), "planted matmul failure"
"""

ARGS = ("--qconform", "--qconform-backend=fake", "--qconform-backend=missing", "-p", "no:cacheprovider")

# The fake of this suite claims what its tests are parametrized over (an unclaimed
# spec or dtype would be left out at collection, never reaching the workers).
WIDE_FAKE = (
    FAKE_BACKEND
    + """
class WideFake(FakeBackend):
    def capabilities(self, device):
        return Capabilities(("nf4", "fp4"), (64, 128), True, (torch.float32, torch.bfloat16), ("cpu",))

class MissingBackend(FakeBackend):
    name = "missing"

    def availability(self):
        return Availability(False, None, "missinglib: import failed: ModuleNotFoundError")

def pytest_qconform_backends(config):
    return {"fake": WideFake, "missing": MissingBackend}
"""
)


def _run(pytester: pytest.Pytester, out: str, *extra: str) -> tuple[pytest.RunResult, dict]:
    # xdist needs a subprocess (its workers are processes); the serial run is in process, which is faster.
    run = pytester.runpytest_subprocess if "-n" in extra else pytester.runpytest_inprocess
    result = run(str(pytester.path / "test_suite.py"), *ARGS, f"--qconform-report-dir={out}", *extra)
    reports = sorted((pytester.path / out).glob("*.json"))
    assert len(reports) == 1, (
        f"expected the one report of the controller in {out}, found "
        f"{[p.name for p in reports]}:\n{result.stdout.str()[-3000:]}"
    )
    return result, json.loads(reports[0].read_text())


def test_two_workers_give_the_serial_matrix(fake_backend_project: pytest.Pytester) -> None:
    fake_backend_project.makeconftest(WIDE_FAKE)
    fake_backend_project.makepyfile(test_suite=SUITE)
    serial, serial_report = _run(fake_backend_project, "serial")
    parallel, parallel_report = _run(fake_backend_project, "parallel", "-n", "2")

    assert serial.ret == parallel.ret == pytest.ExitCode.TESTS_FAILED
    parallel.stdout.fnmatch_lines(["*2 workers*"])  # it really ran on xdist workers
    # Outcomes, not warnings: the in-process serial run can warn that pytest_qconform was
    # imported before its assertions could be rewritten (when this test runs alone).
    outcomes = [{k: v for k, v in run.parseoutcomes().items() if k != "warnings"} for run in (serial, parallel)]
    assert outcomes[0] == outcomes[1]
    assert parallel_report["cells"] == serial_report["cells"]
    assert parallel_report["probe"]["backends"] == serial_report["probe"]["backends"]

    verdicts = {(c["backend"], c["operation"], c["format"], c["dtype"]): c["verdict"] for c in serial_report["cells"]}
    assert verdicts == {
        ("fake", "dequantize", "nf4-b64", "fp32"): "pass",
        ("fake", "dequantize", "nf4-b64", "bf16"): "pass",
        ("fake", "dequantize", "nf4-b128", "fp32"): "pass",
        ("fake", "dequantize", "nf4-b128", "bf16"): "fail",
        ("fake", "dequantize", "fp4-b64", "fp32"): "pass",
        ("fake", "dequantize", "fp4-b128-dq", "fp32"): "known-failure",
        ("fake", "matmul", "nf4-b64", "-"): "fail",
        ("fake", "matmul", "nf4-b128", "-"): "pass",
        **{
            ("missing", op, fmt, dtype): "unavailable"
            for op, fmt, dtype in [
                ("dequantize", f, d)
                for f in ("nf4-b64", "nf4-b128", "fp4-b64", "fp4-b128-dq")
                for d in ("fp32", "bf16")
            ]
            + [("matmul", "nf4-b64", "-"), ("matmul", "nf4-b128", "-")]
        },
    }
    by_key = {(c["backend"], c["operation"], c["format"], c["dtype"]): c for c in parallel_report["cells"]}
    # Multiples recorded on the workers at call time reached the controller's report.
    assert by_key[("fake", "matmul", "nf4-b128", "-")]["worst_error_multiple"] == 0.875
    assert by_key[("fake", "dequantize", "nf4-b128", "fp32")]["worst_error_multiple"] == 0.75
    assert by_key[("fake", "dequantize", "nf4-b128", "fp32")]["cases"] == 3
    failure = by_key[("fake", "dequantize", "nf4-b128", "bf16")]["first_failure"]
    assert "planted failure in one case" in failure["message"]
    assert "test_dequantize_cases" in failure["repro"]


@pytest.mark.parametrize(
    "worker, device_count, index",
    [
        (None, 4, 0),
        ("", 2, 0),
        ("gw0", 2, 0),
        ("gw1", 2, 1),
        ("gw2", 2, 0),
        ("gw5", 2, 1),
        ("gw7", 8, 7),
        ("gw9", 8, 1),
        ("gw3", 1, 0),
    ],
)
def test_worker_uses_gpu_n_mod_device_count(worker: str | None, device_count: int, index: int) -> None:
    assert worker_device_index(worker, device_count) == index


@pytest.mark.parametrize(
    "worker, device_count, message",
    [
        ("master", 2, "not a pytest-xdist worker id like 'gw3'"),
        ("gw1", 0, "device_count must be >= 1, got 0"),
    ],
)
def test_worker_device_index_rejects_nonsense(worker: str, device_count: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        worker_device_index(worker, device_count)


def _cuda_probe(simulated: bool = False) -> Probe:
    return Probe("cuda", "sm90", "hopper", "NVIDIA H100", "host", "2.13.0", "12.8", None, True, 64, simulated=simulated)


def test_device_target_follows_the_xdist_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    current: list[int] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "set_device", current.append)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert device_target(_cuda_probe()).torch_device == "cuda:1"
    monkeypatch.delenv("PYTEST_XDIST_WORKER")
    assert device_target(_cuda_probe()).torch_device == "cuda:0"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    assert device_target(_cuda_probe(simulated=True)).torch_device is None
    # The chosen GPU is made current: Triton launches on the current device.
    assert current == [1, 0]


@pytest.mark.parametrize(
    "worker, environment, threads, compile_threads",
    [
        ({"workercount": 2}, {}, 2, 1),  # 4 CPUs, 2 workers: 2 threads each
        ({"workercount": 64}, {}, 1, 1),  # at least one thread
        (None, {}, 4, 16),  # the controller, or a run without workers: untouched
        ({"workercount": 2}, {"OMP_NUM_THREADS": "3", "TORCHINDUCTOR_COMPILE_THREADS": "4"}, 4, 16),
    ],
    ids=["worker", "many-workers", "controller-or-serial", "told-by-environment"],
)
def test_xdist_workers_share_the_cpus(
    worker: dict | None, environment: dict, threads: int, compile_threads: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each worker computes on its share of the CPUs and compiles in its own process (two
    workers with two threads each made the 2-core run slower than one process; eight
    workers' compile pools on 16 cores could be 136 processes), unless the environment says."""
    import torch._inductor.config as inductor_config

    from pytest_qconform.session import setup

    for name in (setup.THREADS_VARIABLE, setup.COMPILE_THREADS_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(setup.os, "sched_getaffinity", lambda pid: set(range(4)), raising=False)
    config = types.SimpleNamespace(workerinput={"workerid": "gw0", **worker}) if worker else types.SimpleNamespace()
    before = torch.get_num_threads()
    torch.set_num_threads(4)
    try:
        with inductor_config.patch(compile_threads=16):  # inductor's own override, undone on exit
            setup._workers_share_the_cpus(config)  # type: ignore[arg-type]
            assert inductor_config.compile_threads == compile_threads
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(before)


def test_the_deselected_instances_line_appears_under_workers(fake_backend_project: pytest.Pytester) -> None:
    """The workers collect and deselect, the controller prints the summary: under ``-n auto``
    the one line of instances not applying here went missing."""
    fake_backend_project.makeconftest(WIDE_FAKE)
    fake_backend_project.makepyfile(
        test_suite="""
import pytest
from pytest_qconform.backends.base import QuantSpec

@pytest.mark.qconform_operation("dequantize")
@pytest.mark.parametrize("spec", [QuantSpec("nf4", 64), QuantSpec("nf4", 256)], ids=lambda s: s.label())
def test_dequantize(qtarget, qbackend, spec):
    pass
"""
    )
    result, _ = _run(fake_backend_project, "out", "-n", "2")
    result.stdout.fnmatch_lines(
        ["qconform: 1 instances not applying here were deselected: 1 not claimed by their backend (fake 1)"]
    )


def test_heavy_checks_run_first(fake_backend_project: pytest.Pytester) -> None:
    """``qconform_heavy`` instances lead the collection, in their own order, the rest keeping
    theirs: pytest-xdist hands out the front first, so no worker ends the run on a compile."""
    fake_backend_project.makeconftest(WIDE_FAKE)
    fake_backend_project.makepyfile(
        test_suite="""
import pytest

@pytest.mark.qconform_operation("dequantize")
def test_a(qtarget, qbackend):
    pass

@pytest.mark.qconform_heavy
@pytest.mark.qconform_operation("matmul")
def test_b_compiles(qtarget, qbackend):
    pass

@pytest.mark.qconform_operation("quantize")
def test_c(qtarget, qbackend):
    pass
"""
    )
    result = fake_backend_project.runpytest_inprocess(
        str(fake_backend_project.path / "test_suite.py"), *ARGS, "--collect-only", "-q"
    )
    names = [line.split("::")[1].split("[")[0] for line in result.outlines if "::" in line]
    assert names == ["test_b_compiles", "test_b_compiles", "test_a", "test_a", "test_c", "test_c"], names


HEAVY_SUITE = """
import os
import pytest

def _note(pytester_dir, name):
    with open(os.path.join(pytester_dir, "workers.txt"), "a") as f:
        f.write(f"{name} {os.environ.get('PYTEST_XDIST_WORKER', 'main')}\\n")

@pytest.mark.qconform_operation("dequantize")
@pytest.mark.parametrize("case", range(12))
def test_light(qtarget, qbackend, case):
    pass

@pytest.mark.qconform_heavy
@pytest.mark.qconform_operation("matmul")
@pytest.mark.parametrize("case", range(2))
def test_heavy(qtarget, qbackend, case):
    _note(os.environ["HEAVY_NOTES"], f"heavy{case}")
"""


def test_heavy_checks_lead_each_workers_share(fake_backend_project: pytest.Pytester, monkeypatch) -> None:
    """Under pytest-xdist each heavy instance heads another worker's first share (a worker
    keeps the head of its share; work is stolen from the tail), so two workers compile side
    by side instead of one after the other. Heavy ones all first put both in gw0's share."""
    fake_backend_project.makeconftest(WIDE_FAKE)
    fake_backend_project.makepyfile(test_suite=HEAVY_SUITE)
    monkeypatch.setenv("HEAVY_NOTES", str(fake_backend_project.path))
    result = fake_backend_project.runpytest_subprocess(
        str(fake_backend_project.path / "test_suite.py"),
        "--qconform",
        "--qconform-backend=fake",
        "-p",
        "no:cacheprovider",
        "--qconform-no-report",
        "-n",
        "2",
        "--dist",
        "worksteal",
    )
    result.assert_outcomes(passed=14)
    workers = dict(line.split() for line in (fake_backend_project.path / "workers.txt").read_text().splitlines())
    assert sorted(workers) == ["heavy0", "heavy1"] and workers["heavy0"] != workers["heavy1"], workers


def test_heavy_placement_follows_the_shares() -> None:
    """The k-th heavy item leads share k mod n of pytest-xdist's first hand-out; the others
    keep their order; one process puts them first."""
    from pytest_qconform.session.heavy import first_shares, place_heavy

    class Item:
        def __init__(self, name: str) -> None:
            self.name = name

        def get_closest_marker(self, marker: str):
            return self.name.startswith("H") or None

    def order(names: str, workers: int) -> str:
        items = [Item(n) for n in names.split()]
        place_heavy(items, workers)
        return " ".join(i.name for i in items)

    assert first_shares(10, 3) == [3, 3, 4]
    assert order("a b c d e f H1 H2", 1) == "H1 H2 a b c d e f"
    assert order("a b c d e f H1 H2", 2) == "H1 a b c H2 d e f"
    assert order("a b c H1 H2 H3", 2) == "H1 H3 a H2 b c"
    assert order("a b c", 4) == "a b c"
