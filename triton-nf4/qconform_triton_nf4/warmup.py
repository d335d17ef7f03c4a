"""Compile our Triton kernels in background processes while a GPU session collects and runs.

Why: a cold default run on the H100 spent ~40 of its ~60 s in tests compiling ~90 Triton
kernel variants, one at a time, as the tests first reached them (bench/notes.md, "Compile
census"). Triton holds the GIL while it compiles (threads gave no speed-up), so the
compiles go to processes: at configure time, before collection, the session starts
``--qconform-warmup-workers`` of them; each replays its share of the packaged call log
(``default_run_kernel_calls.json``, the entry-point calls of a default run; see
``kernel_calls``) on zeros, which puts the same variants into Triton's on-disk cache
(``TRITON_CACHE_DIR`` is inherited). The session does not wait for them: a kernel it needs
first compiles in the session as before, and results never depend on it (Triton keys
cache entries by source, arguments and options). The first worker also builds the
adapter's native launch (``kernels/native_launch``, cached by torch once built). Workers
still running at the end of the session are stopped.

A warm-up whose workers all replay their calls without an error leaves a marker file in
Triton's cache folder, named by a hash of what decides the compiled variants (the call
log, the kernel sources, the Triton and torch versions, the GPU architecture, Triton's
environment variables). A later session that finds it starts no workers: on a warm cache
they only cost time (8 workers made a warm H100 run 5 s slower, bench/notes.md). Deleting
the cache folder deletes the marker with it.

``--qconform-record-kernel-calls FILE`` writes the call log of a run (to refresh the
packaged one after the suites change: ``nox -s kernel-calls``).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pytest_qconform.hardware.probe import Probe
from pytest_qconform.session import guests

TRITON_BACKEND = "triton-nf4"
MAX_DEFAULT_WORKERS = 8


GPU_BYTES_PER_DEFAULT_WORKER = 4 * 2**30


def default_workers(cpus: int | None, gpu_bytes: int | None = None) -> int:
    """Half the CPUs, 1 to 8: the session and its own compiles keep the other half. Also
    at most one per 4 GiB of GPU memory: each worker holds a CUDA context on the session's
    GPU while it runs, and on a small card eight of them could push a test into OOM."""
    workers = max(1, min(MAX_DEFAULT_WORKERS, (cpus or 2) // 2))
    if gpu_bytes is not None:
        workers = max(1, min(workers, gpu_bytes // GPU_BYTES_PER_DEFAULT_WORKER))
    return workers


def _gpu_bytes() -> int | None:
    """Total memory of the session's GPU (the current device), or None if torch cannot say."""
    try:
        import torch

        return int(torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory)
    except Exception:  # the count is a default, never a reason to fail the session
        return None


def skip_reason(config: pytest.Config, probe: Probe, tested: bool) -> str | None:
    """Why this session starts no warm-up, or None when it should start one (``tested``:
    whether triton-nf4 is under test and available)."""
    if config.getoption("qconform_warmup_workers") == 0:
        return "off (--qconform-warmup-workers=0)"
    if not probe.has_gpu:
        return "no GPU"
    if not tested:
        return f"{TRITON_BACKEND} is not tested in this run"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1: the kernels run interpreted, nothing is compiled"
    if hasattr(config, "workerinput"):
        return "pytest-xdist worker (the controller warms the cache)"
    if config.getoption("collectonly"):
        return "--collect-only"
    return None


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels (``TRITON_CACHE_DIR``, else ~/.triton/cache)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):  # Triton before 3.4 has no knobs
        home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
        return Path(os.environ.get("TRITON_CACHE_DIR") or os.path.join(home, ".triton", "cache"))


def fingerprint(probe: Probe, calls_path: Path) -> str:
    """A hash of what decides which kernel variants the warm-up compiles and where they land."""
    digest = hashlib.sha256()
    kernel_sources = sorted((Path(__file__).parent / "kernels").glob("*.py"))
    for path in (calls_path, *kernel_sources):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    triton_env = sorted(
        (k, v)
        for k, v in os.environ.items()
        if k.startswith("TRITON_") and k not in ("TRITON_CACHE_DIR", "TRITON_HOME")
    )
    digest.update(json.dumps([probe.triton, probe.torch, probe.device_kind, probe.arch, triton_env]).encode())
    return digest.hexdigest()[:20]


def marker_path(probe: Probe, calls_path: Path) -> Path:
    return triton_cache_dir() / f"qconform-warmup-{fingerprint(probe, calls_path)}.json"


class HeaderNote:
    """The warm-up's header line in a GPU session that starts no workers, saying why."""

    def __init__(self, line: str) -> None:
        self.line = line

    def pytest_report_header(self) -> str:
        return self.line


