"""The axes a conformance check may depend on, and the instances a check runs on.

A check never picks its parameters from a tuple of its own: it names the axes it
depends on (``@pytest.mark.qconform_axes("format", "blocksize", "double_quant",
"dtype")``), and its instances are an all-pairs covering array of those axes (every
pair of values of two axes appears in some instance; 3-wise in the ``thorough``
profile), drawn from what each backend claims on each target. A value a backend claims
is therefore checked by every check that depends on its axis, and a backend that claims
nothing a check needs still gets one instance, whose cell says so.

What can select a code path in a backend is an axis, never a hypothesis draw: the row
count (a fused gemv, a tensor-core kernel, dequantize + GEMM), the activation's rank,
memory layout and storage offset, a bias or none, the weight's shape (kernels specialize
on whole blocks, tiles and rows) and its value distribution (zero and constant blocks,
subnormals), and the settings users set (the packed storage dtype, the compute dtype,
double quantization, the argument form of the call: ``out=``, a weight orientation). A
pair of two such values drawn by hypothesis is reached by luck, and another machine's
draws may miss it (a value fixed inside a test never meets the others); as axes, every
pair is in the covering array on every arch. Hypothesis varies only what no path depends on: seeds, the values inside a
distribution, magnitudes. Which check takes which axis: docs/running.md, "What selects a
code path".

The covering arrays come from covertable (greedy, deterministic: its default sorter
orders candidates by an md5 of their values, so every xdist worker and every machine
draws the same rows). allpairspy 2.5.1, used until 2026-11-28, left a third of the
valid triples of a 3-wise array out (473 of 1424 on bitsandbytes' route check), so
``thorough`` was not 3-wise; ``tests/test_axes.py`` counts pairs and triples. The
constraints between axes (double quantization, storage dtypes and weight orientations
belong to the bitsandbytes layout, the grouping axis and its shapes to HQQ) are its
filter.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import combinations, product
from typing import Any

import pytest
import torch

from pytest_qconform.backends.base import Capabilities, QuantSpec
from pytest_qconform.cases.claims import DTYPE_LABELS

# Few shapes on purpose: bitsandbytes' CPU path torch.compiles its dequantize per new
# shape, so the shape set decides the CPU run time. Each shape covers a contract clause:
# a multiple of every blocksize, an odd element count with a partial final block, one block.
# Kernels specialize on them (whole blocks and tiles or masked ones, one weight row), so
# they are an axis (``AXES["weight_shape"]``), not a draw.
WEIGHT_SHAPES: tuple[tuple[int, int], ...] = ((64, 128), (33, 47), (1, 64))
# HQQ groups run along the rows of the grouped weight: shapes whose rows and element count
# divide by every group size it takes.
HQQ_WEIGHT_SHAPES: tuple[tuple[int, int], ...] = ((64, 128), (16, 256))
# The weight's value distributions (``strategies.weight`` draws the values of each).
DISTRIBUTIONS: tuple[str, ...] = (
    "normal",
    "heavy_tailed",
    "outliers",
    "zero_blocks",
    "constant_blocks",
    "subnormal_small",
    "near_fp16_max",
)

# The axes that make up a QuantSpec; a check naming any of them takes a ``spec`` argument.
SPEC_AXES: tuple[str, ...] = ("format", "blocksize", "double_quant", "hqq_axis", "quant_storage")
# Activation memory as users hand it over: contiguous, a transposed view, every other
# column of a wider tensor, and a storage offset of one element (breaks 16-byte alignment).
# (A transposed view of one row is contiguous, as it is in users' code: torch ignores the
# stride of a dimension of size one.)
X_LAYOUTS: tuple[str, ...] = ("contiguous", "transposed", "sliced", "offset")
# Activation rank: rows as a matrix (M, K), or as batch x sequence (B, S, K) with B S = M
# (``strategies.activation_leading``); a kernel flattens the leading dims, and a strided
# 3-D view may not flatten without a copy.
X_RANKS: tuple[int, ...] = (2, 3)
# Row counts every backend is checked at besides its declared route changes: one row (the
# gemv path), a decode batch past every fused kernel, and a prefill.
ALWAYS_ROWS: tuple[int, ...] = (1, 128, 300)
# Row counts whatever a backend declares (issue 51): every power of two up to 2^16 (a QLoRA
# batch of 8 x 8192 tokens in one call) and its neighbours on each side. A library switches
# kernels at row counts its adapter may not declare (bitsandbytes' batch tiers, ROCm's GEMM
# paths, a grid dimension capped at 65535); such a switch lies at a power of two or next to
# one, so the ladder reaches the tier on each side of it. 47 values.
ROWS_LADDER_TOP = 16
ROWS_LADDER: tuple[int, ...] = tuple(
    sorted({r for k in range(ROWS_LADDER_TOP + 1) for r in (2**k - 1, 2**k, 2**k + 1) if r >= 1})
)
# Near the dtype's largest finite value, near its smallest normal, subnormal, and results
# beyond fp16's range (for the wider dtypes).
VALUE_RANGES: tuple[str, ...] = ("near-max", "near-smallest-normal", "subnormal", "beyond-fp16")
# A float weight as users hand it to quantize: the transpose of a contiguous tensor, every
# other column of a wider one, rows of a wider one from an offset (a shard of a fused weight).
WEIGHT_LAYOUTS: tuple[str, ...] = ("transposed", "column-strided", "offset-rows")

# The output widths of real lm_heads (config.json "vocab_size"): Llama 2 and Mistral 7B, GPT-2
# (odd), Qwen2 (past 2^17). Cheap with a small K; a kernel that assumes N fits a grid
# dimension, a multiple of its tile or a 16-bit index meets them.
LM_HEAD_WIDTHS: tuple[int, ...] = (32000, 50257, 151936)

# The model families the workload suite builds (suites/_workloads.py): Llama (no bias), Qwen2
# (q/k/v bias), GPT-2 (Conv1D weights stored (in, out), tied lm_head), a mixture of experts
# whose experts get 0, 1 or many tokens.
WORKLOAD_MODELS: tuple[str, ...] = ("llama", "qwen2", "gpt2", "moe")
# Gradient checkpointing as transformers runs it: torch.utils.checkpoint with and without
# use_reentrant (two code paths: a reentrant backward recomputes under no outer graph).
CHECKPOINTING: tuple[str, ...] = ("non-reentrant", "reentrant")
# What a user does to a quantized model between building it and using it, after which every
# 4-bit layer must still hold its source's bytes (suites/test_provenance.py): load, copy, cast.
# (PEFT's transitions and device moves are that suite's own tests: not every layer claims them.)
# In this order, the ci profile's one instance of each (the model families cycling) pairs GPT-2
# (tied lm_head, Conv1D) with the pre-quantized checkpoint and deepcopy, and the MoE with the build.
TRANSITIONS: tuple[str, ...] = (
    "load-state-dict-assign",
    "state-dict-copy",
    "pre-quantized",
    "built",
    "meta-then-load",
    "load-state-dict",
    "deepcopy",
    "dtype-round-trips",
)
# The argument forms of a matmul call that the public API documents (``Backend.matmul_with``):
# the plain call, the result written into the caller's buffer (``out=``: claimed by "matmul" in
# ``Capabilities.out_arguments``), and the packed weight handed over in each other documented
# orientation (``Capabilities.weight_orientations``; bitsandbytes' "as-quantized"). A library
# routes a form its own way (an out= epilogue, a transposed read of the weight), so the form is
# an axis, paired with every route, layout and dtype, not a parameter test's fixed rows.
PLAIN_CALL, OUT_CALL = "plain", "out"

# The loops a workload runs over time (suites/test_workload_loops.py): hypothesis' drawn
# sequences of the loop rules, and the loops users run, named (each its own instance, so that
# a known failure of one loop leaves the others judged, and no instance runs all of them).
# In this order the ci profile's one instance of each (the models cycling) puts both loops that
# merge an adapter on Qwen2, whose q/k/v projections have a bias.
WORKLOAD_LOOPS: tuple[str, ...] = ("drawn", "serving", "rl", "dpo", "reference-after-merge", "resume", "weight-sync")

_STORAGE_LABELS = {torch.uint8: "u8", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _weight_shapes(caps: Capabilities) -> tuple[tuple[int, int], ...]:
    """The weight shapes of the claimed formats' layouts (``_valid`` keeps each to its own)."""
    shapes: list[tuple[int, int]] = []
    if any(fmt != "hqq4" for fmt in caps.formats):
        shapes += WEIGHT_SHAPES
    if "hqq4" in caps.formats:
        shapes += [shape for shape in HQQ_WEIGHT_SHAPES if shape not in shapes]
    return tuple(shapes)


