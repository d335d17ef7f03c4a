"""The background Triton warm-up (triton-nf4/qconform_triton_nf4/warmup.py): when a session starts
one, that its workers replay their shares and are reported, that the session stops the
ones still running, and that a recorded call log replays to the very kernel launches of
the run it was recorded from (checked by the compile census under the interpreter)."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")
bnb_functional = pytest.importorskip("bitsandbytes.functional")

from pytest_qconform.hardware.probe import BackendStatus, Probe  # noqa: E402
from pytest_qconform.session import background  # noqa: E402
from qconform_triton_nf4 import kernel_calls  # noqa: E402
from qconform_triton_nf4 import warmup as triton_warmup  # noqa: E402

BENCH = Path(__file__).resolve().parents[1] / "bench"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # where the workers replay (a GPU host compiles)


@pytest.mark.parametrize("cpus, workers", [(None, 1), (1, 1), (2, 1), (6, 3), (16, 8), (128, 8)])
def test_default_workers_take_half_the_cpus_up_to_eight(cpus: int | None, workers: int) -> None:
    assert triton_warmup.default_workers(cpus) == workers


@pytest.mark.parametrize("gib, workers", [(80, 8), (24, 6), (16, 4), (8, 2), (4, 1), (2, 1)])
def test_default_workers_take_one_per_4_gib_of_gpu_memory(gib: int, workers: int) -> None:
    assert triton_warmup.default_workers(16, gib * 2**30) == workers


class _Config:
    """The options skip_reason reads; ``workerinput`` marks an xdist worker."""

    def __init__(self, workers: int | None = None, collect_only: bool = False, xdist_worker: bool = False) -> None:
        self.options = {"qconform_warmup_workers": workers, "collectonly": collect_only}
        if xdist_worker:
            self.workerinput = {"workerid": "gw0"}

    def getoption(self, name: str):
        return self.options[name]


def _probe(kind: str = "cuda", triton_available: bool = True, simulated: bool = False) -> Probe:
    return Probe(
        device_kind=kind,
        arch="sm90" if kind == "cuda" else "x86_64",
        family=None,
        device_name="test",
        host="test",
        torch="2.11",
        cuda="13.0",
        hip=None,
        bf16=True,
        default_blocksize=64,
        simulated=simulated,
        backends=(BackendStatus(triton_warmup.TRITON_BACKEND, triton_available, "0", ""),),
    )


def _tested(probe: Probe) -> bool:
    status = probe.backend(triton_warmup.TRITON_BACKEND)
    return status is not None and status.available


@pytest.mark.parametrize(
    "config, probe, reason",
    [
        (_Config(), _probe(), None),
        (_Config(workers=3), _probe(), None),
        (_Config(workers=0), _probe(), "off (--qconform-warmup-workers=0)"),
        (_Config(), _probe("cpu"), "no GPU"),
        (_Config(), _probe("rocm", simulated=True), "no GPU"),
        (_Config(), _probe(triton_available=False), "triton-nf4 is not tested in this run"),
        (_Config(xdist_worker=True), _probe(), "pytest-xdist worker (the controller warms the cache)"),
        (_Config(collect_only=True), _probe(), "--collect-only"),
    ],
    ids=["gpu", "gpu-3-workers", "off", "cpu", "simulated-gfx", "no-triton", "xdist-worker", "collect-only"],
)
def test_skip_reason(config: _Config, probe: Probe, reason: str | None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert triton_warmup.skip_reason(config, probe, _tested(probe)) == reason


def test_no_warmup_when_kernels_run_interpreted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "TRITON_INTERPRET=1" in triton_warmup.skip_reason(_Config(), _probe(), True)


def _log(path: Path, dtypes=(torch.float32, torch.float16, torch.bfloat16)) -> Path:
    weight = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    data, state = bnb_functional.quantize_4bit(weight, blocksize=64, quant_type="nf4")
    recorder = kernel_calls.Recorder()
    recorder.calls = [
        kernel_calls.record(
            "dequantize_4bit", (data, state.absmax), dict(blocksize=64, shape=(4, 64), code=state.code, out_dtype=dtype)
        )
        for dtype in dtypes
    ]
    recorder.write(path)
    return path


def test_workers_replay_their_shares_and_report(tmp_path: Path) -> None:
    marker = tmp_path / "cache" / "qconform-warmup-x.json"
    warmup = triton_warmup.Warmup(_log(tmp_path / "calls.json"), workers=2, device=DEVICE, marker=marker)
    assert warmup.header() == "qconform triton warm-up: 2 processes replaying 3 logged kernel calls (calls.json)"
    if os.name == "posix":  # they yield the CPU to the session (nice 10 above ours)
        ours = os.getpriority(os.PRIO_PROCESS, 0)
        niceness = [os.getpriority(os.PRIO_PROCESS, p.pid) for p in warmup.processes if p.poll() is None]
        assert all(n == min(19, ours + background.NICENESS) for n in niceness)
    deadline = time.monotonic() + 120
    while any(p.poll() is None for p in warmup.processes) and time.monotonic() < deadline:
        time.sleep(0.2)
    warmup.stop("the test ended first")
    summary = warmup.summary()
    assert summary.startswith("qconform triton warm-up: 2 of 2 processes finished (3 calls, 0 failed; slowest ")
    assert "stopped" not in summary and "error" not in summary
    assert json.loads(marker.read_text())["calls"] == 3  # complete: the next session skips the warm-up


def test_stop_terminates_running_workers_and_says_why(tmp_path: Path) -> None:
    marker = tmp_path / "qconform-warmup-x.json"
    warmup = triton_warmup.Warmup(_log(tmp_path / "calls.json"), workers=2, device=DEVICE, marker=marker)
    warmup.stop("the test ended first")  # the workers are still importing torch
    assert warmup.processes == []
    assert warmup.summary() == (
        "qconform triton warm-up: 0 of 2 processes finished (0 calls, 0 failed; "
        "slowest 0.0 s); the rest stopped: the test ended first"
    )
    warmup.stop("again")  # idempotent
    assert "again" not in warmup.summary()
    assert not marker.exists()  # incomplete: the next session warms up again


def test_a_worker_error_reaches_the_summary_and_leaves_no_marker(tmp_path: Path) -> None:
    marker = tmp_path / "qconform-warmup-x.json"
    warmup = triton_warmup.Warmup(
        _log(tmp_path / "calls.json", dtypes=(torch.int8,)), workers=1, device=DEVICE, marker=marker
    )
    warmup.processes[0].wait(timeout=120)
    warmup.stop()
    assert not marker.exists()
    assert "(1 calls, 1 failed;" in warmup.summary()
    assert "first error: dequantize_4bit: ValueError: kernels.dequantize_4bit: out_dtype" in warmup.summary()


def test_fingerprint_follows_what_decides_the_compiled_variants(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = _log(tmp_path / "calls.json")
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION", raising=False)
    base = triton_warmup.fingerprint(_probe(), log)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "elsewhere"))  # where, not what
    assert triton_warmup.fingerprint(_probe(), log) == base
    assert triton_warmup.marker_path(_probe(), log).parent == tmp_path / "elsewhere"
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "0")
    assert triton_warmup.fingerprint(_probe(), log) != base
    monkeypatch.delenv("TRITON_DEFAULT_FP_FUSION")
    newer = _probe()
    object.__setattr__(newer, "triton", "9.9.9")
    assert triton_warmup.fingerprint(newer, log) != base
    _log(log, dtypes=(torch.float32,))
    assert triton_warmup.fingerprint(_probe(), log) != base


def test_a_broken_call_log_is_named_before_any_worker_starts(tmp_path: Path) -> None:
    (tmp_path / "calls.json").write_text('{"calls": 1}')
    with pytest.raises(kernel_calls.CallLogError, match="calls.json: expected an object with a 'calls' list"):
        triton_warmup.Warmup(tmp_path / "calls.json", workers=2, device=DEVICE)


def test_bad_worker_count_is_a_usage_error(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest_subprocess("--qconform", "--qconform-warmup-workers=-2")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--qconform-warmup-workers: expected a whole number >= 0, got -2*"])


def test_recording_under_xdist_writes_every_workers_calls_once(pytester: pytest.Pytester, monkeypatch) -> None:
    """Each worker hands its calls to the controller (``call_recording``), which writes one
    log: here four rows counts called on two workers, each distinct call once. On a GPU
    the calls run compiled there (Triton 3.6's interpreter fails its own loop bounds under
    NumPy 2 on the device's image), without the warm-up; elsewhere in the interpreter."""
    pytest.importorskip("xdist")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    pytester.makepyfile(
        test_calls=f"""
import pytest, torch
import bitsandbytes.functional as F
from qconform_triton_nf4 import kernels

@pytest.mark.parametrize("rows", [1, 2, 3, 4, 4])
def test_call(rows):
    w = torch.randn(8, 64, generator=torch.Generator().manual_seed(0)).to("{device}")
    data, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    x = torch.ones(rows, 64, device="{device}")
    kernels.gemv_4bit(x, data, state.absmax, blocksize=64, shape=(8, 64), code=state.code)
"""
    )
    result = pytester.runpytest_subprocess(
        "--qconform",
        "-n",
        "2",
        "--qconform-warmup-workers=0",
        "--qconform-record-kernel-calls",
        "calls.json",
        "--qconform-no-report",
        "test_calls.py",
    )
    result.assert_outcomes(passed=5)
    calls = kernel_calls.load(pytester.path / "calls.json")
    assert sorted(c["args"][0]["tensor"]["shape"][0] for c in calls) == [1, 2, 3, 4]
    assert {c["fn"] for c in calls} == {"gemv_4bit"}


def test_no_warmup_line_without_a_gpu(pytester: pytest.Pytester) -> None:
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the warm-up starts")
    result = pytester.runpytest_subprocess("--qconform", "--collect-only", "-q", "--qconform-no-report")
    assert "warm-up" not in result.stdout.str()


@pytest.mark.skipif(torch.cuda.is_available(), reason="compares interpreter keys; on a GPU the census runs compiled")
def test_replayed_log_launches_the_kernel_keys_of_the_recorded_run(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Record the Triton cells of two suites with the census on, replay the log with the
    census on: the same kernel launch keys, so a warm-up compiles what the run needs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(BENCH), os.environ.get("PYTHONPATH")) if p))
    run = pytester.runpytest_subprocess(
        "--qconform",
        "-p",
        "no:cacheprovider",
        "--qconform-no-report",
        "--qconform-backend",
        "triton-nf4",
        "-k",
        "dequantize or matmul_every_row_count",
        "-p",
        "compile_census",
        "--census-out",
        "run.json",
        "--qconform-record-kernel-calls",
        "calls.json",
    )
    assert run.ret == pytest.ExitCode.OK, run.stdout.str()[-2000:]
    pytester.makepyfile(
        test_replay="""
        import torch
        from qconform_triton_nf4 import kernel_calls

        def test_replay():
            assert kernel_calls.replay(kernel_calls.load("calls.json"), torch.device("cpu"))["failed"] == 0
    """
    )
    replay = pytester.runpytest_subprocess(
        "-p", "no:cacheprovider", "-p", "compile_census", "--census-out", "replay.json", "test_replay.py"
    )
    replay.assert_outcomes(passed=1)
    run_keys = set(json.loads((pytester.path / "run.json").read_text())["keys"])
    replay_keys = set(json.loads((pytester.path / "replay.json").read_text())["keys"])
    assert len(run_keys) >= 10  # the dequantize suite alone launches many variants
    assert replay_keys == run_keys


def test_header_note_says_why_no_worker_started() -> None:
    note = triton_warmup.HeaderNote("qconform triton warm-up: off, reason")
    assert note.pytest_report_header() == "qconform triton warm-up: off, reason"


def test_a_crashed_worker_is_named_in_the_summary(tmp_path: Path) -> None:
    marker = tmp_path / "qconform-warmup-x.json"
    warmup = triton_warmup.Warmup(_log(tmp_path / "calls.json"), workers=1, device=DEVICE, marker=marker)
    warmup.processes[0].kill()  # dies with no summary line, as a segfaulting worker would
    warmup.processes[0].wait(timeout=60)
    warmup.stop()
    assert "(0 calls, 0 failed;" in warmup.summary()
    assert "first error: a worker exited with code -9 and no summary" in warmup.summary()
    assert not marker.exists()
