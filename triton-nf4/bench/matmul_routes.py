"""Time every matmul route of the triton-nf4 backend against batch size, on one GPU.

Why: the backend picks a route per batch (``kernels.gemv_4bit``'s per-row kernels, its
tensor-core kernel, or dequantize + cuBLAS); the thresholds in ``nf4_gemv`` (MMA_MIN_ROWS,
PER_ROW_MAX_ROWS, MAX_ROWS) and the backend's FUSED_MAX_ROWS come from this table
(bench/notes.md v11). bitsandbytes (through the project's adapter) in the same run is the
bar. Timing as in the benchmark suite (``pytest_qconform.benchmark.harness``): device clock, calls
queued, inputs rotated out of L2, median. Every fused result is first checked against the
fp32 decode (error below 2**-6 of |x| |W|, which catches layout bugs; the conformance
suites judge the bounds).

    python bench/matmul_routes.py --out routes.jsonl [--shapes 8192x8192 ...] [--configs 2,4,32 ...]

Writes one JSON line per (shape, route, batch) and prints a table of medians in us.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
from unittest import mock

import torch

from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.backends.registry import create
from pytest_qconform.benchmark import harness as bench
from qconform_triton_nf4 import kernels
from qconform_triton_nf4.kernels import nf4_gemv, nf4_mma

BATCHES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 17, 24, 32, 48, 64, 128)
SAMPLES = 100


def _routes(triton_backend, bnb_backend):
    """{name: (batches, make_call)}; make_call(state copies, xs) returns call(i)."""

    def fused(config=None, min_rows=None):
        def make(weights, xs):
            patches = [mock.patch.object(nf4_gemv, "MMA_MIN_ROWS", min_rows)] if min_rows else []
            if config:
                # two row tiles take at most two groups of x (the kernel's static assert)
                one_tile = (1, *config[1:])
                patches.append(
                    mock.patch.object(nf4_mma, "_GPU_CONFIG", {1: config, 2: config, 3: one_tile, 4: one_tile})
                )
                patches.append(mock.patch.object(nf4_mma, "_GPU_CONFIG_NARROW", {}))

            def call(i):
                for p in patches:
                    p.start()
                try:
                    state = weights[i].handle
                    return kernels.gemv_4bit(xs[i], state.packed, state.absmax, **state.kernel_args())
                finally:
                    for p in patches:
                        p.stop()

            return call

        return make

    def dequant_gemm(weights, xs):
        def call(i):
            state = weights[i].handle
            return xs[i] @ triton_backend.buffered_weight(state, xs[i].dtype).t()

        return call

    def bnb(weights, xs):
        return lambda i: bnb_backend.matmul(xs[i], weights[i], None, xs[i].dtype)

    routes = {
        "per-row": (tuple(b for b in BATCHES if b <= 4), fused(min_rows=kernels.MAX_ROWS + 1)),
        "dequant+cublas": (BATCHES, dequant_gemm),
        "bitsandbytes": (BATCHES, bnb),
    }
    return routes, fused


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="*", default=["8192x8192", "4096x4096", "14336x4096"])
    parser.add_argument(
        "--configs", nargs="*", default=["2,4,32"], help="tensor-core kernel configs ROW_TILES,num_warps,warps-per-SM"
    )
    args = parser.parse_args()
    device = torch.device("cuda")
    facts = bench.measure_facts(device)
    triton_backend, bnb_backend = create("triton-nf4"), create("bitsandbytes")
    spec = QuantSpec("nf4", 64)
    dtype = torch.bfloat16
    rows = []
    with open(args.out, "w") as out, torch.no_grad():
        for shape_text in args.shapes:
            n, k = (int(v) for v in shape_text.split("x"))
            gen = torch.Generator(device=device).manual_seed(0)
            weight = torch.randn(n, k, generator=gen, device=device).to(dtype)
            quantized = {b.name: b.quantize(weight, spec) for b in (triton_backend, bnb_backend)}
            exact = kernels.dequantize_4bit(
                quantized["triton-nf4"].handle.packed,
                quantized["triton-nf4"].handle.absmax,
                out_dtype=torch.float32,
                **quantized["triton-nf4"].handle.kernel_args(),
            )
            copies = bench.copies_for(n * k // 2 + n * k // 16, facts.cache_bytes)
            routes, fused = _routes(triton_backend, bnb_backend)
            routes["tensor-core default"] = (tuple(b for b in BATCHES if 2 <= b <= kernels.MAX_ROWS), fused(min_rows=2))
            for config in args.configs:
                values = tuple(int(v) for v in config.split(","))
                routes[f"tensor-core {config}"] = (
                    tuple(b for b in BATCHES if 2 <= b <= kernels.MAX_ROWS),
                    fused(config=values),
                )
            for name, (batches, make) in routes.items():
                backend = bnb_backend if name == "bitsandbytes" else triton_backend
                weights = [quantized[backend.name]] + [
                    copy.deepcopy(quantized[backend.name]) for _ in range(copies - 1)
                ]
                for batch in batches:
                    xs = [torch.randn(batch, k, generator=gen, device=device).to(dtype) for _ in range(copies)]
                    call = make(weights, xs)
                    got = call(0).float()
                    error = (
                        (got - xs[0].float() @ exact.T).abs().max() / (xs[0].float().abs() @ exact.abs().T).max()
                    ).item()
                    if error > 2**-6:
                        raise AssertionError(f"{name} {shape_text} batch {batch}: error {error:.3g} of |x| |W|")
                    times, hidden = bench.device_times(call, copies, SAMPLES, facts, device)
                    row = dict(
                        shape=shape_text,
                        route=name,
                        batch=batch,
                        median_us=statistics.median(times) * 1e6,
                        launch_hidden=hidden,
                        error=error,
                        device=torch.cuda.get_device_name(device),
                        triton=__import__("triton").__version__,
                        torch=torch.__version__,
                    )
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    rows.append(row)
    names = list(dict.fromkeys(r["route"] for r in rows))
    for shape_text in args.shapes:
        print(f"\n{shape_text} (us)")
        print("batch | " + " | ".join(names))
        for batch in BATCHES:
            cells = [
                next(
                    (
                        f"{r['median_us']:.1f}"
                        for r in rows
                        if r["shape"] == shape_text and r["route"] == name and r["batch"] == batch
                    ),
                    "-",
                )
                for name in names
            ]
            print(f"{batch} | " + " | ".join(cells))


if __name__ == "__main__":
    main()
