"""Known failures: a data file, not code. Matching tests are expected to fail, strictly.

Each entry is keyed by backend, backend version range (PEP 440), arch/family/kind and
check (the matrix operation), optionally narrowed by format, dtype and test-name globs.
A match marks the test ``xfail(strict=True)``: the failure shows as a known failure in
the matrix, and an unexpected pass fails the run so a fix upstream surfaces. A known
failure never hides a new one: only the listed check of the listed backend is marked.
"""
from __future__ import annotations

import fnmatch
import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import pytest
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from pytest_qconform import outcomes, state

REQUIRED = ("backend", "versions", "arch", "check", "reason", "link", "repro")
OPTIONAL = ("format", "dtype", "test")


class KnownFailuresError(pytest.UsageError):
    """A malformed known-failures file; the message names the file and line."""


@dataclass(frozen=True)
class KnownFailure:
    backend: str
    versions: SpecifierSet
    arch: str  # an arch, a family, a device kind, or "*"
    check: str
    reason: str
    link: str
    repro: str
    format: str = "*"
    dtype: str = "*"
    test: str = "*"
    source: str = ""

    def matches(self, key: dict[str, str], version: str | None, target_markers: tuple[str, ...],
                test_name: str) -> bool:
        if key["backend"] != self.backend or key["operation"] != self.check:
            return False
        if self.arch != "*" and self.arch not in target_markers:
            return False
        if not (fnmatch.fnmatch(key["format"], self.format) and fnmatch.fnmatch(key["dtype"], self.dtype)
                and fnmatch.fnmatch(test_name, self.test)):
            return False
        try:
            return version is not None and Version(version) in self.versions
        except InvalidVersion:
            return False


def _entry_lines(text: str) -> list[int]:
    return [n for n, line in enumerate(text.splitlines(), 1) if line.strip() == "[[failure]]"]


def parse(text: str, source: str) -> list[KnownFailure]:
    """Parse one known-failures TOML document; errors name ``source`` and the entry's line."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise KnownFailuresError(f"{source}: not valid TOML: {exc}") from None
    unknown_top = set(data) - {"failure"}
    if unknown_top:
        raise KnownFailuresError(f"{source}: unknown top-level key(s) {sorted(unknown_top)}; "
                                 "entries are [[failure]] tables")
    lines = _entry_lines(text)
    entries = []
    for index, raw in enumerate(data.get("failure", [])):
        where = f"{source}:{lines[index] if index < len(lines) else '?'}"
        missing = [k for k in REQUIRED if k not in raw]
        if missing:
            raise KnownFailuresError(f"{where}: known failure is missing {', '.join(missing)}")
        extra = sorted(set(raw) - set(REQUIRED) - set(OPTIONAL))
        if extra:
            raise KnownFailuresError(f"{where}: unknown key(s) {', '.join(extra)}; "
                                     f"allowed: {', '.join(REQUIRED + OPTIONAL)}")
        bad = [k for k, v in raw.items() if not isinstance(v, str) or not v.strip()]
        if bad:
            raise KnownFailuresError(f"{where}: {', '.join(bad)} must be non-empty strings")
        try:
            versions = SpecifierSet(raw["versions"])
        except InvalidSpecifier:
            raise KnownFailuresError(f"{where}: versions {raw['versions']!r} is not a PEP 440 range "
                                     "such as '>=0.2,<0.3'") from None
        entries.append(KnownFailure(
            backend=raw["backend"], versions=versions, arch=raw["arch"], check=raw["check"],
            reason=raw["reason"], link=raw["link"], repro=raw["repro"], format=raw.get("format", "*"),
            dtype=raw.get("dtype", "*"), test=raw.get("test", "*"), source=where))
    return entries


def load(extra_files: list[str]) -> list[KnownFailure]:
    """The packaged registry plus each runner's own files."""
    packaged = resources.files("pytest_qconform").joinpath("known_failures.toml")
    entries = parse(packaged.read_text(encoding="utf-8"), "pytest_qconform/known_failures.toml")
    for name in extra_files:
        path = Path(name)
        if not path.is_file():
            raise KnownFailuresError(f"--qconform-known-failures: no such file: {path}")
        entries += parse(path.read_text(encoding="utf-8"), str(path))
    return entries


def apply(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every item that a known failure matches as a strict expected failure."""
    entries = load(config.getoption("qconform_known_failures"))
    if not entries:
        return
    probe = state.probe(config)
    for item in items:
        props = dict(item.user_properties)
        key = props.get(outcomes.KEY_PROPERTY)
        if not key:
            continue
        status = probe.backend(key["backend"])
        target = item.callspec.params.get("qtarget")
        markers = target.marker_names if target is not None else ()
        for entry in entries:
            if entry.matches(key, status.version if status else None, markers, item.name):
                item.add_marker(pytest.mark.xfail(strict=True, reason=f"known failure ({entry.link}): {entry.reason}"))
                break
