"""One timed benchmark case of a run report (``pytest --qconform --benchmark-only``):
the record, its schema check, and its ratio to bitsandbytes in the same run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any

from pytest_qconform.report.schema import SchemaError, count, json_object, positive, required, string, type_name

BENCH_OPERATIONS: tuple[str, ...] = ("dequantize", "matmul", "quantize")
BENCH_TIMINGS: tuple[str, ...] = ("cuda-events", "host-timer")
RATIO_BASELINE = "bitsandbytes"
_DERIVED_TOLERANCE = 1e-6  # relative: derived fields are written from the base fields, so they agree


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
    operation: str  # "dequantize" | "matmul" | "quantize"
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
    # GPU: per call in an eager loop (calls issued back to back from Python, nothing queued
    # ahead: host and device cost together, what a model's forward without a CUDA graph sees)
    eager_median_s: float | None = None

    def __post_init__(self) -> None:
        if self.operation not in BENCH_OPERATIONS:
            raise ValueError(
                f"unknown benchmark operation {self.operation!r}; expected one of {', '.join(BENCH_OPERATIONS)}"
            )
        if self.median_s <= 0 or self.copy_bandwidth_bytes_per_s <= 0:
            raise ValueError(
                f"median_s and copy_bandwidth_bytes_per_s must be > 0, got {self.median_s!r}, "
                f"{self.copy_bandwidth_bytes_per_s!r}"
            )

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
            "backend": self.backend,
            "operation": self.operation,
            "format": self.format,
            "dtype": self.dtype,
            "target": self.target,
            "shape": list(self.shape),
            "batch": self.batch,
            "median_s": self.median_s,
            "timing": self.timing,
            "samples": self.samples,
            "copies": self.copies,
            "rotated_bytes": self.rotated_bytes,
            "weight_bytes": self.weight_bytes,
            "activation_bytes": self.activation_bytes,
            "output_bytes": self.output_bytes,
            "bytes_moved": self.bytes_moved,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "copy_bandwidth_bytes_per_s": self.copy_bandwidth_bytes_per_s,
            "floor_s": self.floor_s,
            "percent_of_floor": self.percent_of_floor,
            "host_median_s": self.host_median_s,
            "launch_hidden": self.launch_hidden,
            "time_ratio_to_bitsandbytes": self.time_ratio_to_bitsandbytes,
            "nodeid": self.nodeid,
            "eager_median_s": self.eager_median_s,
        }

    @classmethod
    def from_dict(cls, data: Any, where: str = "benchmark") -> Benchmark:
        """Validate and build; the derived fields (``bytes_moved``, ``bandwidth_bytes_per_s``,
        ``floor_s``, ``percent_of_floor``) must agree with the fields they derive from."""
        data = json_object(data, where)
        names = {key: string(data, key, where, nonempty=True) for key in ("backend", "format", "dtype", "target")}
        operation = string(data, "operation", where)
        if operation not in BENCH_OPERATIONS:
            raise SchemaError(
                f"{where}.operation: unknown operation {operation!r}; expected one of {', '.join(BENCH_OPERATIONS)}"
            )
        timing = string(data, "timing", where)
        if timing not in BENCH_TIMINGS:
            raise SchemaError(f"{where}.timing: unknown timing {timing!r}; expected one of {', '.join(BENCH_TIMINGS)}")
        shape = required(data, "shape", where)
        if (
            not isinstance(shape, list)
            or len(shape) != 2
            or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in shape)
        ):
            raise SchemaError(f"{where}.shape: expected [N, K], two positive integers, got {shape!r}")
        batch = count(data, "batch", where, minimum=1, nullable=True)
        if (batch is None) != (operation != "matmul"):
            raise SchemaError(
                f"{where}.batch: {operation} needs "
                + ("null" if operation != "matmul" else "the activation rows (an integer >= 1)")
                + f", got {batch!r}"
            )
        launch_hidden = required(data, "launch_hidden", where)
        if launch_hidden is not None and not isinstance(launch_hidden, bool):
            raise SchemaError(
                f"{where}.launch_hidden: expected true, false or null, got {type_name(launch_hidden)} {launch_hidden!r}"
            )
        entry = cls(
            operation=operation,
            shape=(shape[0], shape[1]),
            batch=batch,
            timing=timing,
            median_s=positive(data, "median_s", where),
            samples=count(data, "samples", where, minimum=1),
            copies=count(data, "copies", where, minimum=1),
            rotated_bytes=count(data, "rotated_bytes", where),
            weight_bytes=count(data, "weight_bytes", where, minimum=1),
            activation_bytes=count(data, "activation_bytes", where),
            output_bytes=count(data, "output_bytes", where, minimum=1),
            copy_bandwidth_bytes_per_s=positive(data, "copy_bandwidth_bytes_per_s", where),
            host_median_s=positive(data, "host_median_s", where, nullable=True),
            launch_hidden=launch_hidden,
            time_ratio_to_bitsandbytes=positive(data, "time_ratio_to_bitsandbytes", where, nullable=True),
            eager_median_s=(
                positive(data, "eager_median_s", where, nullable=True)  # absent before issue 27
                if "eager_median_s" in data
                else None
            ),
            nodeid=string(data, "nodeid", where),
            **names,
        )
        for key in ("bytes_moved", "bandwidth_bytes_per_s", "floor_s", "percent_of_floor"):
            stored, derived = positive(data, key, where), float(getattr(entry, key))
            if abs(stored - derived) > _DERIVED_TOLERANCE * derived:
                raise SchemaError(
                    f"{where}.{key}: {stored!r} disagrees with the value derived from the entry's "
                    f"bytes and times ({derived!r}); the entry was edited or written by a broken tool"
                )
        return entry


def with_bitsandbytes_ratios(entries: Iterable[Benchmark]) -> tuple[Benchmark, ...]:
    """Each entry with ``time_ratio_to_bitsandbytes`` set from bitsandbytes' entry for the
    same case (null where bitsandbytes has none; 1.0 for bitsandbytes itself)."""
    entries = tuple(entries)
    baseline = {e.case_key: e.median_s for e in entries if e.backend == RATIO_BASELINE}
    return tuple(
        replace(e, time_ratio_to_bitsandbytes=(e.median_s / baseline[e.case_key] if e.case_key in baseline else None))
        for e in entries
    )
