"""The adapter rules of docs/downstream.md, checked when the session starts.

A backend that breaks them would otherwise run "without a word": a ``name`` that differs
from its registered name puts the wrong name into ``Quantized`` records and messages,
and a claim the suites cannot read (``"NF4"``, a device ``"rocm"``, a string instead of a
tuple) silently selects nothing. Each problem is one line saying what to change; the
session stops with all of them before anything runs (``session_setup``).
"""

from __future__ import annotations

from typing import Any

import torch

from pytest_qconform.backends.base import Availability, Backend, Capabilities

FORMATS: tuple[str, ...] = ("nf4", "fp4", "hqq4")
BNB_FORMATS: tuple[str, ...] = ("nf4", "fp4")  # the formats double quantization applies to
DTYPES: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32)
DEVICES: tuple[str, ...] = ("cpu", "cuda")
PATH_OPERATIONS: tuple[str, ...] = ("dequantize", "matmul", "layer-forward")  # Capabilities.compiled/.captured


def _where(backend: Backend) -> str:
    return f"{type(backend).__module__}.{type(backend).__qualname__}"


def _sequence_problem(caps: Capabilities, field: str) -> str | None:
    value = getattr(caps, field)
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        return f"Capabilities.{field} is {value!r}; make it a tuple, e.g. {field}=({value!r},)"
    return None


def capability_problems(caps: Any, device: str) -> list[str]:
    """What in one ``capabilities(device)`` answer the suites cannot read as intended."""
    call = f"capabilities({device!r})"
    if not isinstance(caps, Capabilities):
        return [f"{call} returned {type(caps).__name__}, not pytest_qconform.backends.base.Capabilities"]
    found = [p for p in (_sequence_problem(caps, f) for f in ("formats", "blocksizes", "dtypes", "devices")) if p]
    if found:
        return [f"{call}: {p}" for p in found]
    found += [
        f"{call}: format {f!r} is not one of {', '.join(FORMATS)} (lower case)"
        for f in caps.formats
        if f not in FORMATS
    ]
    found += [
        f"{call}: blocksize {b!r} is not a positive whole number"
        for b in caps.blocksizes
        if isinstance(b, bool) or not isinstance(b, int) or b < 1
    ]
    found += [
        f"{call}: dtype {d!r} is not one of torch.bfloat16, torch.float16, torch.float32"
        for d in caps.dtypes
        if d not in DTYPES
    ]
    found += [
        f"{call}: device {d!r} is not one of {', '.join(DEVICES)}"
        + (" (ROCm devices are 'cuda' in torch)" if str(d).lower() in ("rocm", "hip") else "")
        for d in caps.devices
        if d not in DEVICES
    ]
    if caps.formats and not caps.blocksizes:
        found.append(
            f"{call}: claims formats {', '.join(caps.formats)} but no blocksize; list the block/group sizes it supports"
        )
    if caps.double_quant and not any(f in BNB_FORMATS for f in caps.formats):
        found.append(
            f"{call}: double_quant=True needs an nf4 or fp4 format (double quantization is of "
            "bitsandbytes-layout absmax); set double_quant=False"
        )
    for name in ("compiled", "captured"):
        value = getattr(caps, name, ())
        problem = _sequence_problem(caps, name) if value else None
        found += (
            [f"{call}: {problem}"]
            if problem
            else [
                f"{call}: {name} names {op!r}, not one of {', '.join(PATH_OPERATIONS)}"
                for op in value
                if op not in PATH_OPERATIONS
            ]
        )
    rows = caps.max_gemv_rows
    if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
        found.append(f"{call}: max_gemv_rows={rows!r}; use None or a whole number >= 1")
    return found


def violations(registered: str, backend: Backend, devices: tuple[str, ...]) -> list[str]:
    """Every adapter rule ``backend`` (registered as ``registered``) breaks, one line each.

    ``devices`` are the torch device types to ask ``capabilities`` about (this run's).
    Capabilities are only asked of a backend that says it is available: an unavailable
    one may not be able to answer, and its tests skip anyway.
    """
    found = []
    if backend.name != registered:
        found.append(
            f"its class attribute name is {backend.name!r} but it is registered as {registered!r}; set "
            f"name = {registered!r} in {_where(backend)} (the name goes into Quantized records, failure "
            "messages and interop checks)"
        )
    try:
        available = backend.availability()
    except Exception as exc:  # noqa: BLE001 - state.backend already turned a raise into unavailable
        return found + [f"availability() raised {type(exc).__name__}: {exc}; it must return an Availability"]
    if not isinstance(available, Availability):
        return found + [
            f"availability() returned {type(available).__name__}, not pytest_qconform.backends.base.Availability"
        ]
    if not available.available:
        return found
    for device in devices:
        try:
            caps = backend.capabilities(torch.device(device))
        except Exception as exc:  # noqa: BLE001 - reported as a rule broken, not raised
            found.append(
                f"capabilities({device!r}) raised {type(exc).__name__}: {exc}; it must answer for any "
                "device (claim nothing there instead)"
            )
            continue
        found += capability_problems(caps, device)
    return found


def format_violations(broken: dict[str, list[str]]) -> str:
    """The start-up error for every backend that breaks a rule."""
    lines = []
    for name, problems in sorted(broken.items()):
        lines.append(f"backend {name!r} breaks the adapter rules (docs/downstream.md, section 2):")
        lines += [f"  - {problem}" for problem in problems]
    lines.append("Fix the adapter, or leave the backend out (--qconform-backend=NAME selects the others).")
    return "\n".join(lines)
