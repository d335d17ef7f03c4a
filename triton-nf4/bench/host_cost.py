"""Host time of one matmul call, layer by layer down to Triton's C launch (issue 38).

At a shape whose kernel is tiny (default 256 x 256, one row: ~2 us on the device) a call
issued from Python costs what the host does, so this times each layer of the call as a
loop of calls with no synchronization (host us per call) and, for the whole call, the
loop closed by one synchronize (eager us per call). Layers, from the top:

- ``matmul``: ``Backend.matmul`` as a user calls it; ``layer``: ``FunctionalLinear.forward``;
- ``linear``: the adapter's ``linear`` (plan key, plan lookup);
- ``plan``: the plan itself (output allocation, the launch) through Triton's C launch;
- ``native-launch``: the plan's native launch (``kernels.native_launch``: layout check,
  allocation and launch in one C++ call), what ``matmul`` and ``linear`` call first;
- ``bound-launch``: the plan's ``BoundLaunch`` with the output allocated;
- ``runner``: Triton's ``CompiledKernel[grid]`` runner (what a bound launch called before
  issue 38), ``launcher``: its ``CudaLauncher``, ``c-launch``: the generated C ``launch``
  (Triton 3.6's argument order), ``c-launch-ints``: the same with the weight's pointers
  passed as ints (no ``data_ptr`` call or pointer check for them);
- ``torch.empty``, ``stream``: the allocation and the stream lookup alone;
- ``custom-op``: ``torch.ops.qconform.nf4_linear`` called eagerly (the dispatcher);
- ``tinygemm``, ``bitsandbytes``: the peers at the same shape.

    python bench/host_cost.py --out host.jsonl [--shape 256x256] [--rows 1,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

CALLS, REPEATS = 2000, 7


def host_us(call: Callable[[], Any], sync: bool) -> float:
    """Median over REPEATS loops of CALLS calls: us per call, the loop closed by a
    synchronize when ``sync`` (eager), else timed before it (host alone)."""
    for _ in range(50):
        call()
    torch.cuda.synchronize()
    loops = []
    for _ in range(REPEATS):
        started = time.perf_counter()
        for _ in range(CALLS):
            call()
        if sync:
            torch.cuda.synchronize()
        loops.append((time.perf_counter() - started) / CALLS * 1e6)
        torch.cuda.synchronize()
    return statistics.median(loops)


def _cell(function: Any, name: str) -> Any:
    return function.__closure__[function.__code__.co_freevars.index(name)].cell_contents


def _launch_levels(backend: Any, q: Any, x: torch.Tensor) -> dict[str, Callable[[], Any]]:
    """The layers under the adapter's plan, dug out of its closures (the layout before and
    after issue 38; levels it cannot find are left out)."""
    import triton

    levels: dict[str, Callable[[], Any]] = {}
    state = q.handle
    plan = next((p for k, p in state.plans.items() if k and k[0] != "dequantize"), None)
    if plan is None:
        return levels
    levels["plan"] = lambda: plan(x, None)
    names = plan.__code__.co_freevars
    try:
        gemv = _cell(plan, "gemv" if "gemv" in names else "run")
        launch = _cell(gemv, "launch")
        args = (
            x,
            _cell(gemv, "weight"),
            _cell(gemv, "absmax_flat"),
            _cell(gemv, "code_arg"),
            _cell(gemv, "absmax_flat"),
            torch.empty((x.shape[0], state.shape[0]), dtype=x.dtype, device=x.device),
        )
        tail_args = _cell(gemv, "tail")
    except (ValueError, AttributeError, TypeError):
        return levels
    bound = getattr(launch, "_runner", None)
    if bound is None:
        return levels
    args = (*args, *tail_args)
    levels["bound-launch"] = lambda: launch(*args)
    if "runner" in bound.__code__.co_freevars:  # after issue 38: a direct launcher around Triton's runner
        runner, tail = _cell(bound, "runner"), _cell(bound, "tail")
    else:
        runner, tail = bound, launch._tail
    levels["runner"] = lambda: runner(*args, *tail)
    compiled = _cell(runner, "self")
    grid = launch._grid + (1,) * (3 - len(launch._grid))
    stream_of = torch._C._cuda_getCurrentRawStream
    index = x.device.index or 0
    function, packed = compiled.function, compiled.packed_metadata
    launcher = compiled.run
    full = (*args, *tail)
    levels["launcher"] = lambda: launcher(*grid, stream_of(index), function, packed, None, None, None, *full)
    if triton.__version__.startswith("3.6") and hasattr(launcher, "launch"):
        c_launch = launcher.launch
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        levels["c-launch"] = lambda: c_launch(
            *grid, stream_of(index), function, coop, pdl, None, None, packed, None, None, None, *full
        )
        out = args[5]
        ints = tuple(a.data_ptr() if isinstance(a, torch.Tensor) and a is not x and a is not out else a for a in full)
        levels["c-launch-ints"] = lambda: c_launch(
            *grid, stream_of(index), function, coop, pdl, None, None, packed, None, None, None, *ints
        )
    levels["stream"] = lambda: stream_of(index)
    return levels


def measure(shape: tuple[int, int], rows: int, label: str) -> list[dict]:
    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create

    device = torch.device("cuda")
    n, k = shape
    dtype = torch.bfloat16
    weight = torch.randn(n, k, device=device).to(dtype)
    x = torch.randn(rows, k, device=device).to(dtype)
    backend = create("triton-nf4")
    q = backend.quantize(weight, QuantSpec("nf4", 64))
    layer = backend.layers().quantize(weight, None, QuantSpec("nf4", 64), dtype, device)
    calls: dict[str, Callable[[], Any]] = {
        "matmul": lambda: backend.matmul(x, q, None, dtype),
        "layer": lambda: layer(x),
        "linear": lambda: backend.linear(x, q.handle, None),
    }
    with torch.no_grad():
        for _ in range(3):  # the plan, then its launches bound
            calls["matmul"]()
        calls.update(_launch_levels(backend, q, x))
        native = q.handle.fast[0]
        if native is not None:
            calls["native-launch"] = lambda: native(x, None)
        else:
            from qconform_triton_nf4.kernels import native_launch

            print(f"no native launch: {native_launch.unavailable_reason()}", file=sys.stderr)
        calls["torch.empty"] = lambda: torch.empty((rows, n), dtype=dtype, device=device)
        calls["new_empty"] = lambda: x.new_empty((rows, n))
        try:
            from qconform_triton_nf4 import ops

            calls["custom-op"] = lambda: ops.linear(x, q.handle, None, 32)
        except ImportError:
            pass
        try:
            from pytest_qconform.benchmark.peer import GROUP, _packed_weight

            packed, scales = _packed_weight(n, k, device, torch.Generator(device=device).manual_seed(2))
            calls["tinygemm"] = lambda: torch.ops.aten._weight_int4pack_mm(x, packed, GROUP, scales)
        except Exception as exc:  # noqa: BLE001 - a peer that cannot run is left out, said why
            print(f"tinygemm left out: {exc}", file=sys.stderr)
        try:
            bnb = create("bitsandbytes")
            bq = bnb.quantize(weight, QuantSpec("nf4", 64))
            calls["bitsandbytes"] = lambda: bnb.matmul(x, bq, None, dtype)
        except Exception as exc:  # noqa: BLE001
            print(f"bitsandbytes left out: {exc}", file=sys.stderr)
        reference = backend.matmul(x, q, None, dtype).clone()
        out = []
        for name, call in calls.items():
            row = {
                "code": label,
                "level": name,
                "shape": [n, k],
                "rows": rows,
                "host_us": round(host_us(call, sync=False), 2),
                "eager_us": round(host_us(call, sync=True), 2),
            }
            if name in ("matmul", "layer", "linear", "plan", "custom-op", "native-launch"):
                row["equal_to_first_call"] = bool(torch.equal(call(), reference))
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--shape", default="256x256")
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--label", default="this")
    args = parser.parse_args()
    n, k = (int(v) for v in args.shape.split("x"))
    results = []
    for rows in (int(r) for r in args.rows.split(",")):
        results += measure((n, k), rows, args.label)
    with args.out.open("a") as out:
        out.write("".join(json.dumps(r) + "\n" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
