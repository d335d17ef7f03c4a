"""What ``--qconform`` sets up once per session: probe, backends, targets, hypothesis profile."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_qconform.backends import adapter_rules
from pytest_qconform.hardware.probe import BackendStatus, probe_hardware
from pytest_qconform.hardware.targets import build_targets
from pytest_qconform.session import startup_notes, state


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
    probe (warnings while loading kept in its notes), the backends, the known failures."""
    profile = _profile(config)  # bad input stops the run before anything is probed
    simulate = config.getoption("qconform_simulate")
    try:
        with startup_notes.captured() as notes:
            probe = probe_hardware(simulate).with_notes(notes)
    except ValueError as exc:
        raise pytest.UsageError(f"--qconform-simulate: {exc}") from None
    from pytest_qconform.session import known_failures

    known_failures.read_at_startup(config)  # a malformed file stops the run before anything runs
    registered = _discover_backends(config)
    factories = _select_backends(config, registered)
    config.stash[state.REGISTERED_FACTORIES] = registered
    config.stash[state.BACKEND_FACTORIES] = factories
    statuses, broken = [], {}
    devices = ("cpu", "cuda") if probe.has_gpu else ("cpu",)
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
    config.stash[state.TARGETS] = build_targets(probe, config.getoption("markexpr") or "")
    config.stash[state.CASES] = {}
    from pytest_qconform.cases import strategies

    strategies.load_profile(profile, _example_database(config, profile))
