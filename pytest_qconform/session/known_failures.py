"""Known failures: a data file, not code. Matching tests are expected to fail, strictly.

Each entry is keyed by backend, backend version range (PEP 440), arch/family/kind and
check (the matrix operation), optionally narrowed by format, dtype and test-name globs.
A match marks the test ``xfail(strict=True)``: the failure shows as ``known-failure``
in the matrix, and an unexpected pass is a ``fail`` of the run (the message says it
passed unexpectedly) so a fix upstream surfaces and the entry gets removed. An entry with a
``message`` (a regular expression) names a condition of the values a test draws instead:
its instances are expected failures only when they fail with a matching message, and
their passes are passes (``judge_by_message``). A known
failure never hides a new one: only the listed check of the listed backend is marked.

The files are read once, at start-up (``read_at_startup``): a malformed entry stops the run
before anything is computed, with the file and line of the offending key. An entry
for a backend this runner does not have is fine (a shared file lists every runner's
failures); it simply matches nothing here.
"""

from __future__ import annotations

import fnmatch
import re
import tomllib
from collections.abc import Generator
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pytest_qconform.hardware.targets import hardware_marker_names
from pytest_qconform.session import outcomes, stale_known_failures, state
from pytest_qconform.vocabulary import CaseKey

PACKAGED = "pytest_qconform/session/known_failures.toml"
REQUIRED = ("backend", "versions", "arch", "check", "reason", "link", "repro")
OPTIONAL = ("format", "dtype", "test", "cpu_capability", "ends_process", "message", "profile")
PROFILES = ("ci", "thorough")
ANY = "*"

# This module's own session state: the entries read at start-up (kept here, beside the
# record it holds, so that state.py need not import this module).
ENTRIES = pytest.StashKey["tuple[KnownFailure, ...]"]()

_HEADER = re.compile(r"^\s*\[\[\s*failure\s*\]\]\s*(#.*)?$")
_TOML_POSITION = re.compile(r"\(at line (\d+), column \d+\)")


class KnownFailuresError(pytest.UsageError):  # type: ignore[misc]  # pytest marks it final; we want its exit code
    """A malformed known-failures file; the message names the file and line."""


@dataclass(frozen=True)
class KnownFailure:
    """One known failure: which tests it covers, why they fail, and how to see it fail."""

    backend: str
    versions: SpecifierSet
    arch: str  # an arch, a family, a device kind, a CPU machine type, or "*"
    check: str
    reason: str
    link: str
    repro: str
    format: str = ANY
    dtype: str = ANY
    test: str = ANY
    cpu_capability: str = ANY  # glob on torch's CPU capability; narrows CPU targets only
    # "yes": the failure ends the process (a library that calls exit()), so the test is
    # reported as a known failure without being run: run, it would take the session down.
    ends_process: str = "no"
    # A regular expression the failure's message must match (``re.search``): for a condition of
    # the values a test draws (not of its instance), see ``apply``. Empty: every failure.
    message: str = ""
    # The hypothesis profile whose instances the entry is written for ("thorough": its test
    # ids exist in that profile's draws only); a run of another profile does not judge it
    # stale (``stale_known_failures``). Matching does not read it.
    profile: str = ANY
    source: str = ""  # "file:line" of the entry, for messages

    def matches(
        self,
        key: CaseKey,
        version: str | None,
        target_markers: tuple[str, ...],
        test_name: str,
        cpu_capability: str | None = None,
    ) -> bool:
        """Whether a test with cell ``key`` on a target with ``target_markers`` is covered.

        Pre-releases and dev builds count as inside a range (``0.46.0.dev0`` matches
        ``>=0.45``): GPU runners often test such builds, and they fail the same way.
        """
        if key.backend != self.backend or not self.covers_check(key.operation):
            return False
        if self.arch != ANY and self.arch not in target_markers:
            return False
        if self.cpu_capability != ANY and not (
            "cpu" in target_markers
            and cpu_capability is not None
            and fnmatch.fnmatchcase(cpu_capability, self.cpu_capability)
        ):
            return False
        if not (_glob(key.format, self.format) and _glob(key.dtype, self.dtype) and _glob(test_name, self.test)):
            return False
        return self.covers_version(version)

    def covers_check(self, operation: str) -> bool:
        return _glob(operation, self.check)

    def covers_version(self, version: str | None) -> bool:
        if version is None:
            return False
        try:
            return self.versions.contains(Version(version), prereleases=True)
        except InvalidVersion:
            return False

    def xfail_reason(self) -> str:
        return f"known failure ({self.link}): {self.reason} [{self.source}]"


