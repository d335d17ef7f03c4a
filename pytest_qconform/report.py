"""The run report: one JSON file per run, saying which cells passed on this machine.

A report is the only thing a runner hands on to the matrix, so it is written
atomically (a killed run leaves no half-written file), read strictly (a malformed or
newer file is an error that names the file and the problem, never a guess), and
versioned (``schema_version``). The schema is documented in ``docs/report-schema.md``.
Reading never evaluates or unpickles anything: it is ``json.loads`` and type checks.
"""
from __future__ import annotations

import datetime as _dt
import json
import math
import os
import re
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Iterable, Mapping

SCHEMA = "pytest-qconform/report"
SCHEMA_VERSION = 2
# Version 2 adds the optional top-level ``benchmarks`` list and nothing else. A report is
# written with the lowest version that holds its content: conformance runs stay version 1
# (readable by every release), a benchmark run is version 2, which older releases refuse
# with "upgrade" instead of merging it as an empty conformance run.
READABLE_VERSIONS: tuple[int, ...] = (1, 2)
BENCHMARKS_SINCE_VERSION = 2

# Folding precedence, worst first: a cell is as bad as its worst case. A crash or a
# timeout hides what the remaining cases would have said, so they outrank a plain
# failure; a known failure still outranks a pass (it is not a pass); any computed
# outcome outranks "skipped", and "unavailable" (the backend cannot load) says least.
VERDICTS: tuple[str, ...] = ("crashed", "timeout", "fail", "known-failure", "pass", "skipped", "unavailable")
FAILING_VERDICTS: frozenset[str] = frozenset({"crashed", "timeout", "fail"})
DEVICE_KINDS: tuple[str, ...] = ("cpu", "cuda", "rocm")

CREATED_FORMAT = "%Y-%m-%dT%H:%M:%SZ"
FILENAME_TIME_FORMAT = "%Y%m%dT%H%M%SZ"
_TEMP_SUFFIX = ".tmp"  # never "*.json": a temp file left by a SIGKILL is not scanned as a report


class SchemaError(ValueError):
    """A dict does not follow the report schema; the message names the field."""


