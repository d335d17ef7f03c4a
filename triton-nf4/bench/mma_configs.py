"""Device time of the tensor-core kernel's configurations per group count (issue 38 item 3).

For each (shape, rows) case and each (ROW_TILES, num_warps, warps per SM) configuration
given for its group count (ceil(rows / 8)), the fused gemv's device time as the benchmark
suite takes it (``harness.device_times``: calls queued, weights rotated out of L2), beside
the default configuration and bitsandbytes. Every result is first checked against the
fp32 decode (error below 2**-6 of |x| |W|: catches layout bugs; the suites judge bounds).

    python bench/mma_configs.py --out configs.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path
from unittest import mock

import torch

CASES = (
    (8192, 8192, 4),
    (4096, 4096, 4),
    (14336, 4096, 4),
    (4096, 14336, 4),
    (28672, 8192, 4),
    (8192, 8192, 16),
    (4096, 4096, 16),
    (14336, 4096, 16),
    (8192, 8192, 24),
    (4096, 4096, 24),
    (14336, 4096, 24),
    (8192, 8192, 32),
    (4096, 4096, 32),
    (14336, 4096, 32),
)
CONFIGS = {
    1: ((1, 4, 32), (1, 8, 32), (1, 8, 16), (1, 8, 64), (1, 16, 32), (1, 4, 16)),
    2: ((1, 8, 32), (2, 4, 32), (1, 2, 16), (1, 2, 32), (1, 4, 16), (1, 8, 16), (1, 2, 8)),
    3: ((1, 4, 32), (1, 2, 16), (1, 2, 32), (1, 4, 16), (1, 2, 8)),
    4: ((1, 2, 16), (1, 4, 32), (1, 2, 8), (1, 2, 24), (1, 4, 16)),
}
SAMPLES = 100


def main() -> int:
    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create
    from pytest_qconform.benchmark import harness as bench
    from qconform_triton_nf4 import kernels
    from qconform_triton_nf4.kernels import nf4_mma

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    facts = bench.measure_facts(device)
    ours, bnb = create("triton-nf4"), create("bitsandbytes")
    spec, dtype = QuantSpec("nf4", 64), torch.bfloat16
    rows_out = []
    with torch.no_grad():
        for n, k, rows in CASES:
            gen = torch.Generator(device=device).manual_seed(0)
            weight = torch.randn(n, k, generator=gen, device=device).to(dtype)
            q, bq = ours.quantize(weight, spec), bnb.quantize(weight, spec)
            state = q.handle
            exact = kernels.dequantize_4bit(state.packed, state.absmax, out_dtype=torch.float32, **state.kernel_args())
            count = bench.copies_for(n * k // 2 + n * k // 16, facts.cache_bytes)
            bqs = [bq] + [copy.deepcopy(bq) for _ in range(count - 1)]
            xs = [torch.randn(rows, k, generator=gen, device=device).to(dtype) for _ in range(count)]
            groups = -(-rows // 8)
            for config in (None, *CONFIGS[groups]):
                patches = []
                if config is not None:
                    patches = [
                        mock.patch.dict(nf4_mma._GPU_CONFIG, {groups: config}),
                        mock.patch.object(nf4_mma, "_GPU_CONFIG_NARROW", {}),
                    ]
                for p in patches:
                    p.start()
                try:
                    # Through the backend's plans, as a layer calls it, on copies of the state
                    # without plans: each copy's plan is built under this configuration and
                    # reused, with its split sums' tickets. kernels.gemv_4bit builds a plan per
                    # call, zeroing new tickets each time: a launch in the device time of every
                    # split configuration (about 3 us at 8192^2, 4 rows; bench/notes.md v18).
                    fresh = [copy.deepcopy(state) for _ in range(count)]

                    def call(i: int, fresh=fresh, xs=xs) -> torch.Tensor:
                        return ours.linear(xs[i], fresh[i], None)

                    got = call(0).float()
                    error = (got - xs[0].float() @ exact.T).abs().max() / (xs[0].float().abs() @ exact.abs().T).max()
                    if error.item() > 2**-6:
                        raise AssertionError(f"{n}x{k} rows {rows} config {config}: error {error.item():.3g}")
                    times, hidden = bench.device_times(call, count, SAMPLES, facts, device)
                finally:
                    for p in patches:
                        p.stop()
                row = {
                    "shape": [n, k],
                    "rows": rows,
                    "config": list(config) if config else "default",
                    "device_us": round(statistics.median(times) * 1e6, 2),
                    "hidden": hidden,
                }
                print(json.dumps(row), flush=True)
                rows_out.append(row)
            times, hidden = bench.device_times(
                lambda i, xs=xs, bqs=bqs: bnb.matmul(xs[i], bqs[i], None, dtype), count, SAMPLES, facts, device
            )
            row = {
                "shape": [n, k],
                "rows": rows,
                "config": "bitsandbytes",
                "device_us": round(statistics.median(times) * 1e6, 2),
                "hidden": hidden,
            }
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows_out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
