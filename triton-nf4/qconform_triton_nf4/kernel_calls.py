"""A log of calls to the kernels' entry points, recorded from a run and replayed on
synthetic inputs, to compile the same Triton kernel variants ahead of time.

Why: Triton compiles one variant per distinct set of constexprs, argument dtypes, integer
classes and pointer alignments, the first time a launch needs it. A default conformance run
on the H100 compiles ~90 of them one after another: ~40 of the ~60 s a cold run spends in
tests (bench/notes.md, "Compile census"). Which variants a call needs is decided inside
``dequantize_4bit`` and ``gemv_4bit`` (tiles, masks, which gemv kernel) from the arguments'
shapes, strides, dtypes and alignment, so a call is logged as exactly those, never as
kernel keys: replaying the log through the same entry points, on the device at hand,
reaches the same launches whatever the Triton version or GPU. Values are not logged (tensor
contents, or a float argument such as the double-quant offset: Triton does not specialize
on either); the replay computes on zeros.

Record the log on the kind of device it will warm: strides of size-1 dimensions, which
Triton does key on through the gemv's row stride, differ between a CPU and a CUDA run of
the same suites (``nox -s kernel-calls`` on a GPU runner).

A record is JSON: ``{"fn": "gemv_4bit", "args": [...], "kwargs": {...}}``, where a tensor
is ``{"tensor": {"shape", "stride", "dtype", "align"}}`` (``align``: its data pointer
modulo 16, which Triton specializes on), a dtype ``{"dtype": "bfloat16"}``, a tuple
``{"tuple": [...]}``, a float 0.0, and ints, bools, strings and None are themselves.

Command line (what the warm-up workers run; prints one JSON summary line)::

    python -m qconform_triton_nf4.kernel_calls replay FILE [--shard I --shards N] [--device cuda]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from pytest_qconform.backends.adapter_helpers import dtype_from_name, dtype_name

ENTRY_POINTS: tuple[str, ...] = ("dequantize_4bit", "gemv_4bit", "quantize_4bit", "tc_gemm_4bit", "ws_gemm_4bit")
DEFAULT_RUN_CALLS = Path(__file__).with_name("default_run_kernel_calls.json")
_ALIGNMENT = 16


class CallLogError(ValueError):
    """A call log that cannot be read: names the file and the problem."""


def encode(value: Any) -> Any:
    """JSON form of one argument (see the module docstring)."""
    if isinstance(value, torch.Tensor):
        return {
            "tensor": {
                "shape": list(value.shape),
                "stride": list(value.stride()),
                "dtype": dtype_name(value.dtype),
                "align": value.data_ptr() % _ALIGNMENT,
            }
        }
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if type(value).__name__ == "CodeBoundaries":  # the quantize kernel's view of a code table
        return {
            "boundaries": {
                "midpoints": encode(value.midpoints),
                "rank_codes": encode(value.rank_codes),
                "zero_rank": value.zero_rank,
                "negative_zero_code": value.negative_zero_code,
            }
        }
    if isinstance(value, (tuple, list)):
        return {"tuple": [encode(v) for v in value]}
    if isinstance(value, float):
        return 0.0  # Triton does not specialize on a float's value, and values differ by run
    if value is None or isinstance(value, (bool, int, str)):
        return value
    raise TypeError(f"kernel_calls: cannot log an argument of type {type(value).__name__}")


def _dtype(name: str) -> torch.dtype:
    try:
        return dtype_from_name(name)
    except ValueError as exc:
        raise CallLogError(str(exc)) from None


def _zeros_like_logged(spec: dict, device: torch.device) -> torch.Tensor:
    """Zeros with the logged shape, strides and dtype, whose data pointer has the logged
    alignment: a view into a larger buffer, ``align`` bytes past an aligned start."""
    dtype = _dtype(spec["dtype"])
    shape, stride, align = tuple(spec["shape"]), tuple(spec["stride"]), int(spec["align"])
    itemsize = torch.empty((), dtype=dtype).element_size()
    if align % itemsize:
        raise CallLogError(f"alignment {align} is not a multiple of {dtype}'s {itemsize} bytes")
    extent = 1 + sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else 0
    buffer = torch.zeros(extent + _ALIGNMENT // itemsize, dtype=dtype, device=device)
    lead = (align - buffer.data_ptr() % _ALIGNMENT) % _ALIGNMENT // itemsize
    return buffer.as_strided(shape, stride, lead)


def decode(value: Any, device: torch.device) -> Any:
    """An argument rebuilt from its JSON form, tensors as zeros on ``device``."""
    if isinstance(value, dict):
        if "tensor" in value:
            return _zeros_like_logged(value["tensor"], device)
        if "dtype" in value:
            return _dtype(value["dtype"])
        if "tuple" in value:
            return tuple(decode(v, device) for v in value["tuple"])
        if "boundaries" in value:
            from qconform_triton_nf4.kernels.nf4_quantize import CodeBoundaries

            found = value["boundaries"]
            return CodeBoundaries(
                decode(found["midpoints"], device),
                decode(found["rank_codes"], device),
                int(found["zero_rank"]),
                int(found["negative_zero_code"]),
            )
        raise CallLogError(f"unknown argument form {sorted(value)}")
    return value


def record(fn: str, args: tuple, kwargs: dict) -> dict:
    """The log record of one call of entry point ``fn``."""
    return {"fn": fn, "args": [encode(a) for a in args], "kwargs": {k: encode(v) for k, v in kwargs.items()}}


class Recorder:
    """Logs every call of the entry points while installed (``with Recorder() as log``),
    each distinct call once, in the order first seen. Patches the names the package and
    ``WeightBuffer`` call through, and restores them on exit."""

    def __init__(self) -> None:
        self.calls: list[dict] = []
        self._seen: set[str] = set()
        self._patched: list[tuple[object, str, Callable]] = []

    def _wrap(self, name: str, function: Callable) -> Callable:
        def logged(*args: Any, **kwargs: Any) -> Any:
            self.merge([record(name, args, kwargs)])
            return function(*args, **kwargs)

        return logged

    def __enter__(self) -> Recorder:
        from qconform_triton_nf4 import kernels
        from qconform_triton_nf4.kernels import weight_buffer

        for owner, name, logged_as in (
            (kernels, "dequantize_4bit", "dequantize_4bit"),
            (kernels, "gemv_4bit", "gemv_4bit"),
            (kernels, "quantize_4bit", "quantize_4bit"),
            (weight_buffer, "dequantize_4bit", "dequantize_4bit"),
            # a plan takes its entry point's arguments and reaches the same launches
            (kernels, "dequantize_4bit_plan", "dequantize_4bit"),
            (kernels, "gemv_4bit_plan", "gemv_4bit"),
            (kernels, "tc_gemm_4bit", "tc_gemm_4bit"),
            (kernels, "tc_gemm_4bit_plan", "tc_gemm_4bit"),
            (kernels, "ws_gemm_4bit", "ws_gemm_4bit"),
            (kernels, "ws_gemm_4bit_plan", "ws_gemm_4bit"),
        ):
            original = getattr(owner, name)
            self._patched.append((owner, name, original))
            setattr(owner, name, self._wrap(logged_as, original))
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)
        self._patched.clear()

    def merge(self, calls: list[dict]) -> None:
        """Add ``calls`` (one logged call, or another process's log: a pytest-xdist
        worker's) after these, each distinct call once."""
        for entry in calls:
            text = json.dumps(entry, sort_keys=True)
            if text not in self._seen:
                self._seen.add(text)
                self.calls.append(entry)

    def write(self, path: Path) -> None:
        """The log as JSON, one call per line (diffs stay readable)."""
        lines = ",\n".join(json.dumps(entry, separators=(",", ":")) for entry in self.calls)
        path.write_text(f'{{"calls": [\n{lines}\n]}}\n')


def load(path: Path) -> list[dict]:
    """The records of a call log file; a CallLogError naming the file for anything else."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise CallLogError(f"{path}: cannot read the call log: {exc}") from None
    calls = data.get("calls") if isinstance(data, dict) else None
    if not isinstance(calls, list):
        raise CallLogError(f"{path}: expected an object with a 'calls' list")
    for index, entry in enumerate(calls):
        if not (
            isinstance(entry, dict)
            and entry.get("fn") in ENTRY_POINTS
            and isinstance(entry.get("args"), list)
            and isinstance(entry.get("kwargs"), dict)
        ):
            raise CallLogError(
                f"{path}: call {index} is not {{'fn': one of {ENTRY_POINTS}, 'args': [...], "
                f"'kwargs': {{...}}}}: {str(entry)[:120]}"
            )
    return calls


def runs_here(entry: dict, device: torch.device) -> bool:
    """Whether a logged call's entry point runs on ``device``: every one does but
    ``ws_gemm_4bit``, an sm_90 run's (``nf4_ws_gemm.runs_on``; the compile check answers
    for the arch it compiles for). The replay and the compile check skip the others."""
    from qconform_triton_nf4.kernels import nf4_ws_gemm

    return entry["fn"] != "ws_gemm_4bit" or nf4_ws_gemm.runs_on(device)


def replay(calls: list[dict], device: torch.device) -> dict:
    """Run each logged call on zeros on ``device``; one failing call does not stop the
    others. Returns counts, seconds and the first error."""
    from qconform_triton_nf4 import kernels

    start = time.perf_counter()
    failed, first_error = 0, None
    for entry in calls:
        if not runs_here(entry, device):
            continue
        try:
            args = [decode(a, device) for a in entry["args"]]
            kwargs = {k: decode(v, device) for k, v in entry["kwargs"].items()}
            getattr(kernels, entry["fn"])(*args, **kwargs)
        except Exception as exc:  # a warm-up must never fail the run: count, keep the first
            failed += 1
            first_error = first_error or f"{entry['fn']}: {type(exc).__name__}: {exc}"[:300]
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return {
        "calls": len(calls),
        "failed": failed,
        "first_error": first_error,
        "seconds": round(time.perf_counter() - start, 2),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m qconform_triton_nf4.kernel_calls")
    parser.add_argument("command", choices=["replay"])
    parser.add_argument("calls", type=Path, help="call log JSON")
    parser.add_argument("--shard", type=int, default=0, help="replay calls shard, shard + shards, ...")
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--device", default="cuda")
    options = parser.parse_args(argv)
    if not 0 <= options.shard < options.shards:
        parser.error(f"--shard must be in [0, {options.shards}), got {options.shard}")
    try:
        calls = load(options.calls)[options.shard :: options.shards]
    except CallLogError as exc:
        print(json.dumps({"error": str(exc)}))
        return 2
    device = torch.device(options.device)
    if options.shard == 0 and device.type == "cuda":
        # The adapter's native launch is built on first use (~20 s on a fresh machine, then
        # cached by torch): built here; the session uses Triton's launch until it is ready.
        from qconform_triton_nf4.kernels import native_launch

        native_launch.module(wait=True)
    print(json.dumps(replay(calls, device)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
