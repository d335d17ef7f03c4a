"""Which versions a cell was computed with, and how two versions compare.

A report's cells were all computed in one process, so the report's probe holds the
versions of every cell exactly: the backend library's own (``probe.backends[name]``),
torch, Triton, the CUDA or HIP runtime torch was built with, and the GPU driver where the
probe found it. Cells refer to their report instead of repeating them.

Versions compare as PEP 440 versions (``0.49.2 < 0.50.0 < 0.50.0.dev0+rocm`` is not
assumed: ``packaging`` decides); a version that does not parse sorts before every one
that does, by its text, so an odd build string never hides a floor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from packaging.version import InvalidVersion, Version

from pytest_qconform.report.run_report import RunReport

# The probe's own version fields, in the order a reader wants them.
PROBE_KEYS: tuple[str, ...] = ("torch", "triton", "cuda", "hip", "driver")


def backend_version(report: RunReport, backend: str) -> str | None:
    """The backend library's version in ``report`` (None: not recorded or not loaded)."""
    status = report.probe["backends"].get(backend)
    return status.get("version") if isinstance(status, dict) else None


def cell_versions(report: RunReport, backend: str) -> dict[str, str | None]:
    """Every version a cell of ``backend`` in ``report`` was computed with: the backend's
    own first, then the probe's (``PROBE_KEYS``), absent ones as None."""
    found: dict[str, str | None] = {backend: backend_version(report, backend)}
    for key in PROBE_KEYS:
        value = report.probe.get(key)
        found.setdefault(key, None if value is None else str(value))
    return found


def version_key(text: str | None) -> tuple[Any, ...]:
    """Sort key: unknown first, then unparseable (by text), then PEP 440 order."""
    if text is None:
        return (0, "", Version("0"))
    try:
        return (2, "", Version(text))
    except InvalidVersion:
        return (1, text, Version("0"))


def at_least(found: str | None, minimum: str) -> bool:
    """Whether ``found`` is ``minimum`` or newer; an unknown or unparseable version is not."""
    return version_key(found)[0] == 2 and version_key(found) >= version_key(minimum)


@dataclass(frozen=True)
class MinVersion:
    """``PACKAGE=VERSION``: only cells computed with at least that version count.

    ``package`` is a backend name (its library version; the requirement applies to that
    backend's cells) or one of the probe's ``PROBE_KEYS`` (applies to every cell).
    """

    package: str
    version: str

    @classmethod
    def parse(cls, text: str) -> MinVersion:
        package, sep, version = text.partition("=")
        package, version = package.strip(), version.strip().lstrip("=")
        if not sep or not package or not version:
            raise ValueError(
                f"--min-version {text!r}: expected PACKAGE=VERSION, e.g. bitsandbytes=0.50.0 or "
                f"torch=2.5 (PACKAGE: a backend name or one of {', '.join(PROBE_KEYS)})"
            )
        try:
            Version(version)
        except InvalidVersion as exc:
            raise ValueError(f"--min-version {text!r}: {version!r} is not a version (PEP 440, e.g. 0.50.0)") from exc
        return cls(package, version)

    @property
    def text(self) -> str:
        return f"{self.package} >= {self.version}"

    def applies_to(self, backend: str) -> bool:
        return self.package in PROBE_KEYS or self.package == backend

    def found_in(self, report: RunReport) -> str | None:
        """The version of ``package`` that ``report`` was computed with."""
        if self.package in PROBE_KEYS:
            value = report.probe.get(self.package)
            return None if value is None else str(value)
        return backend_version(report, self.package)

    def met_by(self, report: RunReport, backend: str) -> bool:
        """Whether ``backend``'s cells in ``report`` count under this requirement."""
        return not self.applies_to(backend) or at_least(self.found_in(report), self.version)
