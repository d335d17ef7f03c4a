"""The plugin's command-line options and ini settings, in one named group.

Values are checked where they are parsed: a natural spelling is accepted (any case,
``bfloat16`` for ``bf16``), anything else is a usage error naming the allowed values,
so a typo cannot select nothing and pass. Options given without ``--qconform`` are a
usage error too (``check_inactive``): without it the plugin does nothing, and a CI job
that forgot the flag must not end in a quiet "no tests ran".
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from typing import Any

import pytest

from pytest_qconform import vocabulary
from pytest_qconform.hardware.probe import SIMULATE_ENV

# Where a run's report goes unless --qconform-report-dir or the ini setting says otherwise: a
# local run is scratch, not evidence. reports/ holds only what someone chose to merge into the
# matrix, so a report gets there by a deliberate copy.
from pytest_qconform.report.storage import LOCAL_REPORT_DIR
from pytest_qconform.session import instance_slice
from pytest_qconform.vocabulary import DtypeLabel

DTYPE_NAMES: tuple[str, ...] = tuple(label.value for label in DtypeLabel)
# What --qconform-dtype also accepts: torch's names, with or without "torch.".
DTYPE_ALIASES: dict[str, str] = {
    **vocabulary.DTYPE_ALIASES,
    **{f"torch.{name}": label for name, label in vocabulary.DTYPE_ALIASES.items()},
}
FORMATS: tuple[str, ...] = ("nf4", "fp4", "hqq4")
PROFILES: tuple[str, ...] = ("ci", "thorough")
BENCH_SHAPES: tuple[str, ...] = ("full", "small")
AFTER_CRASH_RULES: tuple[str, ...] = ("operation", "backend", "continue")  # short_circuit.RULES
ACTIVATING_OPTION = "--qconform"


def choice(allowed: tuple[str, ...], aliases: dict[str, str] | None = None) -> Callable[[str], str]:
    """An argparse ``type``: the allowed value ``text`` names, in any case, or an error listing them."""

    def parse(text: str) -> str:
        key = text.strip().lower()
        value = (aliases or {}).get(key, key)
        if value not in allowed:
            raise argparse.ArgumentTypeError(f"{text!r} is not one of {', '.join(allowed)} (any case)")
        return value

    parse.__name__ = "value"  # argparse names the type in its message: "invalid value: ..."
    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a whole number >= 0, got {value}")
    return value


def _simulate_default() -> str | None:
    return os.environ.get(SIMULATE_ENV) or None


def _options() -> tuple[tuple[str, dict[str, Any]], ...]:
    """(flag, argparse keywords) of every option that only means something with --qconform."""
    return (
        (
            "--qconform-backend",
            dict(
                action="append",
                default=[],
                metavar="NAME",
                help="test only this backend (repeatable); default: every registered backend",
            ),
        ),
        (
            "--qconform-format",
            dict(
                action="append",
                default=[],
                metavar="FORMAT",
                type=choice(FORMATS),
                help="test only this format: nf4, fp4 or hqq4 (repeatable)",
            ),
        ),
        (
            "--qconform-dtype",
            dict(
                action="append",
                default=[],
                metavar="{bf16,fp16,fp32}",
                type=choice(DTYPE_NAMES, DTYPE_ALIASES),
                help="test only this output/compute dtype (repeatable; bfloat16, float16, float32 too)",
            ),
        ),
        (
            "--qconform-profile",
            dict(
                default=None,
                type=choice(PROFILES),
                metavar="{ci,thorough}",
                help="hypothesis profile: ci (fast, default) or thorough (nightly); ini qconform_profile",
            ),
        ),
        (
            "--qconform-slice",
            dict(
                default=None,
                type=instance_slice.parse,
                metavar="N/M[@KEY]",
                help="run part N of M parts of the instances (the M parts hold each instance once), "
                "chosen by a hash of KEY (default: today's UTC date) and each test id: a reproducible, "
                "daily rotated slice (e.g. of the thorough profile in a CPU job, or a GPU run split "
                "into calls); the summary says how many ran and how to replay the slice",
            ),
        ),
        (
            "--qconform-large",
            dict(
                action="store_true",
                default=False,
                help="also run the checks marked large (sizes real runs reach: 2^31-element weights; on a "
                "CPU, the rows ladder's top and K = 14336, N = 151936), in the same run and report as "
                "the rest; -m large runs only them",
            ),
        ),
        (
            "--qconform-hypothesis-db",
            dict(
                default=None,
                metavar="PATH",
                help="hypothesis example database folder: failing examples are saved "
                "there and replayed first in later runs (keep it between CI runs); "
                "the draws then vary per run. 'none': no database. ini "
                "qconform_hypothesis_db (default: none for ci, "
                "<rootdir>/.hypothesis/examples for thorough)",
            ),
        ),
        (
            "--qconform-report-dir",
            dict(
                default=None,
                metavar="DIR",
                help="folder for the run report JSON; ini qconform_report_dir (default: "
                f"{LOCAL_REPORT_DIR}, which ignores itself in git). CI: a fresh folder "
                "per job",
            ),
        ),
        ("--qconform-no-report", dict(action="store_true", default=False, help="do not write a run report")),
        (
            "--qconform-known-failures",
            dict(
                action="append",
                default=[],
                metavar="FILE",
                help="extra known-failures TOML file (repeatable), added to the packaged one",
            ),
        ),
        (
            "--qconform-simulate",
            dict(
                default=_simulate_default(),
                metavar="ARCH",
                help="TESTING AID: pretend the probe found ARCH (e.g. gfx1200) to test gating; "
                "tests on it are skipped, nothing is computed on it (env "
                "QCONFORM_SIMULATE)",
            ),
        ),
        (
            "--qconform-bench-shapes",
            dict(
                default="full",
                type=choice(BENCH_SHAPES),
                metavar="{full,small}",
                help="weight shapes of the benchmark suite (run with --benchmark-only): "
                "full (4096x4096, 8192x8192, 14336x4096; skipped on the CPU, too slow) "
                "or small (the same shapes / 32, which also run on the CPU)",
            ),
        ),
        (
            "--qconform-warmup-workers",
            dict(
                type=_non_negative_int,
                default=None,
                metavar="N",
                help="processes that warm caches in the background while the session "
                "runs: a backend's kernel compiles on a GPU (triton-nf4: default half the "
                "CPUs, at most 8 and one per 4 GiB of GPU memory), inductor's vector-ISA "
                "check on a CPU; 0: none of them",
            ),
        ),
        (
            "--qconform-after-crash",
            dict(
                default=None,
                type=choice(AFTER_CRASH_RULES),
                metavar="{operation,backend,continue}",
                help="after a backend crashes or times out: end its remaining tests of "
                "that operation at once with the same verdict (operation, default), "
                "all its remaining tests (backend), or run them all (continue)",
            ),
        ),
        (
            "--qconform-record-gemlite-configs",
            dict(
                default=None,
                metavar="FILE",
                help="MAINTAINERS: on a GPU, write the configs gemlite's autotune "
                "chooses in this run to FILE (see nox -s gemlite-configs)",
            ),
        ),
    )


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def check_inactive(config: pytest.Config) -> None:
    """Refuse plugin options given without ``--qconform`` (they would do nothing)."""
    given = [flag for flag, kwargs in _options() if config.getoption(_dest(flag)) != kwargs.get("default")]
    if given:
        raise pytest.UsageError(
            f"{', '.join(given)} {'only works' if len(given) == 1 else 'only work'} with {ACTIVATING_OPTION}, "
            "which is missing: without it pytest-qconform "
            f"runs nothing. Add {ACTIVATING_OPTION} to run the conformance suites, or drop "
            + ("the option." if len(given) == 1 else "the options.")
        )


# Options whose value is a path. pytest chooses its rootdir before any plugin's options are
# known, so in ``--qconform-report-dir DIR`` it takes DIR for a test path (where DIR exists) and
# makes it the rootdir: the ini file is then not read, and the cache and the hypothesis
# database move into DIR. ``--qconform-report-dir=DIR`` is one token and moves nothing.
PATH_METAVARS = frozenset({"PATH", "DIR", "FILE"})


def check_path_values_are_attached(config: pytest.Config) -> None:
    """Refuse a path option given as two tokens (``--qconform-report-dir DIR``): it moves
    pytest's rootdir when DIR exists, so whether it does depends on the machine's state.
    Refused always, the error says how to write it."""
    args = list(config.invocation_params.args)
    spaced = [
        (flag, args[i + 1])
        for flag, kwargs in _options()
        if kwargs.get("metavar") in PATH_METAVARS
        for i, token in enumerate(args[:-1])
        if token == flag
    ]
    if spaced:
        flag, value = spaced[0]
        raise pytest.UsageError(
            f"{flag} {value}: write {flag}={value}. Given as two words, pytest reads {value!r} as a "
            "test path when it chooses its rootdir (before plugin options are known), so once that "
            f"folder exists the rootdir moves there (this run's: {config.rootpath}), the ini file "
            "is not read and the cache and hypothesis' example database move with it"
        )


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("qconform", "pytest-qconform: 4-bit quantization conformance")
    group.addoption(
        ACTIVATING_OPTION,
        action="store_true",
        default=False,
        help="run the conformance suites shipped with pytest-qconform (off: the plugin changes nothing)",
    )
    for flag, kwargs in _options():
        group.addoption(flag, **kwargs)
    parser.addini("qconform_report_dir", "folder for run reports", default=LOCAL_REPORT_DIR)
    parser.addini("qconform_profile", "hypothesis profile (ci or thorough)", default="ci")
    parser.addini(
        "qconform_hypothesis_db", "hypothesis example database folder, relative to the rootdir, or none", default=""
    )
    parser.addini("qconform_backends", "backends to test (default: all)", type="args", default=[])