def _rows(caps: Capabilities) -> tuple[int, ...]:
    """Each route change the backend declares, its neighbours, and ``ALWAYS_ROWS``."""
    thresholds = set(caps.dispatch_rows)
    if caps.max_gemv_rows:
        thresholds.add(caps.max_gemv_rows + 1)
    rows = set(ALWAYS_ROWS)
    for t in thresholds:
        rows.update(r for r in (t - 1, t, t + 1) if r >= 1)
    return tuple(sorted(rows))


def _call_forms(caps: Capabilities) -> tuple[str, ...]:
    """The plain matmul call, ``out=`` where claimed, and each claimed non-default orientation."""
    forms = [PLAIN_CALL] + ([OUT_CALL] if "matmul" in caps.out_arguments else [])
    return tuple(forms + [o for o in caps.weight_orientations if o != "default" and o not in forms])


@dataclass(frozen=True)
class Axis:
    """One axis: what it means, the values a backend claims on it, how a value is named."""

    name: str
    meaning: str
    claimed: Callable[[Capabilities, bool], tuple[Any, ...]]  # (capabilities, target has bf16) -> values
    label: Callable[[Any], str] = str


AXES: dict[str, Axis] = {
    axis.name: axis
    for axis in (
        Axis("format", "the 4-bit format", lambda caps, bf16: tuple(caps.formats)),
        Axis(
            "blocksize",
            "the bitsandbytes block or HQQ group size (every claimed one)",
            lambda caps, bf16: tuple(caps.blocksizes),
        ),
        Axis(
            "double_quant",
            "absmax quantized again in 8 bits (bitsandbytes layout)",
            lambda caps, bf16: (False, True) if caps.double_quant else (False,),
            lambda v: "dq" if v else "plain",
        ),
        Axis("hqq_axis", "the axis HQQ groups along", lambda caps, bf16: tuple(caps.axes), lambda v: f"ax{v}"),
        Axis(
            "quant_storage",
            "the dtype the packed bytes are stored as",
            lambda caps, bf16: tuple(caps.quant_storages),
            lambda v: _STORAGE_LABELS.get(v, str(v)),
        ),
        Axis(
            "dtype",
            "the compute/output dtype",
            lambda caps, bf16: tuple(d for d in caps.dtypes if bf16 or d is not torch.bfloat16),
            lambda v: DTYPE_LABELS.get(v, str(v)),
        ),
        Axis(
            "rows",
            "activation rows: every route change the backend declares, its neighbours, 1, 128, a prefill",
            lambda caps, bf16: _rows(caps),
            lambda v: f"M{v}",
        ),
        Axis(
            "rows_ladder",
            "activation rows whatever the backend declares: 2^k - 1, 2^k, 2^k + 1 for 2^k up to 65536",
            lambda caps, bf16: ROWS_LADDER,
            lambda v: f"M{v}",
        ),
        Axis(
            "out_features",
            "output width N: the lm_head widths of real models (up to the claimed maximum)",
            lambda caps, bf16: tuple(
                n for n in LM_HEAD_WIDTHS if caps.max_out_features is None or n <= caps.max_out_features
            ),
            lambda v: f"N{v}",
        ),
        Axis(
            "x_layout",
            "activation memory: contiguous, transposed, sliced, storage offset",
            lambda caps, bf16: X_LAYOUTS,
        ),
        Axis(
            "x_rank",
            "activation rank: (M, K), or batch x sequence (B, S, K) of the same rows",
            lambda caps, bf16: X_RANKS,
            lambda v: f"x{v}d",
        ),
        Axis(
            "bias",
            "a bias added by the matmul, or none (a kernel specializes on it)",
            lambda caps, bf16: (True, False),
            lambda v: "bias" if v else "nobias",
        ),
        Axis(
            "call_form",
            "the matmul call's documented argument form: plain, out= buffer, another weight orientation",
            lambda caps, bf16: _call_forms(caps),
            lambda v: f"call-{v}",
        ),
        Axis(
            "orientation",
            "the orientation of the packed weight handed to a matmul that computes a gradient "
            "(``Backend.matmul_with``'s ``orientation``; ``out=`` is for inference, so the backward "
            "checks take this axis where the forward ones take ``call_form``)",
            lambda caps, bf16: tuple(caps.weight_orientations),
            lambda v: f"orient-{v}",
        ),
        Axis(
            "weight_shape",
            "the weight's (N, K): whole blocks, a partial last block, one block (HQQ: whole groups)",
            lambda caps, bf16: _weight_shapes(caps),
            lambda v: "W" + "x".join(str(n) for n in v),
        ),
        Axis("value_range", "where in the dtype's range the values lie", lambda caps, bf16: VALUE_RANGES),
        Axis(
            "distribution",
            "the weight's value distribution (DISTRIBUTIONS)",
            lambda caps, bf16: DISTRIBUTIONS,
        ),
        Axis("weight_layout", "the memory layout of the weight handed to quantize", lambda caps, bf16: WEIGHT_LAYOUTS),
        Axis("model", "the model family a workload runs (suites/_workloads.py)", lambda caps, bf16: WORKLOAD_MODELS),
        Axis("checkpointing", "gradient checkpointing's variant in a training step", lambda caps, bf16: CHECKPOINTING),
        Axis("transition", "what a user does to a quantized model before using it", lambda caps, bf16: TRANSITIONS),
        Axis(
            "loop", "a training or serving loop over time: drawn, or one users run", lambda caps, bf16: WORKLOAD_LOOPS
        ),
    )
}


