"""The contract a run was judged against: the suite's version and its contract revision.

A verdict means something only together with what it was judged against: which checks
ran, with which bounds, over which axes. The package version alone does not say that (a
release may change docs only, a checkout between releases may change a bound), so the
contract has its own revision, ``CONTRACT_REVISION``, raised by hand whenever a change
alters what a verdict means. ``docs/report-schema.md`` ("Contract revisions") keeps the
changelog and the rule for when to raise it. Every report written records both, so the
matrix can say when it merges reports judged against different contracts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pytest_qconform.report.schema import SchemaError, json_object, required, string, type_name

SUITE_NAME = "pytest-qconform"
# Raise when the set of checks, a check's bound (reference/bounds.py, a multiple) or an axis a
# check covers changes; add a line to "Contract revisions" in docs/report-schema.md.
CONTRACT_REVISION = 5


@dataclass(frozen=True)
class Suite:
    """Which suite judged a report: its name, package version and contract revision."""

    name: str
    version: str
    contract_revision: int

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "version": self.version, "contract_revision": self.contract_revision}

    @classmethod
    def from_dict(cls, data: Any, where: str = "suite") -> Suite:
        data = json_object(data, where)
        revision = required(data, "contract_revision", where)
        if isinstance(revision, bool) or not isinstance(revision, int) or revision < 1:
            raise SchemaError(
                f"{where}.contract_revision: expected an integer >= 1, got {type_name(revision)} {revision!r}"
            )
        return cls(string(data, "name", where, nonempty=True), string(data, "version", where, nonempty=True), revision)

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}, contract revision {self.contract_revision}"


def current_suite() -> Suite:
    """The suite this process runs: what a report written now was judged against."""
    from pytest_qconform import __version__

    return Suite(SUITE_NAME, __version__, CONTRACT_REVISION)
