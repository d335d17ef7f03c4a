"""The LICENSE pyproject.toml names, and a CHANGELOG that keeps up with the contract.

A report's verdicts mean something only with the contract revision that judged them; the
CHANGELOG is where a reader learns what each revision and schema version changed, so a
revision raised without a line there fails here.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from pytest_qconform.report.contract import CONTRACT_REVISION
from pytest_qconform.report.run_report import SCHEMA_VERSION

CHECKOUT = Path(__file__).resolve().parent.parent


def test_the_license_file_is_the_license_pyproject_names():
    """Both packages name it as an SPDX expression (setuptools >= 77; the table form is
    deprecated and refused from 2027-02-18)."""
    license_text = (CHECKOUT / "LICENSE").read_text(encoding="utf-8")
    for pyproject in (CHECKOUT / "pyproject.toml", CHECKOUT / "triton-nf4" / "pyproject.toml"):
        with pyproject.open("rb") as f:
            assert tomllib.load(f)["project"]["license"] == "Apache-2.0", pyproject
    assert "Apache License" in license_text and "Version 2.0, January 2004" in license_text
    assert "END OF TERMS AND CONDITIONS" in license_text


def _rows(changelog: str, heading: str) -> list[int]:
    """The numbers in the first column of the table under ``### heading``."""
    section = changelog.split(f"### {heading}\n")[1].split("\n### ")[0]
    return [int(m) for m in re.findall(r"^\| (\d+) \|", section, re.MULTILINE)]


def test_the_changelog_names_every_contract_revision_and_schema_version():
    changelog = (CHECKOUT / "CHANGELOG.md").read_text(encoding="utf-8")
    assert _rows(changelog, "Contract revisions") == list(range(CONTRACT_REVISION, 0, -1))
    assert _rows(changelog, "Report schema versions") == list(range(SCHEMA_VERSION, 0, -1))