def _glob(text: str, pattern: str) -> bool:
    """``fnmatch`` with ``|`` between alternatives (``"*-b256*|*-b512*"``): a failure whose
    cells are not one glob is still one entry with one repro."""
    return any(fnmatch.fnmatchcase(text, alternative) for alternative in pattern.split("|"))


def _entry_spans(lines: list[str]) -> list[tuple[int, int]]:
    """(first, last) 1-based line numbers of each ``[[failure]]`` table, in order."""
    starts = [n for n, line in enumerate(lines, 1) if _HEADER.match(line)]
    ends = [s - 1 for s in starts[1:]] + [len(lines)]
    return list(zip(starts, ends))


def _key_line(lines: list[str], span: tuple[int, int], key: str) -> int:
    """The line of ``key = ...`` inside an entry, else the entry's header line."""
    pattern = re.compile(rf"^\s*(?:{re.escape(key)}|\"{re.escape(key)}\"|'{re.escape(key)}')\s*=")
    for n in range(span[0], span[1] + 1):
        if pattern.match(lines[n - 1]):
            return n
    return span[0]


def _known_arches() -> set[str]:
    return set(hardware_marker_names()) | {ANY}


def _parse_entry(raw: dict, source: str, lines: list[str], span: tuple[int, int]) -> KnownFailure:
    def where(key: str | None = None) -> str:
        return f"{source}:{_key_line(lines, span, key) if key else span[0]}"

    missing = [k for k in REQUIRED if k not in raw]
    if missing:
        raise KnownFailuresError(
            f"{where()}: known failure is missing {', '.join(missing)}; every entry needs {', '.join(REQUIRED)}"
        )
    for key in raw:
        if key not in REQUIRED + OPTIONAL:
            raise KnownFailuresError(f"{where(key)}: unknown key {key!r}; allowed: {', '.join(REQUIRED + OPTIONAL)}")
    for key, value in raw.items():
        if not isinstance(value, str) or not value.strip():
            raise KnownFailuresError(f"{where(key)}: {key} must be a non-empty string, got {value!r}")
    if raw.get("ends_process", "no") not in ("yes", "no"):
        raise KnownFailuresError(
            f'{where("ends_process")}: ends_process must be "yes" or "no", got {raw["ends_process"]!r}'
        )
    if raw.get("profile", ANY) not in (ANY, *PROFILES):
        raise KnownFailuresError(
            f"{where('profile')}: profile must be one of {', '.join(PROFILES)} (or '*'), got {raw['profile']!r}"
        )
    try:
        versions = SpecifierSet("" if raw["versions"].strip() == ANY else raw["versions"])
    except InvalidSpecifier:
        raise KnownFailuresError(
            f"{where('versions')}: versions {raw['versions']!r} is not a PEP 440 range "
            "such as '>=0.2,<0.3' (or '*' for every version)"
        ) from None
    if raw["arch"] not in _known_arches():
        raise KnownFailuresError(
            f"{where('arch')}: arch {raw['arch']!r} is not a known arch, family, device kind or CPU machine; "
            f"use one of: {', '.join(sorted(_known_arches()))}"
        )
    return KnownFailure(
        backend=raw["backend"],
        versions=versions,
        arch=raw["arch"],
        check=raw["check"],
        reason=raw["reason"],
        link=raw["link"],
        repro=raw["repro"],
        format=raw.get("format", ANY),
        dtype=raw.get("dtype", ANY),
        test=raw.get("test", ANY),
        cpu_capability=raw.get("cpu_capability", ANY),
        ends_process=raw.get("ends_process", "no"),
        message=_pattern(raw.get("message", ""), where("message")),
        profile=raw.get("profile", ANY),
        source=where(),
    )


def _pattern(text: str, where: str) -> str:
    try:
        re.compile(text)
    except re.error as exc:
        raise KnownFailuresError(f"{where}: message {text!r} is not a regular expression: {exc}") from None
    return text


def parse(text: str, source: str) -> tuple[KnownFailure, ...]:
    """Parse one known-failures TOML document; errors name ``source`` and the line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        found = _TOML_POSITION.search(str(exc))
        line = f":{found.group(1)}" if found else ""
        raise KnownFailuresError(f"{source}{line}: not valid TOML: {exc}") from None
    unknown_top = sorted(set(data) - {"failure"})
    if unknown_top:
        raise KnownFailuresError(
            f"{source}: unknown top-level key(s) {', '.join(map(repr, unknown_top))}; "
            "write each entry as a [[failure]] table"
        )
    raw_entries = data.get("failure", [])
    if not isinstance(raw_entries, list):
        raise KnownFailuresError(f"{source}: 'failure' must be an array of tables: write [[failure]], not [failure]")
    lines = text.splitlines()
    spans = _entry_spans(lines)
    if len(spans) != len(raw_entries):
        # Inline arrays (failure = [{...}]) parse, but leave no line per entry to point at.
        raise KnownFailuresError(
            f"{source}: write each known failure as its own [[failure]] table (one per entry, not an inline array)"
        )
    return tuple(_parse_entry(raw, source, lines, span) for raw, span in zip(raw_entries, spans))


def load(extra_files: list[str] | tuple[str, ...]) -> tuple[KnownFailure, ...]:
    """The packaged registry plus each runner's own files (``--qconform-known-failures``)."""
    packaged = resources.files("pytest_qconform.session").joinpath("known_failures.toml")
    entries = parse(packaged.read_text(encoding="utf-8"), PACKAGED)
    for name in extra_files:
        path = Path(name)
        if not path.is_file():
            raise KnownFailuresError(f"--qconform-known-failures: no such file: {path} (resolved to {path.resolve()})")
        entries += parse(path.read_text(encoding="utf-8"), str(path))
    return entries


