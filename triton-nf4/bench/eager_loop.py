"""Per-call time of the matmul called from Python in an eager loop (issue 27), and where
the host time goes.

For each shape and row count: the triton-nf4 adapter's matmul, bitsandbytes' and torch's
int4 tinygemm, each over four rotated weight copies (each call reads its weight from
memory), 100 calls per loop, median of 7 loops (as ``pytest_qconform.benchmark.harness.eager_time``;
repeated here so that a checkout without it can be timed the same way),
beside the device time of the same calls queued behind a sleep (``bench.device_times``).
``--old-tree DIR`` also times the adapter of another checkout (the code before a change)
in a subprocess, the same way. ``--graph`` adds a CUDA-graph capture of the adapter's calls: replay equal to eager, and
its time per call. ``--profile`` adds a cProfile of 300 eager calls of the
adapter at one and at 16 rows (the host's Python work per call, top functions).

    python bench/eager_loop.py --out eager.jsonl [--old-tree ../old] [--profile prof.txt]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

SHAPES = ((8192, 8192), (4096, 4096), (14336, 4096))
ROWS = (1, 2, 4, 8, 16, 128)
COPIES = 4


def _cases(which: str, device: torch.device, row_counts: tuple[int, ...] = ROWS):
    """(name, shape, rows, call(i), count) for the backends named in ``which``."""
    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create as get_backend

    spec = QuantSpec("nf4", 64)
    for n, k in SHAPES:
        torch.manual_seed(0)
        weight = torch.randn(n, k, device=device).to(torch.bfloat16)
        backends = [get_backend(name) for name in which.split(",") if name not in ("tinygemm",)]
        for backend in backends:
            first = backend.quantize(weight, spec)
            qs = [first] + [copy.deepcopy(first) for _ in range(COPIES - 1)]
            for rows in row_counts:
                xs = [torch.randn(rows, k, device=device).to(torch.bfloat16) for _ in range(COPIES)]
                fresh = backend.matmul(xs[0], copy.deepcopy(qs[0]), None, torch.bfloat16)  # entry points
                yield (
                    backend.name,
                    (n, k),
                    rows,
                    (lambda i, b=backend, qs=qs, xs=xs: b.matmul(xs[i], qs[i], None, torch.bfloat16)),
                )
                planned = backend.matmul(xs[0], qs[0], None, torch.bfloat16)  # after 800 calls: the plan
                print(
                    json.dumps(
                        {
                            "backend": backend.name,
                            "shape": [n, k],
                            "rows": rows,
                            "planned_equals_entry_point": bool(torch.equal(fresh, planned)),
                        }
                    ),
                    flush=True,
                )
            del qs, first
        if "tinygemm" in which:
            from pytest_qconform.benchmark.peer import GROUP, _packed_weight

            generator = torch.Generator(device=device).manual_seed(2)
            packed = [_packed_weight(n, k, device, generator) for _ in range(COPIES)]
            for rows in row_counts:
                xs = [torch.randn(rows, k, device=device).to(torch.bfloat16) for _ in range(COPIES)]
                yield (
                    "torch-int4-tinygemm",
                    (n, k),
                    rows,
                    (
                        lambda i, xs=xs, packed=packed: torch.ops.aten._weight_int4pack_mm(
                            xs[i], packed[i][0], GROUP, packed[i][1]
                        )
                    ),
                )


def _eager_time(call, count: int, loops: int = 7, calls: int = 100) -> float:
    for i in range(max(10, count)):
        call(i % count)
    torch.cuda.synchronize()
    seconds = []
    for _ in range(loops):
        started = time.perf_counter()
        for i in range(calls):
            call(i % count)
        torch.cuda.synchronize()
        seconds.append((time.perf_counter() - started) / calls)
    return statistics.median(seconds)


def measure(which: str, label: str, row_counts: tuple[int, ...] = ROWS) -> list[dict]:
    from pytest_qconform.benchmark import harness as bench

    device = torch.device("cuda")
    facts = bench.measure_facts(device)
    rows_out = []
    with torch.no_grad():
        for name, shape, rows, call in _cases(which, device, row_counts):
            times, hidden = bench.device_times(call, COPIES, 100, facts, device)
            eager = _eager_time(call, COPIES)
            rows_out.append(
                {
                    "code": label,
                    "backend": name,
                    "shape": list(shape),
                    "rows": rows,
                    "device_us": round(statistics.median(times) * 1e6, 2),
                    "launch_hidden": hidden,
                    "eager_us": round(eager * 1e6, 2),
                    "repeat_equal": bool(torch.equal(call(0), call(0))),
                }
            )
            print(json.dumps(rows_out[-1]), flush=True)
    return rows_out


def profile(path: Path) -> None:
    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create as get_backend

    device = torch.device("cuda")
    backend = get_backend("triton-nf4")
    weight = torch.randn(8192, 8192, device=device).to(torch.bfloat16)
    q = backend.quantize(weight, QuantSpec("nf4", 64))
    text = io.StringIO()
    with torch.no_grad():
        for rows in (1, 16):
            x = torch.randn(rows, 8192, device=device).to(torch.bfloat16)
            for _ in range(20):
                backend.matmul(x, q, None, torch.bfloat16)
            torch.cuda.synchronize()
            profiler = cProfile.Profile()
            profiler.enable()
            for _ in range(300):
                backend.matmul(x, q, None, torch.bfloat16)
            profiler.disable()
            torch.cuda.synchronize()
            text.write(f"--- {rows} rows, 300 calls\n")
            pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(14)
    path.write_text(text.getvalue())


def graph_check() -> list[dict]:
    """The adapter's matmul (1, 4, 16 rows) and dequantize at 8192^2 captured in a CUDA graph
    of one call per rotated copy: replay equal to eager, and the replay's time per call."""
    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create as get_backend

    device = torch.device("cuda")
    backend = get_backend("triton-nf4")
    weight = torch.randn(8192, 8192, device=device).to(torch.bfloat16)
    first = backend.quantize(weight, QuantSpec("nf4", 64))
    qs = [first] + [copy.deepcopy(first) for _ in range(COPIES - 1)]
    out = []
    with torch.no_grad():
        for rows in (1, 4, 16, None):
            xs = [torch.randn(rows or 1, 8192, device=device).to(torch.bfloat16) for _ in range(COPIES)]
            if rows is None:

                def call(i, qs=qs):
                    return backend.dequantize(qs[i], torch.bfloat16)
            else:

                def call(i, qs=qs, xs=xs):
                    return backend.matmul(xs[i], qs[i], None, torch.bfloat16)

            eager = [call(i).clone() for i in range(COPIES)]
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in range(COPIES):
                    call(i)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                results = [call(i) for i in range(COPIES)]
            graph.replay()
            torch.cuda.synchronize()
            equal = all(torch.equal(a, b) for a, b in zip(eager, results))
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(25):
                graph.replay()
            end.record()
            end.synchronize()
            out.append(
                {
                    "graph": "dequantize" if rows is None else "matmul",
                    "rows": rows,
                    "replay_equal": equal,
                    "replay_us_per_call": round(start.elapsed_time(end) * 1e3 / (25 * COPIES), 2),
                }
            )
            print(json.dumps(out[-1]), flush=True)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--which", default="triton-nf4,bitsandbytes,tinygemm")
    parser.add_argument("--label", default="this")
    parser.add_argument("--old-tree", type=Path)
    parser.add_argument("--profile", type=Path)
    parser.add_argument("--graph", action="store_true", help="also the CUDA-graph replay check")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)), help="row counts, comma-separated")
    args = parser.parse_args()
    results = measure(args.which, args.label, tuple(int(r) for r in args.rows.split(",")))
    if args.graph:
        results += graph_check()
    if args.old_tree:
        env = dict(os.environ, PYTHONPATH=f"{args.old_tree.resolve()}:{os.environ.get('PYTHONPATH', '')}")
        old = subprocess.run(
            [
                sys.executable,
                str(Path(__file__).resolve()),
                "--out",
                str(args.out) + ".old",
                "--which",
                "triton-nf4",
                "--label",
                "before",
            ],
            env=env,
            cwd=args.old_tree,
            check=False,
        )
        if old.returncode == 0:
            results += [json.loads(line) for line in Path(str(args.out) + ".old").read_text().splitlines()]
    args.out.write_text("".join(json.dumps(r) + "\n" for r in results))
    if args.profile:
        profile(args.profile)
    return 0


if __name__ == "__main__":
    sys.exit(main())
