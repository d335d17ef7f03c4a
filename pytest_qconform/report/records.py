"""How the report's records are read and written: by pydantic, from their declared fields.

A record of the report is a pydantic dataclass whose fields say their JSON types and
bounds (``Name``, ``Count``, ...), so one declaration gives the record, its reader, its
writer and its part of the published JSON Schema (``file_schema``); no record keeps a
hand-written ``to_dict``/``from_dict`` beside its fields. ``load`` names a malformed field
the way the report's other readers do (``calls[0].seen: ...``), so the matrix and the gate
say which file and which field.
"""

from __future__ import annotations

from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import ConfigDict, Field, Strict, TypeAdapter, ValidationError

from pytest_qconform.report.schema import SchemaError, type_name

T = TypeVar("T")

# A record holds exactly the keys its writer writes, and finite numbers only (strict JSON).
RECORD_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False)
Name = Annotated[str, Strict(), Field(min_length=1)]
Text = Annotated[str, Strict()]
Count = Annotated[int, Strict(), Field(ge=0)]
PositiveCount = Annotated[int, Strict(), Field(ge=1)]


@cache
def _adapter(cls: Any) -> TypeAdapter[Any]:
    return TypeAdapter(cls)


def _as_key(cls: type) -> Any:
    """A record class as the adapters' cache key (a class is hashable; mypy's cache stub asks so)."""
    return cls


def _path(where: str, loc: tuple[Any, ...]) -> str:
    text = where
    for part in loc:
        text += f"[{part!r}]" if isinstance(part, int) or " " in str(part) else f".{part}"
    return text


def load(cls: type[T], data: Any, where: str) -> T:
    """``cls`` read from its JSON value; a SchemaError names the first wrong field."""
    try:
        record: T = _adapter(_as_key(cls)).validate_python(data)
        return record
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        loc = tuple(first["loc"])
        if first["type"] == "missing":
            raise SchemaError(f"{_path(where, loc[:-1])}: missing field {loc[-1]!r}") from None
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            raise SchemaError(f"{_path(where, loc)}: not a field of this record") from None
        given = first.get("input")
        if first["type"] in ("dataclass_type", "dict_type", "model_type"):
            raise SchemaError(f"{_path(where, loc)}: expected a JSON object, got {type_name(given)}") from None
        got = "null" if given is None else f"{type_name(given)} {given!r}"
        raise SchemaError(f"{_path(where, loc)}: {first['msg']}, got {got}") from None


def dump(record: Any) -> dict[str, Any]:
    """The record's JSON value, as the report file holds it."""
    data: dict[str, Any] = _adapter(_as_key(type(record))).dump_python(record, mode="json")
    return data
