"""A cell of the run report: every test case of a (backend, operation, format, dtype) of one
run, folded into one verdict, and the key that names it from a test's case to the matrix's row."""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Annotated, ClassVar

from pydantic import Field, WithJsonSchema, with_config
from pydantic.dataclasses import dataclass as pydantic_dataclass
from typing_extensions import TypedDict  # pydantic reads typing.TypedDict only from Python 3.12

from pytest_qconform.report.records import RECORD_CONFIG, Count, EveryKeyWritten, Multiple, Name, Text
from pytest_qconform.vocabulary import FAILING, VERDICT_ORDER, CellKey, Verdict

# A test's comparative ratios (``reference.comparative``: its error against torch's own dense op on
# the same weights), in its user_properties; the cell keeps the worst.
COMPARATIVE_PROPERTY = "qconform_comparative"

# The comparative ratio, written as a multiple is (a non-finite one as the string "inf" or "nan").
Ratio = Annotated[
    Multiple,
    WithJsonSchema(
        {
            "anyOf": [{"type": "number"}, {"enum": ["inf", "nan"], "type": "string"}, {"type": "null"}],
            "description": (
                "worst comparative ratio: the backend's error at the 90th percentile over torch's own dense op's "
                "on the same decoded weights in the same dtypes (reference/comparative.py; above 3 fails); "
                "null: nothing compared"
            ),
        }
    ),
]

# Folding precedence, worst first: a cell is as bad as its worst case. A crash or a
# timeout hides what the remaining cases would have said, so they outrank a plain
# failure; a known failure still outranks a pass (it is not a pass); any computed
# outcome outranks "skipped", and "unavailable" (the backend cannot load) says least.
# "not-claimed": a check whose declared axes the backend claims no value of (pytest_qconform.cases.axes):
# its one cell says so, and says least.
VERDICTS: tuple[str, ...] = VERDICT_ORDER
FAILING_VERDICTS: frozenset[str] = FAILING


@with_config(RECORD_CONFIG)
class FirstFailure(TypedDict):
    """The first failing case of a cell: its message and a command that reruns it."""

    message: Text
    repro: Text


@pydantic_dataclass(frozen=True, config=RECORD_CONFIG)
class Cell(EveryKeyWritten):
    """One matrix cell of one run: every test case of a (backend, operation, format, dtype), folded.

    ``worst_error_multiple`` is the worst error as a multiple of its derived bound
    (<= 1 is within bound; null where nothing was measured); ``first_failure`` carries the
    message and a repro command of the first failing case; ``reason`` explains skipped,
    unavailable, not-claimed and known-failure. ``worst_comparative_ratio`` (optional, contract
    revision 8): the worst ratio of the backend's error to torch's own dense op's on the same
    weights (``reference.comparative``), beside the bound's multiple; null where none was compared.
    """

    OPTIONAL_KEYS: ClassVar[tuple[str, ...]] = ("worst_comparative_ratio",)  # absent in reports before revision 8

    backend: Name
    operation: Name
    format: Name
    dtype: Name  # bf16, fp16, fp32, or - where no dtype applies
    verdict: Verdict
    cases: Count = 1
    worst_error_multiple: Multiple = None
    first_failure: FirstFailure | None = None
    reason: Text = ""
    # Written only where a ratio was measured: a report of checks without one reads back as it was written.
    worst_comparative_ratio: Ratio = Field(default=None, exclude_if=lambda ratio: ratio is None)

    @property
    def key(self) -> CellKey:
        return CellKey(self.backend, self.operation, self.format, self.dtype)


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
    pass > skipped > unavailable). Cases: summed. Worst multiple and worst comparative ratio:
    each the maximum (NaN wins).
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
    return Cell(
        *key,
        verdict=verdict,
        cases=sum(cell.cases for cell in cells),
        worst_error_multiple=_worst(cell.worst_error_multiple for cell in cells),
        first_failure=failure,
        reason=reason,
        worst_comparative_ratio=_worst(cell.worst_comparative_ratio for cell in cells),
    )
