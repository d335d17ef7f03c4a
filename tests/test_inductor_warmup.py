"""Inductor's vector-ISA check in a background process on a CPU machine: when it starts,
what it runs, and that the session waits for it instead of killing it."""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pytest_qconform.hardware.probe import Probe, simulated_probe
from pytest_qconform.session import background, inductor_warmup


class _Config:
    def __init__(self, workers: int | None = None, collect_only: bool = False) -> None:
        self.options = {"qconform_warmup_workers": workers, "collectonly": collect_only}
        self.cleanups: list = []

    def getoption(self, name: str):
        return self.options[name]

    def add_cleanup(self, fn) -> None:
        self.cleanups.append(fn)


@pytest.fixture(autouse=True)
def marker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """The marker in a folder of the test's own, absent until a test writes it."""
    path = tmp_path / "inductor-cache" / "qconform-vec-isa-checked"
    monkeypatch.setattr(inductor_warmup, "marker_path", lambda: path)
    return path


def _probe(kind: str) -> Probe:
    """A probe of this machine's kind: a real (not simulated) GPU for "cuda"."""
    gpu = dataclasses.replace(simulated_probe("sm90"), simulated=False)
    return gpu if kind == "cuda" else dataclasses.replace(gpu, device_kind="cpu", arch="x86_64", family=None)


@pytest.mark.parametrize(
    "config, kind, starts_workers, reason",
    [
        (_Config(), "cpu", False, None),
        (_Config(workers=0), "cpu", False, "off (--qconform-warmup-workers=0)"),
        (_Config(), "cuda", False, "a GPU machine"),
        (_Config(collect_only=True), "cpu", False, "--collect-only"),
        (_Config(), "cpu", True, "pytest-xdist controller (its workers compile)"),
    ],
    ids=["cpu", "off", "gpu", "collect-only", "xdist-controller"],
)
def test_skip_reason(config: _Config, kind: str, starts_workers: bool, reason: str | None) -> None:
    assert inductor_warmup.skip_reason(config, _probe(kind), starts_workers) == reason  # type: ignore[arg-type]


def test_no_check_once_the_cache_holds_its_programs(marker: Path) -> None:
    marker.parent.mkdir(parents=True)
    marker.touch()
    reason = inductor_warmup.skip_reason(_Config(), _probe("cpu"), False)  # type: ignore[arg-type]
    assert reason == "inductor's cache already holds the check's programs"


def test_the_check_leaves_the_marker_even_when_it_fails(marker: Path, tmp_path: Path) -> None:
    """Run for real, with a torch whose inductor lacks the check's name: the marker is still
    written (the session's own check would meet the same error), and the session is told
    nothing (the process's error stays in the process)."""
    fake = tmp_path / "fake" / "torch" / "_inductor"
    fake.mkdir(parents=True)
    for folder in (fake.parent, fake):
        (folder / "__init__.py").write_text("")
    (fake / "cpu_vec_isa.py").write_text("")  # no valid_vec_isa_list
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "fake")}
    done = subprocess.run([sys.executable, "-c", inductor_warmup.CHECK, str(marker)], env=env, capture_output=True)
    assert done.returncode != 0 and b"valid_vec_isa_list" in done.stderr
    assert marker.exists()


def test_the_check_names_inductors_own_function() -> None:
    ast.parse(inductor_warmup.CHECK)
    import torch._inductor.cpu_vec_isa as isa

    assert callable(isa.valid_vec_isa_list)
    assert "valid_vec_isa_list()" in inductor_warmup.CHECK


def test_the_process_runs_niced_and_the_session_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    started: list[list[str]] = []
    niced: list = []
    waited: list[float] = []

    class _Process:
        def __init__(self, args, **kwargs) -> None:
            started.append(args)
            niced.append(kwargs.get("preexec_fn"))

        def wait(self, timeout: float) -> int:
            waited.append(timeout)
            raise subprocess.TimeoutExpired("check", timeout)  # still running: left alone, not killed

        def kill(self) -> None:  # pragma: no cover - must not be called
            raise AssertionError("the background check was killed")

    monkeypatch.setattr(inductor_warmup.subprocess, "Popen", _Process)
    config = _Config()
    assert inductor_warmup.start(config, _probe("cpu"), False) is not None  # type: ignore[arg-type]
    assert started == [[sys.executable, "-c", inductor_warmup.CHECK, str(inductor_warmup.marker_path())]]
    assert niced == [background.yield_the_cpu()]  # nice 10, as the Triton warm-up
    assert not waited  # nothing waits before the session ends
    for cleanup in config.cleanups:
        cleanup()
    assert waited == [inductor_warmup.END_WAIT_S]
    assert inductor_warmup.start(_Config(workers=0), _probe("cpu"), False) is None  # type: ignore[arg-type]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine starts no background check")
def test_a_cpu_session_starts_the_check(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the plugin: a ``--qconform`` session on this CPU machine starts one."""
    started: list = []
    original = inductor_warmup.start
    monkeypatch.setattr(inductor_warmup, "start", lambda *a: started.append(original(*a)) or started[-1])
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    result = pytester.runpytest_inprocess(
        "--qconform", "--qconform-no-report", "-p", "no:cacheprovider", "test_nothing.py"
    )
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # the gate: this test records no cell
    assert len(started) == 1 and started[0] is not None


def test_the_marker_sits_in_inductors_own_cache_folder(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Where torch's inductor puts its cache, by default and when TORCHINDUCTOR_CACHE_DIR says."""
    from torch._inductor.runtime import cache_dir_utils

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert inductor_warmup.inductor_cache_dir() == Path(cache_dir_utils.default_cache_dir())
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "elsewhere"))
    assert inductor_warmup.inductor_cache_dir() == Path(cache_dir_utils.cache_dir())