def read_at_startup(config: pytest.Config) -> None:
    """Read every known-failures file at start-up, so a malformed one stops the run early."""
    config.stash[ENTRIES] = load(config.getoption("qconform_known_failures"))


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every item that a known failure matches as a strict expected failure; remember the
    entries that could have matched here and marked nothing (``stale_known_failures``)."""
    entries = config.stash.get(ENTRIES, None)
    if entries is None:
        entries = load(config.getoption("qconform_known_failures"))
    if not entries:
        return
    probe = state.probe(config)
    matched: set[int] = set()
    ran: set[tuple[str, str]] = set()
    for item in items:
        key = outcomes.case_key_of(item)
        if key is None:
            continue
        ran.add((key.backend, key.operation))
        status = probe.backend(key.backend)
        callspec = getattr(item, "callspec", None)
        target = callspec.params.get("qtarget") if callspec is not None else None
        # A test with no device parameter runs on the probe's device.
        markers = (
            target.marker_names
            if target is not None
            else tuple(m for m in (probe.device_kind, probe.arch, probe.family) if m)
        )
        covering = [
            i
            for i, entry in enumerate(entries)
            if entry.matches(key, status.version if status else None, markers, item.name, probe.cpu_capability)
        ]
        if not covering:
            continue
        # The first entry marks the test. The others covered it too, so none of them is stale:
        # an entry for every CPU (Linear4bit's in-place load) is not stale on an AVX512 CPU, where
        # an earlier entry for that CPU's kernels takes the same test.
        matched.update(covering)
        entry = entries[covering[0]]
        item.add_marker(
            pytest.mark.xfail(strict=not entry.message, reason=entry.xfail_reason(), run=entry.ends_process != "yes")
        )
        if entry.message:
            item.stash[_MESSAGE] = entry.message
        item.repr_failure = _native_repr_failure(item)  # type: ignore[method-assign]
    stale_known_failures.remember(config, stale_known_failures.find(config, entries, matched, ran))


def _native_repr_failure(item: pytest.Item):
    """``repr_failure`` for a known failure: its traceback as Python formats it.

    pytest's default style parses the source of every frame to show whole statements:
    100-500 ms a failure whose traceback runs through transformers or torch (4.6 s of a
    CPU run with 42 known failures, measured). A known failure that fails as listed is
    reported with its reason only, so nobody reads that traceback; an unexpected pass
    has no traceback, and a failure in a fixture is formatted by pytest as usual."""

    def repr_failure(excinfo: pytest.ExceptionInfo[BaseException], style: str | None = None):
        return item._repr_failure_py(excinfo, style="native")

    return repr_failure


_MESSAGE = pytest.StashKey[str]()


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """Registered as a plugin under ``--qconform``: known failures scoped by their failure's
    message, judged on the report pytest's xfail handling made (a ``tryfirst`` wrapper's
    code after its ``yield`` runs last)."""
    report = yield
    judge_by_message(item, call, report)
    return report


def judge_by_message(item: pytest.Item, call: pytest.CallInfo, report: pytest.TestReport) -> None:
    """An entry with a ``message`` names a condition of the values a test draws, which the
    test's id cannot say (hypothesis draws other values in each profile): its instance is an
    expected failure only when it fails with a message that matches. A failure with another
    message stays a failure (with its own traceback), and a pass is a pass: the condition was
    not drawn, which is no sign of a fix."""
    pattern = item.stash.get(_MESSAGE, None)
    if pattern is None or report.when != "call" or not hasattr(report, "wasxfail"):
        return
    if report.passed:
        del report.wasxfail
    elif report.skipped and call.excinfo is not None and not re.search(pattern, str(call.excinfo.value)):
        del report.wasxfail
        report.outcome = "failed"
        report.longrepr = item.repr_failure(call.excinfo)
