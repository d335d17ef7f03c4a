"""How the report's records are read and written: by pydantic, from their declared fields.

A record of the report is a pydantic dataclass whose fields say their JSON types and
bounds (``Name``, ``Count``, ...), so one declaration gives the record, its reader, its
writer and its part of the published JSON Schema (``file_schema``); no record keeps a
hand-written ``to_dict``/``from_dict`` beside its fields. ``load`` names a malformed field
the way the report's other readers do (``calls[0].seen: ...``), so the matrix and the gate
say which file and which field.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Annotated, Any, TypeVar

from pydantic import (
    AllowInfNan,
    BeforeValidator,
    ConfigDict,
    Field,
    PlainSerializer,
    Strict,
    TypeAdapter,
    ValidationError,
    WithJsonSchema,
    model_validator,
)
from pydantic_core import PydanticCustomError

from pytest_qconform.report.schema import SchemaError, multiple_to_json, type_name

T = TypeVar("T")


def _every_key_written(schema: dict[str, Any], cls: type) -> None:
    """The writer writes every field, also those with a default for building a record in
    Python; only a record's ``OPTIONAL_KEYS`` (added after its first version) may be absent."""
    optional = getattr(cls, "OPTIONAL_KEYS", ())
    schema["required"] = [key for key in schema.get("properties", {}) if key not in optional]


# A record holds exactly the keys its writer writes, and finite numbers only (strict JSON).
RECORD_CONFIG = ConfigDict(extra="forbid", allow_inf_nan=False, json_schema_extra=_every_key_written)
Name = Annotated[str, Strict(), Field(min_length=1)]
Text = Annotated[str, Strict()]
Count = Annotated[int, Strict(), Field(ge=0)]
PositiveCount = Annotated[int, Strict(), Field(ge=1)]
Flag = Annotated[bool, Strict()]


def _multiple_in(value: Any) -> Any:
    return float(value) if isinstance(value, str) and value in ("inf", "nan") else value


# An error as a multiple of its bound. Strict JSON has no NaN or Infinity: a non-finite
# multiple is the string "inf" or "nan" in the file, a float in the record.
Multiple = Annotated[
    Annotated[float, Strict(), AllowInfNan()] | None,
    BeforeValidator(_multiple_in),
    PlainSerializer(multiple_to_json),
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"enum": ["inf", "nan"], "type": "string"}, {"type": "null"}],
            "description": "worst error as a multiple of its bound (<= 1: within); null: nothing measured",
        }
    ),
]


class EveryKeyWritten:
    """A record read from a file must carry every field its writer writes, also those with a
    default for building it in Python (the published schema requires them too:
    ``_every_key_written``); only its ``OPTIONAL_KEYS`` (added after its first version) may be
    absent. The records' base, so a record nested in the report file is read as strictly as
    one read alone."""

    @model_validator(mode="before")
    @classmethod
    def _every_written_key_present(cls, data: Any) -> Any:
        if isinstance(data, dict) and dataclasses.is_dataclass(cls):
            optional = getattr(cls, "OPTIONAL_KEYS", ())
            for declared in dataclasses.fields(cls):
                if declared.name not in data and declared.name not in optional:
                    raise missing_key(declared.name)
        return data


def missing_key(name: str) -> PydanticCustomError:
    """The error of a record read without key ``name``, which ``load`` names as its readers do."""
    return PydanticCustomError("missing_key", "missing field '{field}'", {"field": name})


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
        if first["type"] == "missing" and isinstance(loc[-1], int):
            raise SchemaError(f"{_path(where, loc[:-1])}: too few items (no item {loc[-1]})") from None
        if first["type"] == "missing":
            raise SchemaError(f"{_path(where, loc[:-1])}: missing field {loc[-1]!r}") from None
        if first["type"] == "missing_key":
            raise SchemaError(f"{_path(where, loc)}: missing field {first['ctx']['field']!r}") from None
        if first["type"] in ("unexpected_keyword_argument", "extra_forbidden"):
            raise SchemaError(f"{_path(where, loc)}: not a field of this record") from None
        if first["type"] == "value_error" and (not loc or isinstance(loc[-1], int)):
            # A check across a record's fields names its field first ("batch: matmul needs ...").
            raise SchemaError(f"{_path(where, loc)}.{first['ctx']['error']}") from None
        given = first.get("input")
        if first["type"] in ("dataclass_type", "dict_type", "model_type"):
            raise SchemaError(f"{_path(where, loc)}: expected a JSON object, got {type_name(given)}") from None
        if first["type"] in ("tuple_type", "list_type"):
            raise SchemaError(f"{_path(where, loc)}: expected a JSON array, got {type_name(given)}") from None
        got = "null" if given is None else f"{type_name(given)} {given!r}"
        raise SchemaError(f"{_path(where, loc)}: {first['msg']}, got {got}") from None


def dump(record: Any) -> dict[str, Any]:
    """The record's JSON value, as the report file holds it."""
    data: dict[str, Any] = _adapter(_as_key(type(record))).dump_python(record, mode="json")
    return data
