"""One timed benchmark case of a run report (``pytest --qconform --benchmark-only``):
the record, its schema check, and its ratio to bitsandbytes in the same run."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, ModelWrapValidatorHandler, Strict, computed_field, model_validator
from pydantic.dataclasses import dataclass

from pytest_qconform.report.records import (
    RECORD_CONFIG,
    Count,
    EveryKeyWritten,
    Flag,
    Name,
    PositiveCount,
    Text,
    missing_key,
)
from pytest_qconform.report.schema import type_name

PositiveNumber = Annotated[float, Strict(), Field(gt=0)]
BenchOperation = Literal["dequantize", "matmul", "quantize"]
Timing = Literal["cuda-events", "host-timer"]  # device time between CUDA events, or pytest-benchmark's host timer
RATIO_BASELINE = "bitsandbytes"
_DERIVED_TOLERANCE = 1e-6  # relative: derived fields are written from the base fields, so they agree


@dataclass(frozen=True, config=RECORD_CONFIG)
class Benchmark(EveryKeyWritten):
    """One timed case of the benchmark suite (``pytest --qconform --benchmark-only``).

    The bytes are those the operation cannot avoid moving: the weight's stored state
    (packed codes, absmax or scale/zero, nested state and code tables) read, activations
    read, the output written. ``copy_bandwidth_bytes_per_s`` is a device-to-device copy
    measured in the same run, so ``floor_s`` is the time those bytes take at copy speed
    and ``percent_of_floor`` how close the backend comes to it (100: as fast as a copy).
    ``time_ratio_to_bitsandbytes`` is ``median_s`` over bitsandbytes' for the same case in
    the same run (below 1: faster), null when bitsandbytes did not time it. The derived keys
    (bytes_moved, bandwidth_bytes_per_s, floor_s, percent_of_floor) are written for the
    file's readers; reading derives them again and refuses an entry where they disagree
    (``read``).
    """

    OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ("eager_median_s",)  # absent in reports before issue 27

    backend: Name
    operation: BenchOperation
    format: Name  # spec label, e.g. "nf4-b64-dq"
    dtype: Name
    target: Name
    shape: tuple[PositiveCount, PositiveCount]  # (N, K) = (out_features, in_features)
    batch: PositiveCount | None  # activation rows for matmul; None for dequantize and quantize
    median_s: PositiveNumber  # per call
    timing: Timing
    samples: PositiveCount
    copies: PositiveCount  # input copies rotated through (to keep the weights out of cache)
    rotated_bytes: Count  # their total size
    weight_bytes: PositiveCount
    activation_bytes: Count
    output_bytes: PositiveCount
    copy_bandwidth_bytes_per_s: PositiveNumber
    host_median_s: PositiveNumber | None = None  # GPU: a synchronized call timed on the host (launch + kernel + sync)
    launch_hidden: Flag | None = None  # GPU: every timed call was queued before the device reached it
    time_ratio_to_bitsandbytes: PositiveNumber | None = None
    nodeid: Text = ""
    # GPU: per call in an eager loop (calls issued back to back from Python, nothing queued
    # ahead: host and device cost together, what a model's forward without a CUDA graph sees)
    eager_median_s: PositiveNumber | None = None

    @model_validator(mode="wrap")
    @classmethod
    def _derived_keys_agree(cls, data: Any, handler: ModelWrapValidatorHandler[Benchmark]) -> Benchmark:
        """The derived keys are written for the file's readers: reading derives them again
        and refuses an entry where a written one disagrees (edited, or written by a broken tool)."""
        if not isinstance(data, dict):
            return handler(data)
        entry = handler({key: value for key, value in data.items() if key not in DERIVED_KEYS})
        for key in DERIVED_KEYS:
            if key not in data:
                raise missing_key(key)
            stored, derived = data[key], float(getattr(entry, key))
            if isinstance(stored, bool) or not isinstance(stored, (int, float)) or not stored > 0:
                raise ValueError(f"{key}: expected a positive number, got {type_name(stored)} {stored!r}")
            if abs(stored - derived) > _DERIVED_TOLERANCE * derived:
                raise ValueError(
                    f"{key}: {stored!r} disagrees with the value derived from the entry's "
                    f"bytes and times ({derived!r}); the entry was edited or written by a broken tool"
                )
        return entry

    @model_validator(mode="after")
    def _batch_for_a_matmul_only(self) -> Benchmark:
        if (self.batch is None) != (self.operation != "matmul"):
            needs = "null" if self.operation != "matmul" else "the activation rows (an integer >= 1)"
            raise ValueError(f"batch: {self.operation} needs {needs}, got {self.batch!r}")
        return self

    @property
    def case_key(self) -> tuple[Any, ...]:
        """What makes two backends' entries the same case (for the ratio)."""
        return (self.operation, self.format, self.dtype, self.target, self.shape, self.batch)

    @computed_field  # type: ignore[prop-decorator]
    @property
    def bytes_moved(self) -> int:
        return self.weight_bytes + self.activation_bytes + self.output_bytes

    @computed_field  # type: ignore[prop-decorator]
    @property
    def bandwidth_bytes_per_s(self) -> float:
        return self.bytes_moved / self.median_s

    @computed_field  # type: ignore[prop-decorator]
    @property
    def floor_s(self) -> float:
        return self.bytes_moved / self.copy_bandwidth_bytes_per_s

    @computed_field  # type: ignore[prop-decorator]
    @property
    def percent_of_floor(self) -> float:
        return 100.0 * self.floor_s / self.median_s

    @property
    def label(self) -> str:
        """``matmul 4096x4096 M=16 nf4-b64 bf16``: the case, without the backend."""
        batch = f" M={self.batch}" if self.batch is not None else ""
        return f"{self.operation} {self.shape[0]}x{self.shape[1]}{batch} {self.format} {self.dtype}"


DERIVED_KEYS: tuple[str, ...] = ("bytes_moved", "bandwidth_bytes_per_s", "floor_s", "percent_of_floor")


def with_bitsandbytes_ratios(entries: Iterable[Benchmark]) -> tuple[Benchmark, ...]:
    """Each entry with ``time_ratio_to_bitsandbytes`` set from bitsandbytes' entry for the
    same case (null where bitsandbytes has none; 1.0 for bitsandbytes itself)."""
    entries = tuple(entries)
    baseline = {e.case_key: e.median_s for e in entries if e.backend == RATIO_BASELINE}
    return tuple(
        replace(e, time_ratio_to_bitsandbytes=(e.median_s / baseline[e.case_key] if e.case_key in baseline else None))
        for e in entries
    )
