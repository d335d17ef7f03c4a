"""What ``--qconform`` sets up once per session: probe, backends, targets, hypothesis profile."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from pytest_qconform.backends import adapter_rules
from pytest_qconform.hardware import startup_notes
from pytest_qconform.hardware.probe import BackendStatus, probe_hardware
from pytest_qconform.hardware.targets import build_targets
from pytest_qconform.session import allocator, inductor_warmup, state


def _select_backends(config: pytest.Config, factories: dict) -> dict:
    wanted = list(config.getoption("qconform_backend")) or list(config.getini("qconform_backends"))
    if not wanted:
        return factories
    by_folded = {name.casefold(): name for name in factories}
    wanted = [name if name in factories else by_folded.get(name.casefold(), name) for name in wanted]  # any case
    unknown = [n for n in wanted if n not in factories]
    if unknown:
        raise pytest.UsageError(
            f"--qconform-backend: unknown backend {', '.join(map(repr, unknown))}; "
            f"known backends: {', '.join(sorted(factories))}"
        )
    return {n: factories[n] for n in wanted}


def _profile(config: pytest.Config) -> str:
    from pytest_qconform.session.options import PROFILES

    name = config.getoption("qconform_profile") or str(config.getini("qconform_profile")).strip().lower()
    if name not in PROFILES:
        raise pytest.UsageError(f"ini qconform_profile: {name!r} is not one of {', '.join(PROFILES)}")
    return name


def _example_database(config: pytest.Config, profile: str) -> str | None:
    """The example database folder (absolute), or None for none: the option, else the ini
    (relative to the rootdir), else none for ``ci`` (derandomized) and the rootdir's
    ``.hypothesis/examples`` for ``thorough``, so that it does not move with the cwd."""
    given = config.getoption("qconform_hypothesis_db") or str(config.getini("qconform_hypothesis_db")).strip()
    if not given:
        given = "none" if profile == "ci" else ".hypothesis/examples"
    if given.lower() == "none":
        return None
    path = Path(given).expanduser()
    return str(path if path.is_absolute() else Path(config.rootpath) / path)


def _discover_backends(config: pytest.Config) -> dict:
    from pytest_qconform.backends import registry

    factories = dict(registry.discover())
    for extra in config.hook.pytest_qconform_backends(config=config):
        for name, factory in (extra or {}).items():
            if name in factories:
                raise pytest.UsageError(f"pytest_qconform_backends: backend name {name!r} is already registered")
            factories[name] = factory
    return factories


def start_session(config: pytest.Config) -> None:
    """Everything a --qconform session needs before collection: the hypothesis profile, the
    probe (warnings while loading kept in its notes), the backends, the known failures.

    A pytest-xdist controller checks its backends later (``check_backends``, from the
    ``pytest_collection`` hook, once its workers have started): it runs no test, and each
    worker imports and checks the backends for itself, so the controller's imports (7-10 s
    on the H100 host, docs/run-times.md) would only hold the workers' start back."""
    profile = _profile(config)  # bad input stops the run before anything is probed
    _workers_share_the_cpus(config)
    if not _starts_workers(config):  # a process that runs checks (a controller runs none)
        config.stash[state.ALLOCATOR] = allocator.keep_freed_memory()
    simulate = config.getoption("qconform_simulate")
    try:
        with startup_notes.captured() as notes:
            probe = probe_hardware(simulate).with_notes(notes)
    except ValueError as exc:
        raise pytest.UsageError(f"--qconform-simulate: {exc}") from None
    inductor_warmup.start(config, probe, _starts_workers(config))
    from pytest_qconform.session import known_failures

    known_failures.read_at_startup(config)  # a malformed file stops the run before anything runs
    registered = _discover_backends(config)
    factories = _select_backends(config, registered)
    config.stash[state.REGISTERED_FACTORIES] = registered
    config.stash[state.BACKEND_FACTORIES] = factories
    config.stash[state.PROBE] = probe
    config.stash[state.TARGETS] = build_targets(probe, config.getoption("markexpr") or "")
    config.stash[state.CASES] = {}
    if _starts_workers(config):  # it draws nothing: hypothesis is imported once the workers start
        config.stash[state.PENDING_BACKEND_CHECK] = lambda: _check_backends_beside_the_workers(config)
        return
    from pytest_qconform.cases import strategies

    strategies.load_profile(profile, _example_database(config, profile))
    check_backends(config)


