"""The run report's published JSON Schema: generated from ``file_schema``, shipped in the
package (``report.schema.json``) and in ``docs/``, and used to validate a report file.

A downstream tool validates reports with any JSON Schema validator and the shipped file;
``python -m pytest_qconform check`` validates with the same models the file is generated
from, and names the first violation (where in the file, and why). Regenerate both copies
after changing a model: ``python -m pytest_qconform.report.published_schema docs/report.schema.json``
(``tests/test_report_schema.py`` fails while a committed copy differs from what this gives).
"""

from __future__ import annotations

import json
import sys
from functools import cache
from pathlib import Path
from typing import Any

SCHEMA_FILE = Path(__file__).with_name("report.schema.json")  # package data
DIALECT = "https://json-schema.org/draft/2020-12/schema"


@cache
def _adapter() -> Any:
    # pydantic is imported only when a report is validated or the schema generated.
    from pydantic import TypeAdapter

    from pytest_qconform.report.file_schema import ReportFile

    return TypeAdapter(ReportFile)


def generate() -> str:
    """The JSON Schema text, as committed (keys sorted, 2-space indent, one final newline)."""
    schema = _adapter().json_schema(by_alias=True, mode="serialization")
    document = {
        "$schema": DIALECT,
        "title": "pytest-qconform run report",
        "description": "One pytest --qconform run: its probe, cells and optional sections "
        "(docs/report-schema.md). Generated from pytest_qconform/report/file_schema.py.",
        **schema,
    }
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def _where(loc: tuple[Any, ...]) -> str:
    """``(3, 'cells', 0, 'verdict')`` -> ``cells[0].verdict``: the path as the readers name
    fields, without the schema version pydantic puts first in the errors of a report's body
    (the union of versions is tagged by it; an error in the tag itself has no location)."""
    text = ""
    for part in loc[1:]:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or "top level"


def violation(text: str) -> str | None:
    """The first way a report's JSON ``text`` breaks the published schema (``cells[0].verdict:
    Input should be ...``), or None when it validates."""
    from pydantic import ValidationError

    try:
        _adapter().validate_json(text)  # strict where the records say so (records.py: Strict())
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "union_tag_not_found":
            return "top level: missing field 'schema_version'"
        given = first.get("input")
        got = f", got {given!r}" if given is None or isinstance(given, (str, int, float, bool)) else ""
        return f"{_where(first['loc'])}: {first['msg']}{got}"
    return None


def main(argv: list[str] | None = None) -> int:
    """Write the schema into the package and into each path given (``docs/report.schema.json``)."""
    text = generate()
    for path in [SCHEMA_FILE, *map(Path, sys.argv[1:] if argv is None else argv)]:
        path.write_text(text, encoding="utf-8")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
