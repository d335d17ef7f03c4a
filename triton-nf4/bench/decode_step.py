"""A decode step of a two-layer model, eager and compiled, ours against bitsandbytes and
torch's int4 tinygemm (issue 38 item 2).

The model: two MLP blocks of a 7-8B model's sizes (``x + down(silu(up(x)))``, up 4096 ->
14336, down 14336 -> 4096, bf16, NF4 blocksize 64 / int4 group 64), its four weights
together ~130 MB packed, so a step reads them from memory, not from L2. Per backend and
row count: graph breaks under dynamo (``torch._dynamo.explain``), the eager step time and
the step time compiled with ``torch.compile(mode="reduce-overhead")`` (inductor, the
step captured in a CUDA graph), each the median over 7 loops of 100 steps closed by a
synchronize; and how far the compiled step's output is from the eager one's.

    python bench/decode_step.py --out decode.jsonl [--rows 1,16]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

HIDDEN, INTERMEDIATE, LAYERS = 4096, 14336, 2
LOOPS, STEPS = 7, 100
PROFILE = False  # --profile: the kernels of 5 compiled steps, by device time


class Block(torch.nn.Module):
    def __init__(self, up: torch.nn.Module, down: torch.nn.Module) -> None:
        super().__init__()
        self.up, self.down = up, down

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.up(x)))


class Int4Linear(torch.nn.Module):
    """torch's tinygemm: int4 codes with a bf16 scale and zero per group of 64 along K."""

    def __init__(self, n: int, k: int, device: torch.device, generator: torch.Generator) -> None:
        from pytest_qconform.benchmark.peer import GROUP, _packed_weight

        super().__init__()
        self.group, self.n = GROUP, n
        packed, scales = _packed_weight(n, k, device, generator)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_and_zeros", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.aten._weight_int4pack_mm(
            x.reshape(-1, x.shape[-1]), self.packed, self.group, self.scales_and_zeros
        )
        return y.reshape(*x.shape[:-1], self.n)


def model_for(name: str, device: torch.device) -> torch.nn.Module:
    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create

    generator = torch.Generator().manual_seed(0)
    blocks = []
    for _ in range(LAYERS):
        linears = []
        for n, k in ((INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)):
            if name == "torch-int4-tinygemm":
                linears.append(Int4Linear(n, k, device, torch.Generator(device=device).manual_seed(len(linears))))
                continue
            weight = (torch.randn(n, k, generator=generator) / k**0.5).to(torch.bfloat16)
            facet = create(name).layers()
            linears.append(facet.quantize(weight, None, QuantSpec("nf4", 64), torch.bfloat16, device))
        blocks.append(Block(*linears))
    return torch.nn.Sequential(*blocks).to(device).eval()


def step_time(step: Any, xs: list[torch.Tensor]) -> float:
    """Median seconds per step over LOOPS loops of STEPS steps, each loop synchronized."""
    for i in range(10):
        step(xs[i % len(xs)])
    torch.cuda.synchronize()
    loops = []
    for _ in range(LOOPS):
        started = time.perf_counter()
        for i in range(STEPS):
            step(xs[i % len(xs)])
        torch.cuda.synchronize()
        loops.append((time.perf_counter() - started) / STEPS)
    return statistics.median(loops)


def measure(name: str, rows: int, device: torch.device) -> dict:
    model = model_for(name, device)
    xs = [torch.randn(rows, HIDDEN, device=device, dtype=torch.bfloat16) for _ in range(4)]
    row: dict[str, Any] = {"backend": name, "rows": rows, "layers": LAYERS, "hidden": HIDDEN}
    with torch.no_grad():
        eager_out = model(xs[0]).clone()
        row["eager_us"] = round(step_time(model, xs) * 1e6, 2)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(xs[0])
        row["graph_breaks"] = explained.graph_break_count
        row["break_reasons"] = [str(b.reason)[:200] for b in explained.break_reasons]
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
        compiled = torch.compile(model, mode="reduce-overhead")
        try:
            for _ in range(3):
                compiled(xs[0])
            row["cudagraph_skips"] = int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])
            compiled_out = compiled(xs[0]).clone()
            row["compiled_us"] = round(step_time(compiled, xs) * 1e6, 2)
            row["compiled_max_abs_diff"] = float((compiled_out.float() - eager_out.float()).abs().max())
            row["compiled_equal"] = bool(torch.equal(compiled_out, eager_out))
            if PROFILE:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    for i in range(5):
                        compiled(xs[i % len(xs)])
                    torch.cuda.synchronize()
                print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12), flush=True)
        except Exception as exc:  # noqa: BLE001 - recorded: a backend that does not compile says why
            row["compiled_error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        torch._dynamo.reset()
    print(json.dumps(row), flush=True)
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--rows", default="1,16")
    parser.add_argument("--which", default="triton-nf4,bitsandbytes,torch-int4-tinygemm")
    parser.add_argument("--profile", action="store_true", help="print the compiled step's kernels")
    args = parser.parse_args()
    global PROFILE
    PROFILE = args.profile
    device = torch.device("cuda")
    torch._logging.set_logs(perf_hints=True)  # says why inductor skips a CUDA graph, if it does
    results = [measure(name, int(rows), device) for rows in args.rows.split(",") for name in args.which.split(",")]
    meta = {"device": torch.cuda.get_device_name(device), "torch": torch.__version__}
    with args.out.open("a") as out:
        out.write("".join(json.dumps({**meta, **r}) + "\n" for r in results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