class ReportError(ValueError):
    """A report file cannot be read: names the file and what is wrong with it."""

    def __init__(self, path: str | os.PathLike[str], problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


def utc_now() -> str:
    """The current UTC time in the report's ``created`` format."""
    return _dt.datetime.now(_dt.timezone.utc).strftime(CREATED_FORMAT)


def parse_created(created: str) -> _dt.datetime:
    """``2025-01-31T12:00:00Z`` -> aware UTC datetime; anything else is a SchemaError."""
    if not isinstance(created, str) or not created.endswith("Z"):
        raise SchemaError(f"created: {created!r} is not a UTC ISO 8601 time like '2025-01-31T12:00:00Z'")
    for fmt in (CREATED_FORMAT, "%Y-%m-%dT%H:%M:%S.%fZ"):
        try:
            return _dt.datetime.strptime(created, fmt).replace(tzinfo=_dt.timezone.utc)
        except ValueError:
            continue
    raise SchemaError(f"created: {created!r} is not a UTC ISO 8601 time like '2025-01-31T12:00:00Z'")


def format_multiple(multiple: float | None) -> str:
    """A worst error multiple for tables: three significant digits, ``-`` when none."""
    if multiple is None:
        return "-"
    if math.isnan(multiple):
        return "nan"
    if math.isinf(multiple):
        return "inf"
    return f"{multiple:.3g}"


# ---------------------------------------------------------------- field checks


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _require(data: Mapping[str, Any], key: str, where: str) -> Any:
    if key not in data:
        raise SchemaError(f"{where}: missing field {key!r}")
    return data[key]


def _str(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False, nonempty: bool = False) -> Any:
    value = _require(data, key, where)
    if value is None and nullable:
        return None
    if not isinstance(value, str):
        expected = "a string or null" if nullable else "a string"
        raise SchemaError(f"{where}.{key}: expected {expected}, got {_type_name(value)} {value!r}")
    if nonempty and not value:
        raise SchemaError(f"{where}.{key}: must not be empty")
    return value


def _bool(data: Mapping[str, Any], key: str, where: str) -> bool:
    value = _require(data, key, where)
    if not isinstance(value, bool):
        raise SchemaError(f"{where}.{key}: expected true or false, got {_type_name(value)} {value!r}")
    return value


def _object(value: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise SchemaError(f"{where}: expected a JSON object, got {_type_name(value)}")
    return value


def _multiple_from_json(value: Any, where: str) -> float | None:
    # Strict JSON has no NaN/Infinity, so non-finite multiples travel as strings.
    if value is None:
        return None
    if isinstance(value, str) and value in ("inf", "nan"):
        return float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SchemaError(f"{where}: expected a number, null, 'inf' or 'nan', got {_type_name(value)} {value!r}")
    return float(value)


def _multiple_to_json(value: float | None) -> float | str | None:
    if value is None or math.isfinite(value):
        return value
    return "nan" if math.isnan(value) else "inf"


def validate_probe(probe: Any, where: str = "probe") -> dict[str, Any]:
    """Check the probe keys the report and matrix rely on (others are kept as written)."""
    data = _object(probe, where)
    kind = _str(data, "device_kind", where)
    if kind not in DEVICE_KINDS:
        raise SchemaError(f"{where}.device_kind: {kind!r} is not one of {', '.join(DEVICE_KINDS)}")
    _str(data, "arch", where, nonempty=True)
    _str(data, "device_name", where)
    _str(data, "host", where)
    _str(data, "torch", where, nullable=True)
    _str(data, "cuda", where, nullable=True)
    _str(data, "hip", where, nullable=True)
    _bool(data, "simulated", where)
    backends = _object(_require(data, "backends", where), f"{where}.backends")
    for name, status in backends.items():
        entry = f"{where}.backends[{name!r}]"
        status = _object(status, entry)
        _bool(status, "available", entry)
        _str(status, "version", entry, nullable=True)
        _str(status, "reason", entry)
    return dict(data)


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class Cell:
    """One matrix cell of one run: every test case of a (backend, operation, format, dtype).

    ``worst_error_multiple`` is the worst error as a multiple of its derived bound
    (<= 1 is within bound); ``first_failure`` carries the message and a repro command of
    the first failing case; ``reason`` explains skipped, unavailable and known-failure.
    """

    backend: str
    operation: str
    format: str
    dtype: str
    verdict: str
    cases: int = 1
    worst_error_multiple: float | None = None
    first_failure: dict[str, str] | None = None
    reason: str = ""

    def __post_init__(self) -> None:
        if self.verdict not in VERDICTS:
            raise ValueError(f"unknown verdict {self.verdict!r}; expected one of {', '.join(VERDICTS)}")
        if self.cases < 0:
            raise ValueError(f"cases must be >= 0, got {self.cases}")

    @property
    def key(self) -> tuple[str, str, str, str]:
        return (self.backend, self.operation, self.format, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "operation": self.operation,
            "format": self.format,
            "dtype": self.dtype,
            "verdict": self.verdict,
            "cases": self.cases,
            "worst_error_multiple": _multiple_to_json(self.worst_error_multiple),
            "first_failure": dict(self.first_failure) if self.first_failure is not None else None,
            "reason": self.reason,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "cell") -> "Cell":
        data = _object(data, where)
        names = {key: _str(data, key, where, nonempty=True) for key in ("backend", "operation", "format", "dtype")}
        verdict = _str(data, "verdict", where)
        if verdict not in VERDICTS:
            raise SchemaError(f"{where}.verdict: unknown verdict {verdict!r}; expected one of {', '.join(VERDICTS)}")
        cases = _require(data, "cases", where)
        if isinstance(cases, bool) or not isinstance(cases, int) or cases < 0:
            raise SchemaError(f"{where}.cases: expected a non-negative integer, got {_type_name(cases)} {cases!r}")
        multiple = _multiple_from_json(_require(data, "worst_error_multiple", where), f"{where}.worst_error_multiple")
        failure = _require(data, "first_failure", where)
        if failure is not None:
            failure = _object(failure, f"{where}.first_failure")
            failure = {key: _str(failure, key, f"{where}.first_failure") for key in ("message", "repro")}
        reason = _str(data, "reason", where)
        return cls(verdict=verdict, cases=cases, worst_error_multiple=multiple, first_failure=failure,
                   reason=reason, **names)


def _worst(multiples: Iterable[float | None]) -> float | None:
    """The largest multiple; NaN counts as worst of all (a NaN result is never within bound)."""
    present = [m for m in multiples if m is not None]
    if not present:
        return None
    if any(math.isnan(m) for m in present):
        return math.nan
    return max(present)


def fold_cell(cells: Iterable[Cell]) -> Cell:
    """Fold the cells of many test cases with one (backend, operation, format, dtype) into one.

    Verdict: the first of ``VERDICTS`` present (crashed > timeout > fail > known-failure >
    pass > skipped > unavailable). Cases: summed. Worst multiple: the maximum (NaN wins).
    First failure: that of the first cell, in the given order, that carries one. Reason:
    that of the first cell whose verdict is the folded verdict.
    """
    cells = list(cells)
    if not cells:
        raise ValueError("fold_cell needs at least one cell")
    key = cells[0].key
    for cell in cells[1:]:
        if cell.key != key:
            raise ValueError(f"fold_cell: cannot fold {cell.key} into {key}; group cells by key first")
    verdict = min((cell.verdict for cell in cells), key=VERDICTS.index)
    failure = next((cell.first_failure for cell in cells if cell.first_failure is not None), None)
    reason = next(cell.reason for cell in cells if cell.verdict == verdict)
    return Cell(*key, verdict=verdict, cases=sum(cell.cases for cell in cells),
                worst_error_multiple=_worst(cell.worst_error_multiple for cell in cells),
                first_failure=failure, reason=reason)


# ---------------------------------------------------------------- benchmarks

BENCH_OPERATIONS: tuple[str, ...] = ("dequantize", "matmul")
BENCH_TIMINGS: tuple[str, ...] = ("cuda-events", "host-timer")
RATIO_BASELINE = "bitsandbytes"
_DERIVED_TOLERANCE = 1e-6  # relative: derived fields are written from the base fields, so they agree


def _positive(data: Mapping[str, Any], key: str, where: str, *, nullable: bool = False) -> Any:
    value = _require(data, key, where)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        expected = "a positive number or null" if nullable else "a positive number"
        raise SchemaError(f"{where}.{key}: expected {expected}, got {_type_name(value)} {value!r}")
    return float(value)


def _count(data: Mapping[str, Any], key: str, where: str, *, minimum: int = 0, nullable: bool = False) -> Any:
    value = _require(data, key, where)
    if value is None and nullable:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        expected = f"an integer >= {minimum}" + (" or null" if nullable else "")
        raise SchemaError(f"{where}.{key}: expected {expected}, got {_type_name(value)} {value!r}")
    return value


@dataclass(frozen=True)
class Benchmark:
    """One timed case of the benchmark suite (``pytest --qconform --benchmark-only``).

    The bytes are those the operation cannot avoid moving: the weight's stored state
    (packed codes, absmax or scale/zero, nested state and code tables) read, activations
    read, the output written. ``copy_bandwidth_bytes_per_s`` is a device-to-device copy
    measured in the same run, so ``floor_s`` is the time those bytes take at copy speed
    and ``percent_of_floor`` how close the backend comes to it (100: as fast as a copy).
    ``time_ratio_to_bitsandbytes`` is ``median_s`` over bitsandbytes' for the same case in
    the same run (below 1: faster), null when bitsandbytes did not time it.
    """

    backend: str
    operation: str  # "dequantize" | "matmul"
    format: str  # spec label, e.g. "nf4-b64-dq"
    dtype: str
    target: str
    shape: tuple[int, int]  # (N, K) = (out_features, in_features)
    batch: int | None  # activation rows for matmul; None for dequantize
    median_s: float  # per call
    timing: str  # "cuda-events" (device time) | "host-timer" (pytest-benchmark's, CPU)
    samples: int
    copies: int  # input copies rotated through (to keep the weights out of cache)
    rotated_bytes: int  # their total size
    weight_bytes: int
    activation_bytes: int
    output_bytes: int
    copy_bandwidth_bytes_per_s: float
    host_median_s: float | None = None  # GPU: a synchronized call timed on the host (launch + kernel + sync)
    launch_hidden: bool | None = None  # GPU: every timed call was queued before the device reached it
    time_ratio_to_bitsandbytes: float | None = None
    nodeid: str = ""

    def __post_init__(self) -> None:
        if self.operation not in BENCH_OPERATIONS:
            raise ValueError(f"unknown benchmark operation {self.operation!r}; expected one of "
                             f"{', '.join(BENCH_OPERATIONS)}")
        if self.median_s <= 0 or self.copy_bandwidth_bytes_per_s <= 0:
            raise ValueError(f"median_s and copy_bandwidth_bytes_per_s must be > 0, got {self.median_s!r}, "
                             f"{self.copy_bandwidth_bytes_per_s!r}")

    @property
    def case_key(self) -> tuple[Any, ...]:
        """What makes two backends' entries the same case (for the ratio)."""
        return (self.operation, self.format, self.dtype, self.target, self.shape, self.batch)

    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.output_bytes

    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_moved / self.median_s

    @property
    def floor_s(self) -> float:
        return self.bytes_moved / self.copy_bandwidth_bytes_per_s

    @property
    def percent_of_floor(self) -> float:
        return 100.0 * self.floor_s / self.median_s

    @property
    def label(self) -> str:
        """``matmul 4096x4096 M=16 nf4-b64 bf16``: the case, without the backend."""
        batch = f" M={self.batch}" if self.batch is not None else ""
        return f"{self.operation} {self.shape[0]}x{self.shape[1]}{batch} {self.format} {self.dtype}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "backend": self.backend, "operation": self.operation, "format": self.format, "dtype": self.dtype,
            "target": self.target, "shape": list(self.shape), "batch": self.batch, "median_s": self.median_s,
            "timing": self.timing, "samples": self.samples, "copies": self.copies,
            "rotated_bytes": self.rotated_bytes, "weight_bytes": self.weight_bytes,
            "activation_bytes": self.activation_bytes, "output_bytes": self.output_bytes,
            "bytes_moved": self.bytes_moved, "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "copy_bandwidth_bytes_per_s": self.copy_bandwidth_bytes_per_s, "floor_s": self.floor_s,
            "percent_of_floor": self.percent_of_floor, "host_median_s": self.host_median_s,
            "launch_hidden": self.launch_hidden, "time_ratio_to_bitsandbytes": self.time_ratio_to_bitsandbytes,
            "nodeid": self.nodeid,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "benchmark") -> "Benchmark":
        """Validate and build; the derived fields (``bytes_moved``, ``bandwidth_bytes_per_s``,
        ``floor_s``, ``percent_of_floor``) must agree with the fields they derive from."""
        data = _object(data, where)
        names = {key: _str(data, key, where, nonempty=True) for key in ("backend", "format", "dtype", "target")}
        operation = _str(data, "operation", where)
        if operation not in BENCH_OPERATIONS:
            raise SchemaError(f"{where}.operation: unknown operation {operation!r}; expected one of "
                              f"{', '.join(BENCH_OPERATIONS)}")
        timing = _str(data, "timing", where)
        if timing not in BENCH_TIMINGS:
            raise SchemaError(f"{where}.timing: unknown timing {timing!r}; expected one of {', '.join(BENCH_TIMINGS)}")
        shape = _require(data, "shape", where)
        if (not isinstance(shape, list) or len(shape) != 2
                or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)):
            raise SchemaError(f"{where}.shape: expected [N, K], two positive integers, got {shape!r}")
        batch = _count(data, "batch", where, minimum=1, nullable=True)
        if (batch is None) != (operation == "dequantize"):
            raise SchemaError(f"{where}.batch: {operation} needs " + ("null" if operation == "dequantize"
                                                                        else "the activation rows (an integer >= 1)")
                              + f", got {batch!r}")
        launch_hidden = _require(data, "launch_hidden", where)
        if launch_hidden is not None and not isinstance(launch_hidden, bool):
            raise SchemaError(f"{where}.launch_hidden: expected true, false or null, got "
                              f"{_type_name(launch_hidden)} {launch_hidden!r}")
        entry = cls(
            operation=operation, shape=(shape[0], shape[1]), batch=batch, timing=timing,
            median_s=_positive(data, "median_s", where), samples=_count(data, "samples", where, minimum=1),
            copies=_count(data, "copies", where, minimum=1), rotated_bytes=_count(data, "rotated_bytes", where),
            weight_bytes=_count(data, "weight_bytes", where, minimum=1),
            activation_bytes=_count(data, "activation_bytes", where),
            output_bytes=_count(data, "output_bytes", where, minimum=1),
            copy_bandwidth_bytes_per_s=_positive(data, "copy_bandwidth_bytes_per_s", where),
            host_median_s=_positive(data, "host_median_s", where, nullable=True), launch_hidden=launch_hidden,
            time_ratio_to_bitsandbytes=_positive(data, "time_ratio_to_bitsandbytes", where, nullable=True),
            nodeid=_str(data, "nodeid", where), **names)
        for key in ("bytes_moved", "bandwidth_bytes_per_s", "floor_s", "percent_of_floor"):
            stored, derived = _positive(data, key, where), float(getattr(entry, key))
            if abs(stored - derived) > _DERIVED_TOLERANCE * derived:
                raise SchemaError(f"{where}.{key}: {stored!r} disagrees with the value derived from the entry's "
                                  f"bytes and times ({derived!r}); the entry was edited or written by a broken tool")
        return entry


