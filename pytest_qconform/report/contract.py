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

from pydantic.dataclasses import dataclass

from pytest_qconform.report.records import RECORD_CONFIG, EveryKeyWritten, Name, PositiveCount

SUITE_NAME = "pytest-qconform"
# Raise when the set of checks, a check's bound (reference/bounds.py, a multiple) or an axis a
# check covers changes; add a line to "Contract revisions" in docs/report-schema.md.
CONTRACT_REVISION = 15


@dataclass(frozen=True, config=RECORD_CONFIG)
class Suite(EveryKeyWritten):
    """What judged the run: the suite's name, package version and contract revision."""

    name: Name
    version: Name
    contract_revision: PositiveCount

    @property
    def label(self) -> str:
        return f"{self.name} {self.version}, contract revision {self.contract_revision}"


def current_suite() -> Suite:
    """The suite this process runs: what a report written now was judged against."""
    from pytest_qconform import __version__

    return Suite(SUITE_NAME, __version__, CONTRACT_REVISION)
