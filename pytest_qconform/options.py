"""The plugin's command-line options and ini settings, in one named group."""
from __future__ import annotations

import argparse
import os

import pytest

DTYPE_NAMES: tuple[str, ...] = ("bf16", "fp16", "fp32")
PROFILES: tuple[str, ...] = ("ci", "thorough")
BENCH_SHAPES: tuple[str, ...] = ("full", "small")


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("qconform", "pytest-qconform: 4-bit quantization conformance")
    group.addoption("--qconform", action="store_true", default=False,
                    help="run the conformance suites shipped with pytest-qconform (off: the plugin changes nothing)")
    group.addoption("--qconform-backend", action="append", default=[], metavar="NAME",
                    help="test only this backend (repeatable); default: every registered backend")
    group.addoption("--qconform-format", action="append", default=[], metavar="FORMAT",
                    help="test only this format: nf4, fp4 or hqq4 (repeatable)")
    group.addoption("--qconform-dtype", action="append", default=[], choices=DTYPE_NAMES,
                    help="test only this output/compute dtype (repeatable)")
    group.addoption("--qconform-profile", default=None, choices=PROFILES,
                    help="hypothesis profile: ci (fast, default) or thorough (nightly); ini qconform_profile")
    group.addoption("--qconform-report-dir", default=None, metavar="DIR",
                    help="folder for the run report JSON; ini qconform_report_dir (default: reports)")
    group.addoption("--qconform-no-report", action="store_true", default=False,
                    help="do not write a run report")
    group.addoption("--qconform-known-failures", action="append", default=[], metavar="FILE",
                    help="extra known-failures TOML file (repeatable), added to the packaged one")
    group.addoption("--qconform-simulate", default=os.environ.get("QCONFORM_SIMULATE") or None, metavar="ARCH",
                    help="TESTING AID: pretend the probe found ARCH (e.g. gfx1200) to test gating; "
                         "tests on it are skipped, nothing is computed on it (env QCONFORM_SIMULATE)")
    group.addoption("--qconform-bench-shapes", default="full", choices=BENCH_SHAPES,
                    help="weight shapes of the benchmark suite (run with --benchmark-only): full (4096x4096, "
                         "8192x8192, 14336x4096; skipped on the CPU, too slow) or small (the same shapes / 32, "
                         "which also run on the CPU)")
    group.addoption("--qconform-warmup-workers", type=_non_negative_int, default=None, metavar="N",
                    help="on a GPU, processes that compile our Triton kernels in the background while the "
                         "session runs (default: half the CPUs, at most 8 and one per 4 GiB of GPU memory; 0: off)")
    group.addoption("--qconform-record-kernel-calls", default=None, metavar="FILE",
                    help="MAINTAINERS: write the calls this run makes to our Triton kernels to FILE (the "
                         "warm-up's call log, see nox -s kernel-calls)")
    parser.addini("qconform_report_dir", "folder for run reports", default="reports")
    parser.addini("qconform_profile", "hypothesis profile (ci or thorough)", default="ci")
    parser.addini("qconform_backends", "backends to test (default: all)", type="args", default=[])
