"""The words a run report is written in: verdicts and dtype labels, one enum each, the
prefixes that say what a skip means, and the keys that name a cell and a test case.

Both are ``StrEnum``s, so a member *is* its string: ``Verdict.PASS == "pass"``, it hashes as
``"pass"`` (dicts keyed by the plain string still find it) and ``json.dumps`` writes
``"pass"``. The report format does not change; what changes is that a misspelt verdict is a
NameError where it is written instead of a cell that silently matches nothing.

Imports no torch: the matrix, the gate and the plugin's start-up read these without it.
"""

from __future__ import annotations

from enum import StrEnum
from typing import TYPE_CHECKING, Any, NamedTuple

if TYPE_CHECKING:
    import torch


class Verdict(StrEnum):
    """What one matrix cell (backend · operation · format · dtype) came to.

    Declared worst first: a cell is as bad as its worst case. A crash or a timeout hides
    what the remaining cases would have said, so they outrank a plain failure; a known
    failure still outranks a pass (it is not a pass); any computed outcome outranks
    "skipped"; "unavailable" (the backend cannot load) and "not-claimed" (the backend claims
    nothing the check needs) say least."""

    CRASHED = "crashed"
    TIMEOUT = "timeout"
    FAIL = "fail"
    KNOWN_FAILURE = "known-failure"
    PASS = "pass"
    SKIPPED = "skipped"
    UNAVAILABLE = "unavailable"
    NOT_CLAIMED = "not-claimed"

    @property
    def severity(self) -> int:
        """Higher is worse: the worse of two verdicts of one cell wins."""
        return len(VERDICT_ORDER) - 1 - VERDICT_ORDER.index(self)


VERDICT_ORDER: tuple[Verdict, ...] = tuple(Verdict)  # worst first
# Something ran and said no: what fails a CI gate.
FAILING: frozenset[Verdict] = frozenset({Verdict.CRASHED, Verdict.TIMEOUT, Verdict.FAIL})


class DtypeLabel(StrEnum):
    """The output/compute dtypes the suites check, as reports, node ids and options write them."""

    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @classmethod
    def of(cls, dtype: torch.dtype | str) -> DtypeLabel:
        """The label of a torch dtype (or its name: ``"torch.bfloat16"``, ``"bfloat16"``, ``"half"``,
        ``"bf16"``); ValueError naming the labels for any other."""
        name = str(dtype).removeprefix("torch.")
        label = DTYPE_ALIASES.get(name, name)
        try:
            return cls(label)
        except ValueError:
            raise ValueError(f"no dtype label for {dtype!r}; the suites check {', '.join(cls)}") from None

    def torch_dtype(self) -> torch.dtype:
        import torch

        return {DtypeLabel.BF16: torch.bfloat16, DtypeLabel.FP16: torch.float16, DtypeLabel.FP32: torch.float32}[self]


# Other names a user or torch gives these dtypes (without the ``torch.`` prefix).
DTYPE_ALIASES: dict[str, str] = {
    "bfloat16": "bf16",
    "float16": "fp16",
    "half": "fp16",
    "float32": "fp32",
    "float": "fp32",
}


# What a skip means, as the first words of its reason: the recorder reads a verdict back from
# them (session/outcomes.py), and the rooms below the session write them (hardware/targets.py:
# another device's instance; cases/instances.py: a check whose backend claims nothing it needs).
UNAVAILABLE_PREFIX = "unavailable:"
NOT_CLAIMED_PREFIX = "not claimed:"
OOM_PREFIX = "out of memory:"
OTHER_DEVICE_PREFIX = "other device:"  # an instance for a device this run does not report on
NOTHING_CLAIMED_PREFIX = "claims nothing this check needs:"  # the one cell of a check its backend claims nothing of


class CellKey(NamedTuple):
    """What names a cell, from a test's case to the matrix's row: one key, one spelling."""

    backend: str
    operation: str
    format: str
    dtype: str


class CaseKey(NamedTuple):
    """A test case's key: its cell's four names and the target it ran on ("-" for none).

    The plugin attaches it to a test at collection; pytest-xdist carries it to the controller
    in the test's ``user_properties``, whose values must be plain data, so on that wire it is
    the dict of ``wire()``, and ``from_wire`` is the one place that reads that dict back."""

    backend: str
    operation: str
    format: str
    dtype: str
    target: str

    @property
    def cell(self) -> CellKey:
        return CellKey(self.backend, self.operation, self.format, self.dtype)

    def wire(self) -> dict[str, str]:
        return self._asdict()

    @classmethod
    def from_wire(cls, value: Any) -> CaseKey | None:
        """The key a ``wire()`` dict spells, or None for anything else (no key attached)."""
        if not isinstance(value, dict) or set(value) != set(cls._fields):
            return None
        return cls(**{name: str(value[name]) for name in cls._fields})

    def describe(self) -> str:
        """``backend=... operation=... format=... dtype=... target=...``, for messages."""
        return " ".join(f"{name}={value}" for name, value in self._asdict().items())
