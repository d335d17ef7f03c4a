"""Time our dequantize kernel's tiles against shape, and a copy of the same bytes, on one GPU.

Why (issue 22, point 2): dequantize reaches 89-90 % of the copy floor at 8192^2 and
14336 x 4096 but 76 % at 4096^2 with the default tile (``nf4_dequant._GPU_TILE``:
2048 packed bytes and 4 warps a program). Two questions, answered in one run: does another
tile (bytes per program, warps) serve small weights better, and how close to the floor
does a plain device-to-device copy of the same number of bytes come at that size (the
floor is measured on a copy much larger than L2, so a small call's fixed cost, filling
and draining the GPU, is not in it). Timing as in the benchmark suite
(``pytest_qconform.benchmark.harness``): device clock, calls queued, inputs rotated out of L2,
median. Every tile's output is checked bit for bit against the default tile's.

    python bench/dequant_tiles.py --out tiles.jsonl [--shapes 4096x4096 ...]

Writes one JSON line per (shape, double quant, tile) and prints a table in us and % of floor.
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
from qconform_triton_nf4.kernels import nf4_dequant

TILES = tuple(
    (size, warps) for size in (512, 1024, 2048, 4096, 8192) for warps in (1, 2, 4, 8) if size // (32 * warps) >= 4
)  # at least 4 packed bytes a thread
SAMPLES = 100


def _time(call, copies: int, facts: bench.DeviceFacts, device: torch.device) -> tuple[float, bool]:
    times, hidden = bench.device_times(call, copies, SAMPLES, facts, device)
    return statistics.median(times), hidden


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--shapes", nargs="*", default=["4096x4096", "8192x8192", "14336x4096"])
    args = parser.parse_args()
    device = torch.device("cuda")
    facts = bench.measure_facts(device)
    backend = create("triton-nf4")
    dtype = torch.bfloat16
    rows = []
    with open(args.out, "w") as out, torch.no_grad():
        for shape_text in args.shapes:
            n, k = (int(v) for v in shape_text.split("x"))
            weight = torch.randn(n, k, generator=torch.Generator(device=device).manual_seed(0), device=device)
            for double_quant in (False, True):
                quantized = backend.quantize(weight.to(dtype), QuantSpec("nf4", 64, double_quant))
                state_bytes = bench.weight_state_bytes(backend.export_packed(quantized))
                moved = state_bytes + n * k * dtype.itemsize
                copies = bench.copies_for(moved, facts.cache_bytes)
                states = [quantized.handle] + [copy.deepcopy(quantized.handle) for _ in range(copies - 1)]
                outs = [torch.empty(n, k, dtype=dtype, device=device) for _ in range(copies)]

                def call(i, states=states, outs=outs):
                    state = states[i]
                    return kernels.dequantize_4bit(
                        state.packed, state.absmax, out_dtype=dtype, out=outs[i], **state.kernel_args()
                    )

                expected = call(0).clone()
                floor_s = moved / facts.copy_bandwidth_bytes_per_s
                # A copy moving the same bytes (read + write = moved), rotated like the calls.
                sources = [torch.ones(moved // 2, dtype=torch.uint8, device=device) for _ in range(copies)]
                targets = [torch.empty_like(s) for s in sources]
                copy_s, _ = _time(
                    lambda i, sources=sources, targets=targets: targets[i].copy_(sources[i]), copies, facts, device
                )
                del sources, targets
                for tile in TILES:
                    with mock.patch.object(nf4_dequant, "_GPU_TILE", tile):
                        if not torch.equal(call(0), expected):
                            raise AssertionError(f"tile {tile} at {shape_text}: output differs from the default tile's")
                        median_s, hidden = _time(call, copies, facts, device)
                    row = dict(
                        shape=shape_text,
                        double_quant=double_quant,
                        tile_bytes=tile[0],
                        num_warps=tile[1],
                        median_us=median_s * 1e6,
                        percent_of_floor=100 * floor_s / median_s,
                        same_bytes_copy_us=copy_s * 1e6,
                        copy_percent_of_floor=100 * floor_s / copy_s,
                        launch_hidden=hidden,
                        default=tile == nf4_dequant._GPU_TILE,
                        device=torch.cuda.get_device_name(device),
                        triton=__import__("triton").__version__,
                        torch=torch.__version__,
                    )
                    out.write(json.dumps(row) + "\n")
                    out.flush()
                    rows.append(row)
    for shape_text in args.shapes:
        for double_quant in (False, True):
            group = [r for r in rows if r["shape"] == shape_text and r["double_quant"] == double_quant]
            print(
                f"\n{shape_text}{' dq' if double_quant else ''}: copy of the same bytes "
                f"{group[0]['same_bytes_copy_us']:.1f} us = {group[0]['copy_percent_of_floor']:.0f} % of floor"
            )
            for r in sorted(group, key=lambda r: r["median_us"]):
                mark = " (default)" if r["default"] else ""
                print(
                    f"  tile {r['tile_bytes']:5d} B x {r['num_warps']} warps: {r['median_us']:6.1f} us "
                    f"{r['percent_of_floor']:3.0f} %{mark}"
                )


if __name__ == "__main__":
    main()
