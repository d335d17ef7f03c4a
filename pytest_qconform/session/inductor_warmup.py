"""Inductor's vector-ISA check, run in a background process while a CPU session starts.

Why: the first ``torch.compile`` in a CPU process (bitsandbytes compiles its CPU kernels on
their first call; the compiled-path checks) has inductor build and load a test program for
each vector instruction set the CPU may have (``torch._inductor.cpu_vec_isa.valid_vec_isa_list``):
8-9 s with a cold cache on the 2-core CI machine, all of it on the session's critical path,
and 1.2 s once inductor's on-disk cache holds the programs (measured 2026-11-26, torch 2.13).
The answer depends on the machine only. So a ``--qconform`` session on a machine without a
GPU starts one process, at configure time, that runs the check and so fills the cache while
the session imports its backends and collects. The session's own check then finds the
programs built, or waits on inductor's file lock for the one being built. Results never
depend on it: the same programs are built, by another process.

The process leaves a marker file in inductor's cache folder when it is done, and a session
that finds the marker starts none (every ``--qconform`` session in one folder would
otherwise pay a Python start with torch, a few seconds: the project's own tests run hundreds).
Deleting the cache folder deletes the marker with it. The process is never killed (a
compile cut short could leave a partial program in the cache, which inductor would then
take for an instruction set the CPU lacks); the session waits for it at its end, by which
time it has long finished. Off with ``--qconform-warmup-workers=0``, and where there is a
GPU (pytest-xdist workers there would start one each while they all import at once).
"""

from __future__ import annotations

import getpass
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from pytest_qconform.hardware.probe import Probe
from pytest_qconform.session import background

# What the process runs: the check itself, by its name in inductor (a missing name is an
# error in the process only, never the session's), then the marker (argv[1]), also after an
# error: the session's own check would meet the same one.
CHECK = """
import pathlib, sys
try:
    import torch._inductor.cpu_vec_isa as isa
    isa.valid_vec_isa_list()
finally:
    marker = pathlib.Path(sys.argv[1])
    marker.parent.mkdir(parents=True, exist_ok=True)
    marker.touch()
"""
END_WAIT_S = 120.0


def inductor_cache_dir() -> Path:
    """Inductor's cache folder: ``TORCHINDUCTOR_CACHE_DIR``, else ``torchinductor_<user>`` in
    the temp folder, as ``torch._inductor.runtime.cache_dir_utils`` decides it (tests check
    they agree). Not imported from there: importing it runs ``torch._inductor``'s package
    code, 1.4 s on a session that may never compile."""
    given = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if given is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        given = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(os.path.abspath(given))


def marker_path() -> Path:
    """The marker in inductor's cache folder, named by the torch version, whose inductor
    decides the programs."""
    import torch

    return inductor_cache_dir() / f"qconform-vec-isa-checked-{torch.__version__}"


def skip_reason(config: pytest.Config, probe: Probe, starts_workers: bool) -> str | None:
    """Why this process starts no check in the background, or None when it should
    (``starts_workers``: a pytest-xdist controller, which compiles nothing itself)."""
    if config.getoption("qconform_warmup_workers") == 0:
        return "off (--qconform-warmup-workers=0)"
    if probe.has_gpu:
        return "a GPU machine"
    if config.getoption("collectonly"):
        return "--collect-only"
    if starts_workers:
        return "pytest-xdist controller (its workers compile)"
    if marker_path().exists():
        return "inductor's cache already holds the check's programs"
    return None


def start(config: pytest.Config, probe: Probe, starts_workers: bool) -> subprocess.Popen | None:
    """Start the background check unless ``skip_reason`` says why not; the session waits for
    it at its end (``config.add_cleanup``)."""
    if skip_reason(config, probe, starts_workers) is not None:
        return None
    try:
        process = subprocess.Popen(
            [sys.executable, "-c", CHECK, str(marker_path())],
            preexec_fn=background.yield_the_cpu(),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    except OSError:  # an optimization: never the session's end
        return None

    def wait() -> None:
        try:
            process.wait(END_WAIT_S)
        except subprocess.TimeoutExpired:  # a hung compiler is left running, never killed mid-compile
            pass

    config.add_cleanup(wait)
    return process
