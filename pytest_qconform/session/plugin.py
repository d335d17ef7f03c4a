"""pytest hooks of pytest-qconform: options, markers, collection, header, summary.

Thin on purpose: every decision is delegated to a module with one job (probe, targets,
outcomes, report). Without ``--qconform`` the plugin only registers its markers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

from pytest_qconform.hardware.targets import hardware_marker_names

# Only what every pytest start needs: without --qconform nothing here imports torch or a
# backend (``state`` and everything under it are imported inside the hooks that need them).
from pytest_qconform.session import hookspecs, options, outcomes
from pytest_qconform.vocabulary import CaseKey, DtypeLabel, Verdict


def pytest_addoption(parser: pytest.Parser) -> None:
    options.add_options(parser)


def pytest_addhooks(pluginmanager: pytest.PytestPluginManager) -> None:
    pluginmanager.add_hookspecs(hookspecs)


def _register_markers(config: pytest.Config) -> None:
    for name, help_text in hardware_marker_names().items():
        config.addinivalue_line("markers", f"{name}: {help_text}")
    config.addinivalue_line("markers", "qconform_operation(name): the matrix operation a conformance test checks")
    config.addinivalue_line(
        "markers",
        "qconform_dtype(label): the dtype (bf16, fp16, fp32) of a conformance test "
        "that is not parametrized over dtypes, for its matrix cell",
    )
    config.addinivalue_line(
        "markers",
        "qconform_axes(*axes, **only): the axes a conformance check depends on "
        "(pytest_qconform.cases.axes); its instances are a covering array of them, from each "
        "backend's claims; keyword arguments restrict an axis to some values",
    )
    config.addinivalue_line(
        "markers",
        "qconform_heavy: a check whose instance takes seconds (it runs or compiles a model): run first, at the "
        "heads of the pytest-xdist workers' first shares in turn, so that no worker ends the run with them",
    )
    config.addinivalue_line(
        "markers",
        "qconform_ci_strength(n, jointly=()): the covering strength of a check's instances in the ci profile "
        "(default 2, all pairs; 1: every value of every axis once, for a whole workload per instance, and "
        "every combination of the axes jointly names)",
    )
    config.addinivalue_line(
        "markers",
        "qconform_thorough_strength(n): the covering strength of a check's instances in the thorough profile "
        "(default 3): 2 for a check with an axis of many values (the rows ladder), where 3-wise would multiply "
        "its pairs by that axis' length",
    )
    config.addinivalue_line(
        "markers",
        "distributed: a conformance check across processes (two ranks: gloo on the CPU, NCCL on two GPUs); "
        "opt-in: runs only when -m names it",
    )
    config.addinivalue_line(
        "markers",
        "large: a conformance check of sizes beyond the default run's budget (a 2^31-element weight); "
        "opt-in: runs only when -m names it or --qconform-large is given",
    )
    config.addinivalue_line(
        "markers",
        "qconform_large_on(*kinds): a check whose instances on these target kinds (cpu, cuda, rocm) are "
        "large (marked so, opt-in) and elsewhere part of the default run (the rows ladder's top on a CPU)",
    )
    config.addinivalue_line(
        "markers",
        "multi_gpu: a conformance check across devices (tensors on another GPU than the current one, "
        "a model split over two GPUs); skipped with the reason on a machine with fewer than two GPUs",
    )
    config.addinivalue_line(
        "markers",
        "qconform_benchmark: a benchmark (runs only with --benchmark-only); its "
        "timings go to the report's benchmarks, not to matrix cells",
    )


def suites_dir() -> Path:
    """Where the installed suites live: found, not imported (the suites sit above the session
    and import it; collecting them is pytest's job)."""
    spec = importlib.util.find_spec("pytest_qconform.suites")
    assert spec is not None and spec.submodule_search_locations, "pytest_qconform.suites is not installed"
    return Path(next(iter(spec.submodule_search_locations))).resolve()


def pytest_configure(config: pytest.Config) -> None:
    _register_markers(config)
    if not config.getoption("qconform"):
        options.check_inactive(config)
        return
    options.check_path_values_are_attached(config)
    from pytest_qconform.session import setup as session_setup

    session_setup.start_session(config)
    config.pluginmanager.import_plugin("pytest_qconform.session.fixtures")
    config.pluginmanager.import_plugin("pytest_qconform.session.oom")
    config.pluginmanager.import_plugin("pytest_qconform.session.device_loss")
    config.pluginmanager.import_plugin("pytest_qconform.session.declared_skips")
    config.pluginmanager.import_plugin("pytest_qconform.session.known_failures")  # its makereport wrapper
    from pytest_qconform.session.recorder import SHORT_CIRCUIT_PLUGIN, RunRecorder
    from pytest_qconform.session.short_circuit import ShortCircuit

    config.pluginmanager.register(RunRecorder(config), "qconform-recorder")
    config.pluginmanager.register(ShortCircuit(config), SHORT_CIRCUIT_PLUGIN)
    from pytest_qconform.backends import gemlite_configs

    gemlite_configs.start_recording(config)
    if config.args_source != pytest.Config.ArgsSource.ARGS:
        config.args = [str(suites_dir())]


@pytest.hookimpl(wrapper=True)
def pytest_collection(session: pytest.Session) -> object:
    """A pytest-xdist controller checks its backends here, after its workers have started
    (pytest-xdist starts them in ``pytest_sessionstart``); a bad adapter stops it as a usage
    error, as at configure time in a run without workers."""
    if session.config.getoption("qconform"):
        from pytest_qconform.session import state

        state.probe(session.config)
    return (yield)


def pytest_report_header(config: pytest.Config) -> list[str] | None:
    if not config.getoption("qconform"):
        return None
    from pytest_qconform.session import state

    return state.probe(config).lines()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    config = metafunc.config
    if not config.getoption("qconform"):
        return
    from pytest_qconform.session import state

    axes_marker = metafunc.definition.get_closest_marker("qconform_axes")
    if axes_marker is not None:
        from pytest_qconform.cases import instances

        session = instances.Backends(
            config.stash[state.TARGETS],
            tuple(config.stash[state.BACKEND_FACTORIES].keys()),
            lambda name: state.backend(config, name),
        )
        instances.parametrize(metafunc, axes_marker, session)
    elif "qtarget" in metafunc.fixturenames:
        params = [
            pytest.param(t, id=t.id, marks=[getattr(pytest.mark, m) for m in t.marker_names])
            for t in config.stash[state.TARGETS]
        ]
        metafunc.parametrize("qtarget", params, indirect=True)
    if "qbackend" in metafunc.fixturenames and axes_marker is None:
        names = sorted(config.stash[state.BACKEND_FACTORIES].keys())
        metafunc.parametrize("qbackend", names, indirect=True)
    if "qbench_shape" in metafunc.fixturenames:
        from pytest_qconform.benchmark import harness as bench

        metafunc.parametrize("qbench_shape", bench.shapes(config), ids=bench.shape_id)


def _dtype_label(value: object) -> str:
    """The cell key's dtype: a plain string (pytest-xdist sends the key between processes)."""
    try:
        return DtypeLabel.of(str(value)).value if value is not None else "-"
    except ValueError:  # a parameter named dtype that is no dtype the suites check
        return "-"


def _fixed_dtype(item: pytest.Item) -> str:
    """The ``qconform_dtype`` marker's label, or "-" for a test that spans dtypes."""
    marker = item.get_closest_marker("qconform_dtype")
    return str(marker.args[0]) if marker else "-"


def _case_key(item: pytest.Item) -> CaseKey | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None or "qbackend" not in callspec.params:
        return None
    params = callspec.params
    marker = item.get_closest_marker("qconform_operation")
    operation = marker.args[0] if marker else item.path.stem.removeprefix("test_")
    spec = params.get("spec")
    target = params.get("qtarget")
    target_id = target.id if target is not None else "-"
    from pytest_qconform.cases.instances import nothing_claimed

    if nothing_claimed(item):  # the check's one cell for a backend that claims nothing it needs
        return CaseKey(str(params["qbackend"]), operation, "-", "-", target_id)
    return CaseKey(
        str(params["qbackend"]),
        operation,
        spec.label() if spec is not None else str(params.get("format", "-")),
        _dtype_label(params["dtype"]) if "dtype" in params else _fixed_dtype(item),
        target_id,
    )


def _repro(config: pytest.Config, item: pytest.Item) -> str:
    simulate = config.getoption("qconform_simulate")
    extra = f" --qconform-simulate={simulate}" if simulate else ""
    return f"pytest --qconform -p no:randomly{extra} '{item.path}::{item.name}'"


def _selected(item: pytest.Item, key: CaseKey, config: pytest.Config) -> bool:
    formats = config.getoption("qconform_format")
    dtypes = config.getoption("qconform_dtype")
    fmt = key.format.split("-", 1)[0]
    if formats and fmt not in formats:
        return False
    return not (dtypes and key.dtype != "-" and key.dtype not in dtypes)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("qconform"):
        return
    from pytest_qconform.cases import instances
    from pytest_qconform.session import state

    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    claims_cache: dict[Any, Any] = {}
    for item in items:
        key = _case_key(item)
        if key is not None:
            if not _selected(item, key, config):
                drop.append(item)
                continue
            if item.get_closest_marker("qconform_benchmark") is None:  # timings are not matrix cells
                outcomes.attach_key(item, key)
                item.user_properties.append((outcomes.REPRO_PROPERTY, _repro(config, item)))
                if instances.nothing_claimed(item):  # its skip marker's reason says what is missing
                    outcomes.declare(item.user_properties, Verdict.NOT_CLAIMED)
                labels = instances.axis_labels(item)
                if labels is not None:
                    item.user_properties.append((outcomes.AXES_PROPERTY, labels))
                    claimed = instances.claimed_labels(item, claims_cache, lambda name: state.backend(config, name))
                    if claimed is not None:
                        item.user_properties.append((outcomes.CLAIMED_AXES_PROPERTY, claimed))
        keep.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
    from pytest_qconform.session import applicability

    applicability.deselect(config, items)
    from pytest_qconform.session import instance_slice

    instance_slice.select(config, items)
    from pytest_qconform.benchmark import harness as bench

    bench.order_items(items)
    from pytest_qconform.session import heavy

    heavy.place_heavy(items, heavy.workers(config))  # one at the head of each worker's first share
    from pytest_qconform.session import known_failures

    known_failures.apply(config, items)