def _valid(names: Sequence[str], row: Sequence[Any]) -> bool:
    """The constraints between axes, for a (possibly partial) row in ``names`` order."""
    value = dict(zip(names, row))
    if value.get("value_range") == "beyond-fp16" and value.get("dtype") is torch.float16:
        return False
    fmt = value.get("format")
    if fmt is None:
        return True
    bnb_layout = fmt in ("nf4", "fp4")
    shape = value.get("weight_shape")
    if shape is not None and shape not in (HQQ_WEIGHT_SHAPES if fmt == "hqq4" else WEIGHT_SHAPES):
        return False
    if not bnb_layout and value.get("double_quant", False):
        return False
    if not bnb_layout and value.get("quant_storage", torch.uint8) is not torch.uint8:
        return False
    # An orientation of the packed weight is bitsandbytes' layout's (HQQ's W_q has its own).
    if not bnb_layout and value.get("call_form", PLAIN_CALL) not in (PLAIN_CALL, OUT_CALL):
        return False
    if not bnb_layout and value.get("orientation", "default") != "default":
        return False
    return not (bnb_layout and value.get("hqq_axis", 1) != 1)


@dataclass(frozen=True)
class CheckAxes:
    """What a check declared: its axes, and values it is restricted to (``only``)."""

    names: tuple[str, ...]
    only: dict[str, tuple[Any, ...]]

    @classmethod
    def from_marker(cls, marker: pytest.Mark) -> CheckAxes:
        unknown = [name for name in marker.args if name not in AXES]
        if unknown:
            raise pytest.UsageError(f"qconform_axes names unknown axes {unknown}; the axes are {sorted(AXES)}")
        only = {name: tuple(values) for name, values in marker.kwargs.items()}
        stray = [name for name in only if name not in marker.args]
        if stray:
            raise pytest.UsageError(f"qconform_axes restricts {stray}, which it does not name")
        return cls(tuple(marker.args), only)

    @property
    def argnames(self) -> tuple[str, ...]:
        """The test arguments: ``spec`` for the spec axes, then each other axis by name."""
        spec = ("spec",) if any(name in SPEC_AXES for name in self.names) else ()
        return spec + tuple(name for name in self.names if name not in SPEC_AXES)

    def values(self, caps: Capabilities, bf16: bool) -> dict[str, tuple[Any, ...]]:
        """The claimed values of each axis, within ``only``, in the axis' own order."""
        found = {}
        for name in self.names:
            claimed = AXES[name].claimed(caps, bf16)
            if name in self.only:
                claimed = tuple(v for v in claimed if v in self.only[name])
            found[name] = claimed
        return found


