"""Census of the Triton kernel variants a run of the suites compiles (a pytest plugin).

Why: a cold conformance run on the H100 took 59.5-73.6 s in tests, a warm one 19.6 s
(bench/notes.md "Compile census"). Triton compiles one variant per distinct key: the
constexprs, the argument dtypes, and each integer argument's class (equal to 1, a multiple
of 16, other) unless the kernel lists it in ``do_not_specialize``. This plugin counts them.

- Every launch of the package's kernels: the key Triton would form from its arguments
  (recorded by a stand-in for each kernel), counted per kernel. On a GPU these are the
  GPU's own launches; under the interpreter (CPU) the interpreter's tiles and flags
  (BF16_BITS, PREFETCH, SHUFFLE) differ from the GPU's, so there the count is a census of
  the shapes the suites draw, not of a GPU's variants.
- The stand-ins do not change which paths run: the kernels read their interpreter mode
  once, when defined. (Before 2026-11-23 they read it from the kernel object at every
  call, and a census on the H100 measured the interpreter's paths; bench/notes.md
  "Compile census", correction.)
- On a GPU also: the seconds of every Triton compile (``triton.compiler.compile``, which a
  kernel looks up when it first launches on a device) and of every C launcher Triton
  builds for a new signature. Run with an empty ``TRITON_CACHE_DIR`` for a cold run's cost.

Usage (from the repository root; the suites are collected from the installed package):

    PYTHONPATH=bench python -m pytest --qconform -p compile_census --census-out census.json

The summary is printed at the end of the run and written to ``--census-out``.
"""

from __future__ import annotations

import collections
import json
import time
from pathlib import Path

import pytest
import torch

CENSUS_KEY = pytest.StashKey[dict]()
KERNEL_MODULES = (
    "qconform_triton_nf4.kernels.nf4_dequant",
    "qconform_triton_nf4.kernels.nf4_gemv",
    "qconform_triton_nf4.kernels.nf4_mma",
)


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--census-out", default="compile-census.json", help="where compile_census writes its JSON")


def _argument_class(name: str, value: object, not_specialized: set[str]) -> str:
    """How Triton keys one argument: dtype and 16-byte alignment of a tensor, the class of
    an int (``1``, ``d16`` for a multiple of 16, ``i``), the type of anything else."""
    if isinstance(value, torch.Tensor):
        return f"{name}:*{value.dtype}:{'a16' if value.data_ptr() % 16 == 0 else 'a'}"
    if isinstance(value, bool) or not isinstance(value, int) or name in not_specialized:
        return f"{name}:{type(value).__name__}"
    return f"{name}:{'1' if value == 1 else 'd16' if value % 16 == 0 else 'i'}"


class _KeyRecorder:
    """Stands in for a kernel (compiled or interpreted): records each launch's key, then
    launches. BF16_BITS is left out: only the interpreter sets it (the GPU rounds bf16 itself)."""

    def __init__(self, kernel, name: str, not_specialized: set[str], keys: collections.Counter) -> None:
        self.kernel, self.name, self.not_specialized, self.keys = kernel, name, not_specialized, keys

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            key = [self.name] + [
                _argument_class(n, a, self.not_specialized) for n, a in zip(self.kernel.arg_names, args)
            ]
            key += [f"{k}={v}" for k, v in sorted(kwargs.items()) if k != "BF16_BITS"]
            self.keys["|".join(key)] += 1
            return launch(*args, **kwargs)

        return run


def _timed(function, name: str, log: list[dict]):
    """``function`` wrapped to log its seconds under ``name`` (for a compile: the kernel's)."""

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            label = getattr(args[0], "name", name) if name == "compile" and args else name
            log.append({"name": label, "seconds": round(time.perf_counter() - start, 4)})

    return timed


@pytest.hookimpl(trylast=True)
def pytest_configure(config: pytest.Config) -> None:
    import importlib

    import triton.compiler
    import triton.runtime.build as triton_build

    from qconform_triton_nf4.kernels import interpreter_active

    census = {
        "compiles": [],
        "launchers": [],
        "keys": collections.Counter(),
        "mode": "interpreted" if interpreter_active() else "compiled",
    }
    config.stash[CENSUS_KEY] = census
    for module_name in KERNEL_MODULES:
        module = importlib.import_module(module_name)
        for attr, kernel in vars(module).items():
            if attr.startswith("_") and attr.endswith("_kernel"):
                setattr(module, attr, _KeyRecorder(kernel, attr, _declared_not_specialized(kernel), census["keys"]))
    if census["mode"] == "compiled":
        # A JITFunction looks ``compile`` up in triton.compiler when it first launches on a
        # device (Triton 3.6 ``create_binder``), so wrapping it there times every compile.
        triton.compiler.compile = _timed(triton.compiler.compile, "compile", census["compiles"])
    if hasattr(triton_build, "_build"):  # Triton 3.6 and 3.9 build C launchers through it
        triton_build._build = _timed(triton_build._build, "launcher", census["launchers"])


def _declared_not_specialized(kernel) -> set[str]:
    """The kernel's ``do_not_specialize`` as argument names: a JITFunction holds the list
    (names or indices), the interpreter's InterpretedFunction keeps the decorator's keywords."""
    declared = getattr(kernel, "do_not_specialize", None) or kernel.__dict__.get("kwargs", {}).get("do_not_specialize")
    return {kernel.arg_names[d] if isinstance(d, int) else d for d in declared or ()}


def summary(census: dict) -> dict:
    """Counts and seconds per kernel, JSON-ready."""
    per_kernel: dict[str, dict] = {}
    for entry in census["compiles"]:
        row = per_kernel.setdefault(entry["name"], {"compiles": 0, "seconds": 0.0})
        row["compiles"] += 1
        row["seconds"] = round(row["seconds"] + entry["seconds"], 3)
    keys_per_kernel = collections.Counter(key.split("|")[0] for key in census["keys"])
    return {
        "mode": census["mode"],
        "compiled": per_kernel,
        "launcher_builds": len(census["launchers"]),
        "launcher_seconds": round(sum(e["seconds"] for e in census["launchers"]), 3),
        "launch_keys": dict(keys_per_kernel),
        "launches": sum(census["keys"].values()),
    }


def pytest_terminal_summary(terminalreporter, config: pytest.Config) -> None:
    census = config.stash.get(CENSUS_KEY, None)
    if census is None:
        return
    result = summary(census)
    Path(config.getoption("--census-out")).write_text(json.dumps({**result, "keys": sorted(census["keys"])}, indent=1))
    terminalreporter.section("compile census")
    for name, count in sorted(result["launch_keys"].items()):
        terminalreporter.write_line(f"{name}: {count} distinct keys launched")
    if result["mode"] == "compiled":
        for name, row in sorted(result["compiled"].items()):
            terminalreporter.write_line(f"compiled {name}: {row['compiles']} times, {row['seconds']:.1f} s")
        terminalreporter.write_line(f"launchers: {result['launcher_builds']} built, {result['launcher_seconds']:.1f} s")
    terminalreporter.write_line(f"written to {config.getoption('--census-out')}")