class Warmup:
    """The worker processes, and the pytest hooks that report on them and stop them."""

    def __init__(self, calls_path: Path, workers: int, device: str, marker: Path | None = None) -> None:
        from qconform_triton_nf4 import kernel_calls

        self.calls = len(kernel_calls.load(calls_path))  # a broken log raises before any worker starts
        self.calls_path, self.workers, self.marker = calls_path, workers, marker
        self.processes: list[subprocess.Popen] = []
        self.results: list[dict] = []
        self.stopped_early: str | None = None
        command = [
            sys.executable,
            "-m",
            "qconform_triton_nf4.kernel_calls",
            "replay",
            str(calls_path),
            "--shards",
            str(workers),
            "--device",
            device,
        ]
        try:
            for shard in range(workers):
                self.processes.append(
                    subprocess.Popen(
                        [*command, "--shard", str(shard)],
                        stdout=subprocess.PIPE,
                        stderr=subprocess.DEVNULL,
                        text=True,
                        preexec_fn=guests.yield_the_cpu(),
                    )
                )
        except OSError:
            self.stop("a worker could not start")
            raise

    def header(self) -> str:
        return (
            f"qconform triton warm-up: {self.workers} processes replaying {self.calls} logged kernel calls "
            f"({self.calls_path.name})"
        )

    def stop(self, why: str | None = None) -> None:
        """Collect finished workers' summaries, terminate the rest (idempotent)."""
        if why and self.stopped_early is None and any(p.poll() is None for p in self.processes):
            self.stopped_early = why
        for process in self.processes:  # all signalled first: their exits overlap, one wait
            if process.poll() is None:
                process.terminate()
        for process in self.processes:
            try:
                out, _ = process.communicate(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                out, _ = process.communicate()
            self.results.append(self._summary(process.returncode, out))
        self.processes.clear()
        if self.marker is not None and self.complete():
            self._write_marker()

    def complete(self) -> bool:
        """Every worker replayed its whole share without an error."""
        return (
            len(self.results) == self.workers
            and self.stopped_early is None
            and all(r.get("failed") == 0 for r in self.results)
        )

    def _write_marker(self) -> None:
        if self.marker is None:
            return
        try:
            self.marker.parent.mkdir(parents=True, exist_ok=True)
            self.marker.write_text(
                json.dumps(
                    {"calls": self.calls, "log": self.calls_path.name, "written": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
                )
                + "\n"
            )
        except OSError:
            pass  # a read-only cache only means the next session warms up again
        self.marker = None

    @staticmethod
    def _summary(returncode: int, out: str) -> dict:
        try:
            result = json.loads(out.strip().splitlines()[-1])
            if isinstance(result, dict):
                return result
        except (ValueError, IndexError):
            pass
        return {"exit": returncode}

    def summary(self) -> str:
        finished = [r for r in self.results if "calls" in r]
        failed = sum(r["failed"] for r in finished)
        errors = [
            r.get("first_error") or r.get("error") for r in self.results if r.get("first_error") or r.get("error")
        ]
        if not self.stopped_early:  # a worker that was not stopped and left no summary crashed
            errors += [f"a worker exited with code {r['exit']} and no summary" for r in self.results if "exit" in r]
        line = (
            f"qconform triton warm-up: {len(finished)} of {self.workers} processes finished "
            f"({sum(r['calls'] for r in finished)} calls, {failed} failed; slowest "
            f"{max((r['seconds'] for r in finished), default=0):.1f} s)"
        )
        if self.stopped_early:
            line += f"; the rest stopped: {self.stopped_early}"
        if errors:
            line += f"; first error: {errors[0]}"
        return line

    def pytest_report_header(self) -> str:
        return self.header()

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        uses_triton = any(
            getattr(getattr(item, "callspec", None), "params", {}).get("qbackend") == TRITON_BACKEND
            for item in session.items
        )
        if not uses_triton:
            self.stop(f"no {TRITON_BACKEND} test selected")

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        self.stop("the session ended first")
        terminalreporter.write_line(self.summary())


def start_warmup(config: pytest.Config) -> None:
    """Start the warm-up when ``skip_reason`` finds none; install the call recording if asked
    (``call_recording``)."""
    from qconform_triton_nf4 import call_recording, kernel_calls

    call_recording.start(config)
    # The machine and triton-nf4 alone: a pytest-xdist controller checks its other backends
    # only once its workers have started (session.setup).
    probe = guests.machine(config)
    if skip_reason(config, probe, probe.has_gpu and guests.backend_available(config, TRITON_BACKEND)) is not None:
        return
    marker = marker_path(probe, kernel_calls.DEFAULT_RUN_CALLS)
    if marker.exists():
        config.pluginmanager.register(
            HeaderNote(
                f"qconform triton warm-up: not needed, Triton's cache already holds the logged kernels ({marker})"
            ),
            "qconform-triton-warmup",
        )
        return
    workers = config.getoption("qconform_warmup_workers")
    try:
        warmup = Warmup(
            kernel_calls.DEFAULT_RUN_CALLS,
            workers if workers is not None else default_workers(os.cpu_count(), _gpu_bytes()),
            "cuda",
            marker,
        )
    except (kernel_calls.CallLogError, OSError) as exc:  # an optimization: never the session's end
        config.pluginmanager.register(HeaderNote(f"qconform triton warm-up: off, {exc}"), "qconform-triton-warmup")
        return
    config.pluginmanager.register(warmup, "qconform-triton-warmup")
    config.add_cleanup(lambda: warmup.stop("the session ended first"))  # also without a terminal summary