def covering_rows(
    values: dict[str, tuple[Any, ...]], strength: int, jointly: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """A ``strength``-wise covering array of ``values`` under the axis constraints
    (strength 1: every value of every axis in some row, and every valid combination of
    the ``jointly`` axes: a matrix cell such as format x dtype left empty by nothing).

    Built once per process for each distinct question (``_covering_rows_of``): a session
    asks the same one for every target and backend that claims the same values (474 calls,
    110 distinct, on an H200's default run), and covertable's greedy search is pure Python
    (6.4 s of each pytest-xdist worker's start there, profiled 2026-11-29). A question the
    packaged store answers (``covering_store``) is not built at all."""
    rows = _covering_rows_of(tuple(values.items()), strength, tuple(jointly))
    return [dict(row) for row in rows]


@functools.cache
def _covering_rows_of(
    items: tuple[tuple[str, tuple[Any, ...]], ...], strength: int, jointly: tuple[str, ...]
) -> tuple[tuple[tuple[str, Any], ...], ...]:
    """``covering_rows`` of ``dict(items)``, as tuples (hashable and immutable: every caller
    gets its own dicts)."""
    from pytest_qconform.cases import covering_store

    rows = covering_store.stored_rows(items, strength, jointly)
    if rows is None:
        rows = _build_covering_rows(dict(items), strength, jointly)
    return tuple(tuple(row.items()) for row in rows)


def _build_covering_rows(
    values: dict[str, tuple[Any, ...]], strength: int, jointly: Sequence[str]
) -> list[dict[str, Any]]:
    names = [name for name in values]
    if any(not v for v in values.values()):
        return []
    if strength == 1:
        return _each_value_once(names, values, [name for name in jointly if name in values])
    if len(names) == 1:
        return [{names[0]: v} for v in values[names[0]] if _valid(names, (v,))]
    from covertable import make

    n = min(strength, len(names))
    factors = {name: list(values[name]) for name in names}

    completable: dict[tuple, bool] = {}

    def allowed(row: dict[str, Any]) -> bool:
        """covertable asks of partial rows too, and completes a row one axis at a time, taking
        the first value allowed: a partial row is allowed only where some valid row extends it."""
        fixed = tuple((i, row[name]) for i, name in enumerate(names) if name in row)
        if fixed not in completable:
            completable[fixed] = _completed(names, values, dict(fixed)) is not None
        return completable[fixed]

    rows = [[row[name] for name in names] for row in make(factors, length=n, pre_filter=allowed)]
    # A greedy search under a filter may still leave a valid pair out: add a row for each.
    for a, b in combinations(range(len(names)), 2):
        for va, vb in product(values[names[a]], values[names[b]]):
            if any(row[a] == va and row[b] == vb for row in rows):
                continue
            row = _completed(names, values, {a: va, b: vb})
            if row is not None:
                rows.append(row)
    return [dict(zip(names, row)) for row in rows]


def _each_value_once(
    names: Sequence[str], values: dict[str, tuple[Any, ...]], jointly: Sequence[str] = ()
) -> list[dict[str, Any]]:
    """Row ``i`` takes value ``i`` of each axis (cycling the shorter ones) and combination
    ``i`` of the ``jointly`` axes, completed to a valid row where the constraints refuse
    it; then a row for any value or valid combination still missing."""
    rows: list[list[Any]] = []
    joint = [names.index(name) for name in jointly]
    combinations_ = [c for c in product(*(values[names[a]] for a in joint)) if _valid(jointly, c)] or [()]
    for i in range(max(len(combinations_), *(len(values[name]) for name in names))):
        wanted = {a: values[name][i % len(values[name])] for a, name in enumerate(names)}
        wanted.update(zip(joint, combinations_[i % len(combinations_)]))
        row = _completed(names, values, wanted)
        for a in list(wanted):
            if row is not None:
                break
            wanted.pop(a)
            row = _completed(names, values, wanted)
        if row is not None and row not in rows:
            rows.append(row)
    for a, name in enumerate(names):
        for value in values[name]:
            if not any(row[a] == value for row in rows):
                row = _completed(names, values, {a: value})
                if row is not None:
                    rows.append(row)
    for combination in combinations_ if joint else ():
        if not any(all(row[a] == v for a, v in zip(joint, combination)) for row in rows):
            row = _completed(names, values, dict(zip(joint, combination)))
            if row is not None:
                rows.append(row)
    return [dict(zip(names, row)) for row in rows]


def _completed(names: Sequence[str], values: dict[str, tuple[Any, ...]], fixed: dict[int, Any]) -> list[Any] | None:
    """The first valid row holding the ``fixed`` values (by position), or None: the pair is
    not valid under the constraints."""
    choices = [(fixed[i],) if i in fixed else values[name] for i, name in enumerate(names)]
    return next((list(row) for row in product(*choices) if _valid(names, row)), None)


def spec_of(row: dict[str, Any]) -> QuantSpec:
    fmt = row.get("format", "nf4")
    return QuantSpec(
        fmt,
        row.get("blocksize", 64),
        bool(row.get("double_quant", False)),
        axis=row.get("hqq_axis", 1),
        quant_storage=row.get("quant_storage", torch.uint8),
    )


def labels(row: dict[str, Any]) -> dict[str, str]:
    """Each axis value of a row by its label (what the report's coverage records)."""
    return {name: AXES[name].label(value) for name, value in row.items()}


def arguments(check: CheckAxes, row: dict[str, Any]) -> tuple[Any, ...]:
    """The test arguments (``check.argnames``) of one covering row."""
    values = []
    for name in check.argnames:
        values.append(spec_of(row) if name == "spec" else row[name])
    return tuple(values)


def default_row(check: CheckAxes) -> dict[str, Any]:
    """The instance of a backend whose claims are unknown (it cannot load): the first
    allowed value of each axis, so that its one cell says why."""
    defaults = {
        "format": "nf4",
        "blocksize": 64,
        "double_quant": False,
        "hqq_axis": 1,
        "quant_storage": torch.uint8,
        "dtype": torch.float32,
        "rows": 1,
        "rows_ladder": 1,
        "out_features": LM_HEAD_WIDTHS[0],
        "x_layout": "contiguous",
        "x_rank": 2,
        "bias": True,
        "weight_shape": WEIGHT_SHAPES[0],
        "value_range": "near-max",
        "distribution": "normal",
        "weight_layout": "transposed",
        "model": WORKLOAD_MODELS[0],
        "checkpointing": CHECKPOINTING[0],
        "transition": TRANSITIONS[0],
        "loop": WORKLOAD_LOOPS[0],
        "call_form": PLAIN_CALL,
        "orientation": "default",
    }
    return {name: check.only.get(name, (defaults[name],))[0] for name in check.names}


def spec_id(spec: QuantSpec) -> str:
    """A spec's part of an instance id: its label, and HQQ's grouping axis."""
    return spec.label() + (f"-ax{spec.axis}" if spec.format == "hqq4" else "")


def instance_id(row: dict[str, Any]) -> str:
    parts = []
    if any(name in SPEC_AXES for name in row):
        parts.append(spec_id(spec_of(row)))
    parts += [AXES[name].label(value) for name, value in row.items() if name not in SPEC_AXES]
    return "-".join(parts)