def with_bitsandbytes_ratios(entries: Iterable[Benchmark]) -> tuple[Benchmark, ...]:
    """Each entry with ``time_ratio_to_bitsandbytes`` set from bitsandbytes' entry for the
    same case (null where bitsandbytes has none; 1.0 for bitsandbytes itself)."""
    entries = tuple(entries)
    baseline = {e.case_key: e.median_s for e in entries if e.backend == RATIO_BASELINE}
    return tuple(replace(e, time_ratio_to_bitsandbytes=(e.median_s / baseline[e.case_key]
                                                         if e.case_key in baseline else None)) for e in entries)


@dataclass(frozen=True)
class RunReport:
    """One run: the probe (what hardware and software), its cells, its benchmarks (only
    from ``--benchmark-only`` runs) and when (UTC).

    ``source`` is where the report was read from (empty for one built in memory); it is
    not part of the file and not part of equality.
    """

    probe: dict[str, Any]
    cells: tuple[Cell, ...]
    created: str
    source: str = field(default="", compare=False)
    benchmarks: tuple["Benchmark", ...] = ()

    @property
    def arch(self) -> str:
        return str(self.probe["arch"])

    @property
    def host(self) -> str:
        return str(self.probe["host"])

    @property
    def simulated(self) -> bool:
        return bool(self.probe.get("simulated", False))

    @property
    def created_at(self) -> _dt.datetime:
        return parse_created(self.created)

    @property
    def label(self) -> str:
        """A short, machine-independent name: the file name, else arch-host-created."""
        return Path(self.source).name if self.source else f"{self.arch}-{self.host}-{self.created}"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {
            "schema": SCHEMA,
            "schema_version": BENCHMARKS_SINCE_VERSION if self.benchmarks else 1,
            "created": self.created,
            "probe": dict(self.probe),
            "cells": [cell.to_dict() for cell in self.cells],
        }
        if self.benchmarks:
            data["benchmarks"] = [entry.to_dict() for entry in self.benchmarks]
        return data

    @classmethod
    def from_dict(cls, data: Any, source: str = "") -> "RunReport":
        """Validate and build; raises SchemaError naming the first field that is wrong."""
        if not isinstance(data, dict):
            raise SchemaError(f"top level: expected a JSON object, got {_type_name(data)}")
        schema = data.get("schema")
        if schema != SCHEMA:
            raise SchemaError(f"schema is {schema!r}, expected {SCHEMA!r}: not a pytest-qconform run report")
        version = _require(data, "schema_version", "report")
        if isinstance(version, bool) or not isinstance(version, int):
            raise SchemaError(f"report.schema_version: expected an integer, got {_type_name(version)} {version!r}")
        if version > SCHEMA_VERSION:
            raise SchemaError(f"schema_version {version} is newer than this pytest-qconform reads "
                              f"(version {SCHEMA_VERSION}); upgrade pytest-qconform to read it")
        if version not in READABLE_VERSIONS:
            raise SchemaError(f"unknown schema_version {version}; this pytest-qconform reads version "
                              f"{' or '.join(map(str, READABLE_VERSIONS))}")
        created = _require(data, "created", "report")
        parse_created(created)
        probe = validate_probe(_require(data, "probe", "report"))
        raw_cells = _require(data, "cells", "report")
        if not isinstance(raw_cells, list):
            raise SchemaError(f"report.cells: expected a JSON array, got {_type_name(raw_cells)}")
        cells = tuple(Cell.from_dict(cell, f"cells[{i}]") for i, cell in enumerate(raw_cells))
        benchmarks: tuple[Benchmark, ...] = ()
        if "benchmarks" in data:
            if version < BENCHMARKS_SINCE_VERSION:
                raise SchemaError(f"report.benchmarks: not part of schema_version {version} (added in version "
                                  f"{BENCHMARKS_SINCE_VERSION}); a report with benchmarks says schema_version "
                                  f"{BENCHMARKS_SINCE_VERSION}")
            raw = data["benchmarks"]
            if not isinstance(raw, list):
                raise SchemaError(f"report.benchmarks: expected a JSON array, got {_type_name(raw)}")
            benchmarks = tuple(Benchmark.from_dict(entry, f"benchmarks[{i}]") for i, entry in enumerate(raw))
        return cls(probe=probe, cells=cells, created=created, source=source, benchmarks=benchmarks)


