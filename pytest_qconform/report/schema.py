"""Field checks of the run report schema: each names the field that is wrong and how.

Used by the reader of the report's top level and its probe, and by a benchmark's check of
its derived keys; the records themselves are read by pydantic (``records.py``). Every
message has the same shape: ``where.key: expected ..., got <type> <value>``.
"""

from __future__ import annotations

import datetime as _dt
import math
from collections.abc import Mapping
from typing import Any

DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm")
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


def string(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False, nonempty: bool = False) -> Any:
    value = required(data, key, where)
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        expected = "a string or null" if nullable else "a string"
        raise SchemaError(f"{where}.{key}: expected {expected}, got {type_name(value)} {value!r}")
    if nonempty and not value:
        raise SchemaError(f"{where}.{key}: must not be empty")
    return value


def boolean(data: Mapping[str, Any], key: str, where: str) -> bool:
    value = required(data, key, where)
    if not isinstance(value, bool):
        raise SchemaError(f"{where}.{key}: expected true or false, got {type_name(value)} {value!r}")
    return value


def json_object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {type_name(value)}")
    return value


def multiple_to_json(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf"


def validate_probe(probe: Any, where: str = "probe") -> dict[str, Any]:
    """Check the probe keys the report and matrix rely on (others are kept as written)."""
    data = json_object(probe, where)
    kind = string(data, "device_kind", where)
    if kind not in DEVICE_KINDS:
        raise SchemaError(f"{where}.device_kind: {kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    string(data, "arch", where, nonempty=True)
    string(data, "device_name", where)
    string(data, "host", where)
    string(data, "torch", where, nullable=True)
    string(data, "cuda", where, nullable=True)
    string(data, "hip", where, nullable=True)
    boolean(data, "simulated", where)
    backends = json_object(required(data, "backends", where), f"{where}.backends")
    for name, status in backends.items():
        entry = f"{where}.backends[{name!r}]"
        status = json_object(status, entry)
        boolean(status, "available", entry)
        string(status, "version", entry, nullable=True)
        string(status, "reason", entry)
    return dict(data)


def positive(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False) -> Any:
    value = required(data, key, where)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        expected = "a positive number or null" if nullable else "a positive number"
        raise SchemaError(f"{where}.{key}: expected {expected}, got {type_name(value)} {value!r}")
    return float(value)
