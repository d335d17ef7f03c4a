"""Field checks of the run report schema: each names the field that is wrong and how.

Used by the reader of the report's top level before its version's model reads the rest
(``run_report``, ``file_schema``); the records themselves are read by pydantic
(``records.py``). Every message has the same shape: ``where.key: expected ..., got <type> <value>``.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from typing import Any

CREATED_FORMAT = "%Y-%m-%dT%H:%M:%SZ"


class SchemaError(ValueError):
    """A dict does not follow the report schema; the message names the field."""


def parse_created(created: str) -> _dt.datetime:
    """``2025-01-31T12:00:00Z`` -> aware UTC datetime; anything else is a SchemaError."""
    if not isinstance(created, str) or not created.endswith("Z"):
        raise SchemaError(f"created: {created!r} is not a UTC ISO 8601 time like '2025-01-31T12:00:00Z'")
    for fmt in (CREATED_FORMAT, "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return _dt.datetime.strptime(created, fmt).replace(tzinfo=_dt.UTC)
        except ValueError:
            continue
    raise SchemaError(f"created: {created!r} is not a UTC ISO 8601 time like '2025-01-31T12:00:00Z'")


def type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def required(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise SchemaError(f"{where}: missing field {key!r}")
    return data[key]


def multiple_to_json(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf"