# ---------------------------------------------------------------- files


def safe_filename_part(text: str) -> str:
    """Keep letters, digits, ``.``, ``_`` and ``-``; no leading dot (no hidden files)."""
    cleaned = re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._")
    return cleaned or "unknown"


def write_figure_png(fig: Any, png_path: str | Path) -> Path:
    """Save a matplotlib figure as PNG at ``png_path`` (folders created), atomically and
    without the matplotlib version in its metadata, so that the same data gives the same
    bytes (``nox -s matrix`` promises that of its heatmap)."""
    import io

    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", metadata={"Software": None})
    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)
    write_bytes_atomically(png_path, buffer.getvalue())
    return png_path


def write_bytes_atomically(path: Path, data: bytes) -> None:
    """Write ``data`` so that ``path`` holds either its old content or all of the new one.

    Temp file in the same folder (same filesystem, so ``os.replace`` is atomic), fsync,
    replace; on any error the temp file is removed and the error propagates. The temp
    name starts with a dot and ends in ``.tmp``, so a SIGKILL mid-write leaves nothing
    that a ``*.json`` scan would take for a report.
    """
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=_TEMP_SUFFIX)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    _fsync_dir(path.parent)


def write_text_atomically(path: Path, text: str) -> None:
    """``write_bytes_atomically`` for text, encoded as UTF-8 (no newline translation)."""
    write_bytes_atomically(path, text.encode("utf-8"))


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable where the OS allows it (POSIX); elsewhere a no-op."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def report_filename(report: RunReport) -> str:
    """``<arch>-<host>-<YYYYmmddTHHMMSSZ>.json`` from the report's own ``created``."""
    stamp = report.created_at.strftime(FILENAME_TIME_FORMAT)
    return f"{safe_filename_part(report.arch)}-{safe_filename_part(report.host)}-{stamp}.json"


