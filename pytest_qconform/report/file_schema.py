"""The run report file's shape, as pydantic models: the source of the published JSON Schema.

Downstream tools (a dashboard, another matrix) should be able to validate a report without
importing pytest-qconform, so the schema is published as JSON Schema
(``report.schema.json``, ``published_schema.py``), generated from these models rather than
written by hand beside the records. The models describe the file exactly as ``report/``
writes it: every key a record writes, optional sections optional, no key the writer does not
write (but in the probe, whose unknown keys are kept as written). What JSON Schema cannot
say (a benchmark's derived fields agreeing with the fields they derive from; a matmul's
batch) is still checked by the records' readers.

One model per schema version (``schema_version`` 1, 2 and 3): a version-1 report has no
``benchmarks``, a version-3 report must carry ``suite``.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pytest_qconform.report.benchmarks import Benchmark
from pytest_qconform.report.calls import CallCoverage
from pytest_qconform.report.cells import Cell
from pytest_qconform.report.contract import Suite
from pytest_qconform.report.coverage import Coverage
from pytest_qconform.report.records import Count, Name
from pytest_qconform.report.stale_entries import StaleEntry

CREATED_PATTERN = r"^[0-9]{4}-[0-9]{2}-[0-9]{2}T[0-9]{2}:[0-9]{2}:[0-9]{2}(\.[0-9]+)?Z$"


class _Record(BaseModel):
    """A record of the report: exactly the keys the writer writes, finite numbers only."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


class BackendStatusFile(BaseModel):
    """One backend's load result on the run's machine; other keys are kept as written."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)

    available: bool
    version: str | None
    reason: str
    notes: list[str] = Field(default_factory=list, description="warnings and log lines loading the backend emitted")


class ProbeFile(BaseModel):
    """The run's hardware and software (``hardware.probe.Probe``). The keys without a default
    are checked on reading; the others are written by the probe and not relied on, and any
    further key is kept as written."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False, frozen=True)

    device_kind: Literal["cpu", "cuda", "rocm"]
    arch: Name = Field(description="sm90, gfx942, or the CPU machine (x86_64): the matrix column")
    device_name: str
    host: str
    torch: str | None
    cuda: str | None
    hip: str | None
    simulated: bool = Field(description="true: nothing was computed on arch; the matrix excludes such reports")
    backends: dict[str, BackendStatusFile]
    family: str | None = None
    bf16: bool | None = None
    default_blocksize: int | None = None
    triton: str | None = None
    python: str | None = None
    cpu_capability: str | None = None
    device_memory: int | None = Field(default=None, description="the GPU's bytes; null on a CPU")
    driver: str | None = Field(default=None, description="the GPU driver's version, where the host publishes it")
    device_count: Count | None = Field(default=None, description="the GPUs the run's process sees")
    topology: list[str] | None = Field(default=None, description="each GPU and each pair's link")
    notes: list[str] | None = None
    schema_version: int | None = None


class _ReportFile(_Record):
    schema_: Literal["pytest-qconform/report"] = Field(alias="schema")
    created: str = Field(pattern=CREATED_PATTERN, description="UTC ISO 8601 with Z")
    probe: ProbeFile
    cells: list[Cell]
    coverage: list[Coverage] = Field(default_factory=list, description="absent when no check declared axes")
    calls: list[CallCoverage] = Field(default_factory=list, description="absent when nothing was watched")
    stale_known_failures: list[StaleEntry] = Field(default_factory=list, description="absent when none")


class ReportV1(_ReportFile):
    """A run report of schema version 1: probe, cells, created."""

    schema_version: Literal[1]


class ReportV2(_ReportFile):
    """A run report of schema version 2: version 1 and the optional benchmarks."""

    schema_version: Literal[2]
    benchmarks: list[Benchmark] = Field(default_factory=list, description="absent in runs that timed nothing")


class ReportV3(_ReportFile):
    """A run report of schema version 3, the one written now: version 2 and the suite, required."""

    schema_version: Literal[3]
    benchmarks: list[Benchmark] = Field(default_factory=list, description="absent in runs that timed nothing")
    suite: Suite


ReportFile = Annotated[ReportV1 | ReportV2 | ReportV3, Field(discriminator="schema_version")]
# The model that reads and writes each schema version (run_report.RunReport).
REPORT_FILES: dict[int, type[ReportV1 | ReportV2 | ReportV3]] = {1: ReportV1, 2: ReportV2, 3: ReportV3}