def _check_backends_beside_the_workers(config: pytest.Config) -> None:
    """A pytest-xdist controller's deferred start, run while its workers import and collect
    (10-15 s on the H200, where it would otherwise wait): the backends' check, and
    hypothesis' import. The controller draws nothing, but hypothesis' pytest plugin imports
    hypothesis for its summary at the session's end (1-1.5 s on the H200), where every
    worker has finished and the wait is the run's."""
    check_backends(config)
    import hypothesis  # noqa: F401


COMPILE_THREADS_VARIABLE = "TORCHINDUCTOR_COMPILE_THREADS"
THREADS_VARIABLE = "OMP_NUM_THREADS"


def _workers_share_the_cpus(config: pytest.Config) -> None:
    """In a pytest-xdist worker: torch computes on its share of the CPUs (the CPUs divided by
    the workers, at least one) and inductor compiles in the worker's own process, unless
    OMP_NUM_THREADS or TORCHINDUCTOR_COMPILE_THREADS say otherwise.

    Why: by default each process takes every CPU for itself. Two workers on the 2-core CI
    machine ran two torch threads each, and the default run took 200 s against 185 s in one
    process; with one thread each it took 128 s (docs/run-times.md). And each process that
    compiles starts a pool of one compile process per CPU and waits for the pool's shutdown
    at exit: eight workers on a 16-core H100 host could start 136 processes, and the run's
    end waited 9 s (inductor skips its pool warm-up in fbcode for the same reason:
    ``maybe_warm_pool``, pools inside multiprocessing pools multiply). Verdicts do not
    depend on it: a thread count changes the order in which a kernel's sums are added, and
    every bound holds for sums in any order (``reference.bounds``); the kernels compiled are
    the same, by another process."""
    workerinput = getattr(config, "workerinput", None)
    if workerinput is None:
        return
    if THREADS_VARIABLE not in os.environ:
        import torch

        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        torch.set_num_threads(max(1, cpus // max(1, int(workerinput.get("workercount", 1)))))
    if COMPILE_THREADS_VARIABLE not in os.environ:
        import torch._inductor.config as inductor_config

        inductor_config.compile_threads = 1


def _starts_workers(config: pytest.Config) -> bool:
    """Whether this process is a pytest-xdist controller that hands every test to workers
    (pytest-xdist's own test: a distribution mode and workers to start; ``--collect-only``
    runs no workers)."""
    if hasattr(config, "workerinput") or config.getoption("collectonly"):
        return False
    return getattr(config.option, "dist", "no") != "no" and bool(getattr(config.option, "tx", None))


def check_backends(config: pytest.Config) -> None:
    """Build each selected backend, hold it to the adapter rules (violations are a usage
    error) and record its availability in the probe."""
    config.stash[state.PENDING_BACKEND_CHECK] = None
    probe = config.stash[state.PROBE]
    statuses, broken = [], {}
    devices = ("cpu", "cuda") if probe.has_gpu else ("cpu",)
    factories = config.stash[state.BACKEND_FACTORIES]
    for name in sorted(factories):
        with startup_notes.captured() as notes:  # import-time warnings: one header line, not a screenful
            backend = state.backend(config, name)
            problems = adapter_rules.violations(name, backend, devices)
        if problems:
            broken[name] = problems
            continue
        available = backend.availability()
        statuses.append(BackendStatus(name, available.available, available.version, available.reason, tuple(notes)))
    if broken:
        raise pytest.UsageError(adapter_rules.format_violations(broken))
    config.stash[state.PROBE] = probe.with_backends(tuple(statuses))