def write_report(report: RunReport, folder: Path) -> Path:
    """Write ``report`` atomically into ``folder`` (created if needed); returns its path.

    A second report of the same arch, host and second gets a ``-1``, ``-2``... suffix
    rather than replacing the first.
    """
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    text = json.dumps(report.to_dict(), indent=2, sort_keys=True, ensure_ascii=False, allow_nan=False) + "\n"
    name = report_filename(report)
    path = folder / name
    counter = 0
    while path.exists():
        counter += 1
        path = folder / f"{name[:-len('.json')]}-{counter}.json"
    write_text_atomically(path, text)
    return path


def _reject_constant(name: str) -> Any:
    raise SchemaError(f"{name} is not valid JSON (write non-finite multiples as the strings 'inf'/'nan')")


def read_report(path: str | os.PathLike[str]) -> RunReport:
    """Read and validate one report; any problem is a ReportError naming the file."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ReportError(path, f"cannot read: {exc.strerror or exc}") from exc
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ReportError(path, f"not UTF-8 text (byte {exc.start}): not a run report") from exc
    if not text.strip():
        raise ReportError(path, "empty file: not a run report (a run killed before writing leaves none)")
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        # Truncated: the parser choked on nothing, on half a literal or half a number.
        rest = text[exc.pos:].rstrip()
        truncated = (exc.msg.startswith("Unterminated string") or re.fullmatch(r"[-+.eE0-9]*", rest) is not None
                     or any(literal.startswith(rest) for literal in ("true", "false", "null")))
        what = "truncated JSON" if truncated else "not valid JSON"
        raise ReportError(path, f"{what} ({exc.msg}: line {exc.lineno} column {exc.colno}); "
                                "regenerate it with pytest --qconform or remove it") from exc
    except SchemaError as exc:
        raise ReportError(path, str(exc)) from exc
    try:
        return RunReport.from_dict(data, source=str(path))
    except SchemaError as exc:
        raise ReportError(path, str(exc)) from exc


# ---------------------------------------------------------------- terminal table


def format_arch_table(report: RunReport) -> str:
    """This run's cells as a fixed-width table for the end of the terminal output."""
    probe = report.probe
    simulated = " [SIMULATED: nothing computed on this device]" if report.simulated else ""
    title = f"{report.arch} ({probe.get('device_kind')}) on {report.host}, torch {probe.get('torch')}{simulated}"
    if not report.cells:
        return f"{title}\n(no conformance cells recorded)"
    header = ("backend", "operation", "format", "dtype", "verdict", "cases", "worst")
    rows = [(*c.key, c.verdict, str(c.cases), format_multiple(c.worst_error_multiple))
            for c in sorted(report.cells, key=lambda c: c.key)]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    right = {5, 6}  # numbers align right

    def line(row: tuple[str, ...]) -> str:
        return "  ".join(v.rjust(w) if i in right else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([title, line(header), rule, *(line(row) for row in rows)])


def format_bench_table(report: RunReport) -> str:
    """This run's benchmarks as a fixed-width table: time, bandwidth, % of the copy floor,
    ratio to bitsandbytes."""
    if not report.benchmarks:
        return "(no benchmarks recorded)"
    header = ("backend", "case", "median us", "GB/s", "% floor", "vs bnb")
    rows = [(e.backend, e.label, f"{e.median_s * 1e6:.1f}", f"{e.bandwidth_bytes_per_s / 1e9:.1f}",
             f"{e.percent_of_floor:.0f}",
             f"{e.time_ratio_to_bitsandbytes:.2f}x" if e.time_ratio_to_bitsandbytes is not None else "-")
            for e in sorted(report.benchmarks, key=lambda e: (e.operation, e.shape, e.batch or 0, e.format, e.backend))]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    copy = report.benchmarks[0].copy_bandwidth_bytes_per_s
    lines = [f"benchmarks (copy bandwidth {copy / 1e9:.1f} GB/s; floor = bytes moved / copy bandwidth)",
             "  ".join(h.rjust(w) if i >= 2 else h.ljust(w) for i, (h, w) in enumerate(zip(header, widths))).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.rjust(w) if i >= 2 else v.ljust(w) for i, (v, w) in enumerate(zip(row, widths))).rstrip()
              for row in rows]
    return "\n".join(lines)
