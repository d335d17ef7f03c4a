"""Time the fused GEMMs' configurations against dense bf16 and the route before them (issue 52 item 2).

Why: ``kernels/nf4_tc_gemm.py`` (``--kernel tc``) and ``kernels/nf4_ws_gemm.py`` (``--kernel
ws``, the warp-specialized Gluon GEMM, sm_90) ship a configuration table by rows and a route
threshold per arch class (``TC_MAX_ROWS``, ``WS_MAX_ROWS``); they come from this sweep, as the
tensor-core kernel's came from ``mma_configs.py`` (bench/notes.md v16-v19, v21, v22).

For each shape (N x K: 4096x4096, 8192x8192, 14336x4096, 4096x14336) and each row count
(16 ... 8192), bf16, NF4 blocksize 64, this times on one GPU (device time as the benchmark
suite takes it: ``harness.device_times``, calls queued behind a sleep, weights and x
rotated through copies that total twice the L2, median of ``--samples``):

- ``dense``: ``F.linear`` on the unquantized bf16 weight (the peer to beat);
- ``route``: the route without the swept kernel, ``plans.linear_plan`` with it off (for
  ``ws``: both GEMMs off): the fused kernels up to 32 rows, dequantize into the adapter's
  buffer + cuBLAS past (with ``tc``'s route where ``ws`` is swept and ``tc`` is on);
- ``table``: the swept kernel with its module's table configuration for the case (past 32
  rows through ``plans.linear_plan`` with its route forced on);
- ``<config>``: the kernel under each candidate of the rows' class (``grid``), through its
  plan function (a plan per weight copy, built once, as the adapter keeps it).

Every result (the route's too) is first checked against the dequantize-then-matmul
product (x times ``dequantize_4bit``'s bf16 weight, in fp32): ``error`` is the largest
deviation as a multiple of ``2 (K + 2) 2^-24 |x||W| + 2^-7 |y|`` (the fp32 sums of the
result and of the reference, one bf16 rounding: bf16's unit roundoff is 2^-8; each term
twice what it can be); above 1 a configuration is reported as failed and not timed (a
layout bug is off by far more; the suites judge the real bounds).

Before timing, every kernel variant the sweep will launch is compiled in ``--jobs``
processes into Triton's cache (captured on the meta device as the compile check does, then
``warmup``), so the run stays within a few minutes on a fresh machine. Past ``--budget-s``
no more candidates are timed (said in the output; dense, route and table still are).

Prints one table per shape and writes JSON (``$OUT/tc_gemm_sweep.json`` when ``OUT`` is set,
else ``--out``), rewritten after every case so a cut-short run keeps what it measured:
every timing, the best configuration per (shape, rows), where the tensor-core GEMM beats
the route and dense (crossovers), and a suggested table and ``TC_MAX_ROWS`` for this
arch class.

    python triton-nf4/bench/tc_gemm_sweep.py [--shapes 8192x8192 ...] [--rows 64 128 ...] [--double-quant]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path
from typing import Any

import torch

SHAPES = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336))  # (N, K)
ROWS = (32, 64, 128, 256, 512)
SAMPLES = 30
BLOCKSIZE = 64


def grid(rows: int, kernel: str = "tc") -> list[Any]:
    """The candidate configurations for ``rows`` (bf16 x).

    ``tc``: tiles of x rows as wide as the rows (a power of two, 32 at least) and half that;
    weight tiles of 64 rows with 4 or 8 warps and of 128 rows with 8; 3 or 4 pipeline
    stages; K split 1, 2, 4 or 8 ways (K steps of 64, the scratch sweep's best: bench/notes.md
    v21). 48 a case.

    ``ws``: x tiles of the rows' width (32, 64, 128 or 256) and the next narrower; 4 or 6 ring
    slots (3 or 4 at 256 rows, whose slots are larger); the register budget of the row
    class (72 to 168: how many programs share a multiprocessor) and another; from 64 rows,
    two consumer warpgroups sharing each x tile (128 weight rows a program, session 62,
    compiled but not yet timed); K split by the plan's rule, or 1, 2 or 4 ways (bench/notes.md
    v22)."""
    if kernel == "ws":
        from qconform_triton_nf4.kernels.nf4_ws_gemm import WsConfig as W

        # (x tile, registers a thread: how many programs share a multiprocessor, consumer warpgroups)
        classes = {
            32: [(32, 72, 1), (32, 96, 1)],
            64: [(64, 96, 1), (64, 80, 1), (64, 96, 2)],
            128: [(128, 128, 1), (64, 96, 1), (128, 128, 2)],
            256: [(256, 168, 1), (128, 128, 1), (256, 168, 2)],
        }
        wide = 32 if rows <= 32 else 64 if rows <= 64 else 128 if rows <= 128 else 256
        stages = (3, 4) if wide == 256 else (4, 6)
        return [
            W(m, slots, registers, split, warpgroups=groups)
            for m, registers, groups in classes[wide]
            for slots in stages
            for split in (0, 1, 2, 4)
        ]
    from qconform_triton_nf4.kernels.nf4_tc_gemm import TcConfig as C

    wide = max(32, 1 << (rows - 1).bit_length())
    return [
        C(m, n, 64, warps, stages, split)
        for m in sorted({max(32, wide // 2), wide})
        for n, warps in ((64, 4), (64, 8), (128, 8))
        for stages in (3, 4)
        for split in (1, 2, 4, 8)
    ]


def case_configs(n: int, rows: int, device: torch.device, kernel: str = "tc") -> list[tuple[str, Any]]:
    """(name, configuration) of every timing of the swept kernel in a case: the table's, then the grid's."""
    from qconform_triton_nf4.kernels import nf4_tc_gemm, nf4_ws_gemm

    table = nf4_ws_gemm.config_for(rows) if kernel == "ws" else nf4_tc_gemm.config_for(rows, device)
    return [("table", table)] + [(c.label(), c) for c in grid(rows, kernel)]


# ------------------------------------------------------------------ compiling ahead


def _captured_launches(jobs: list[tuple[int, int, int, dict, str]], multiprocessors: int) -> list[Any]:
    """The launches of the swept kernel for each (N, K, rows, config, kernel) job, captured
    on the meta device as a process on this CUDA GPU would make them (the compile check's replay)."""
    from qconform_triton_nf4 import kernels
    from qconform_triton_nf4.compile import check as compile_check
    from qconform_triton_nf4.kernels.nf4_tc_gemm import TcConfig
    from qconform_triton_nf4.kernels.nf4_ws_gemm import WsConfig

    meta = torch.device("meta")
    code = torch.empty(16, dtype=torch.float32, device=meta)
    launches: list[Any] = []
    with compile_check._platform("cuda", multiprocessors, True, ws=True), compile_check._captured(launches):
        for n, k, rows, config, kernel in jobs:
            entry, make = (kernels.ws_gemm_4bit, WsConfig) if kernel == "ws" else (kernels.tc_gemm_4bit, TcConfig)
            entry(
                torch.empty(rows, k, dtype=torch.bfloat16, device=meta),
                torch.empty(n * k // 2, dtype=torch.uint8, device=meta),
                torch.empty(n * k // BLOCKSIZE, dtype=torch.float32, device=meta),
                blocksize=BLOCKSIZE,
                shape=(n, k),
                code=code,
                config=make(**config),
            )
    return launches


def _variant_key(launch: Any) -> str:
    dtypes = [str(a.dtype) for a in launch.args if isinstance(a, torch.Tensor)]
    return json.dumps([dtypes, {k: repr(v) for k, v in sorted(launch.kwargs.items())}])


def _compile_jobs(jobs: list[tuple[int, int, int, dict, str]], multiprocessors: int) -> list[str]:
    """In a worker: compile the launches of ``jobs`` for this GPU into Triton's cache
    (``JITFunction.warmup``: compiled, not run). Returns one message per failure."""
    errors = []
    for launch in _captured_launches(jobs, multiprocessors):
        try:
            launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.kwargs)
        except Exception as exc:  # noqa: BLE001 - reported; the timing loop reports it again
            errors.append(f"{_variant_key(launch)[:200]}: {type(exc).__name__}: {str(exc)[-300:]}")
    return errors


def compile_ahead(jobs: list[tuple[int, int, int, dict, str]], multiprocessors: int, workers: int) -> dict:
    """Compile each distinct kernel variant of ``jobs`` once, spread over ``workers``
    spawned processes; the timing loop then finds them in Triton's cache."""
    started = time.perf_counter()
    unique: dict[str, tuple[int, int, int, dict, str]] = {}
    for job in jobs:
        (launch,) = _captured_launches([job], multiprocessors)
        unique.setdefault(_variant_key(launch), job)
    shares = [list(unique.values())[i::workers] for i in range(workers)]
    errors: list[str] = []
    with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
        for share_errors in pool.map(_compile_jobs, [s for s in shares if s], [multiprocessors] * workers):
            errors += share_errors
    return {"variants": len(unique), "seconds": round(time.perf_counter() - started, 1), "errors": errors}


# ------------------------------------------------------------------ timing


def _timed(call: Any, count: int, samples: int, facts: Any, device: torch.device) -> dict:
    """Median device time of ``call(i)`` over ``count`` rotated inputs; on the CPU (a smoke
    run of this script in Triton's interpreter, ``--device cpu``) the host's clock."""
    from pytest_qconform.benchmark import harness

    if device.type == "cpu":
        times = []
        for i in range(samples):
            begun = time.perf_counter()
            call(i % count)
            times.append(time.perf_counter() - begun)
        return {"us": round(statistics.median(times) * 1e6, 2), "hidden": False}
    times, hidden = harness.device_times(call, count, samples, facts, device)
    return {"us": round(statistics.median(times) * 1e6, 2), "hidden": hidden}


def _error(got: torch.Tensor, reference: torch.Tensor, magnitude: torch.Tensor, k: int) -> float:
    """The largest deviation of ``got`` from the fp32 dequantize-then-matmul ``reference``
    as a multiple of 2 (K + 2) 2^-24 |x||W| + 2^-7 |y| (module docstring)."""
    bound = 2 * (k + 2) * 2.0**-24 * magnitude + 2.0**-7 * reference.abs() + 2.0**-120
    return float(((got.float() - reference).abs() / bound).max())


def _commit() -> str | None:
    try:
        here = Path(__file__).resolve().parent
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10
            ).stdout.strip()
            or None
        )
    except Exception:  # noqa: BLE001 - a machine without git
        return None


def summarize(cases: list[dict], fused_max_rows: int) -> dict:
    """The best configuration per (shape, rows), the crossovers per shape, and a suggested
    table (per rows, the grid configuration whose worst ratio to the best across the
    shapes is smallest) and TC_MAX_ROWS (the most rows up to which the
    suggested configuration beats the route at every swept shape and row count past the
    fused kernels)."""
    best: dict[str, dict[str, Any]] = {}
    crossovers: dict[str, Any] = {}
    for case in cases:
        timed = {name: t for name, t in case["tc"].items() if "us" in t}
        if not timed:
            continue
        name = min(timed, key=lambda key: timed[key]["us"])
        case["best"] = {**timed[name], "label": name}
        best.setdefault(case["shape"], {})[str(case["rows"])] = {
            "config": timed[name].get("config"),
            "label": name,
            "us": timed[name]["us"],
            "route_us": case["route"].get("us"),
            "dense_us": case["dense"].get("us"),
        }
    for shape, by_rows in best.items():
        rows = sorted(by_rows, key=int)
        beats_route = [int(r) for r in rows if by_rows[r]["route_us"] and by_rows[r]["us"] < by_rows[r]["route_us"]]
        beats_dense = [int(r) for r in rows if by_rows[r]["dense_us"] and by_rows[r]["us"] <= by_rows[r]["dense_us"]]
        crossovers[shape] = {
            "tc_beats_route_at_rows": beats_route,
            "tc_beats_dense_at_rows": beats_dense,
            "route_beats_dense_at_rows": [
                int(r) for r in rows if by_rows[r]["route_us"] and by_rows[r]["route_us"] <= by_rows[r]["dense_us"]
            ],
        }
    table: dict[str, dict[str, Any]] = {}
    for rows in sorted({c["rows"] for c in cases}):
        group = [c for c in cases if c["rows"] == rows and c.get("best")]
        names = (
            [n for n in group[0]["tc"] if n != "table" and all("us" in c["tc"].get(n, {}) for c in group)]
            if group
            else []
        )
        if not names:
            continue

        def worst(name: str, group: list[dict] = group) -> float:
            return max(c["tc"][name]["us"] / c["best"]["us"] for c in group)

        chosen = min(names, key=worst)
        table[str(rows)] = {
            "config": group[0]["tc"][chosen]["config"],
            "label": chosen,
            "worst_ratio_to_best": round(worst(chosen), 3),
            "us": {c["shape"]: c["tc"][chosen]["us"] for c in group},
            "route_us": {c["shape"]: c["route"].get("us") for c in group},
        }
    tc_max_rows = 0
    for rows in sorted(int(r) for r in table):
        if rows <= fused_max_rows:
            continue
        entry = table[str(rows)]
        wins = all(
            entry["route_us"][shape] is not None and us < entry["route_us"][shape] for shape, us in entry["us"].items()
        )
        if not wins:
            break
        tc_max_rows = rows
    return {"best": best, "crossovers": crossovers, "suggested_table": table, "suggested_tc_max_rows": tc_max_rows}


def table_source(suggested: dict) -> str:
    """The suggested table as ``nf4_tc_gemm._GPU_CONFIGS`` source lines."""

    def text(config: dict) -> str:
        return (
            f"TcConfig({config['block_m']}, {config['block_n']}, {config['block_k']}, {config['num_warps']}, "
            f"{config['num_stages']}, {config['split_k']}, {config['group_m']}, {config['programs_per_sm']})"
        )

    lines = []
    rows_list = sorted(int(r) for r in suggested)
    for index, rows in enumerate(rows_list):
        entry = suggested[str(rows)]
        most = "2**31" if index == len(rows_list) - 1 else str(rows)
        lines.append(f"    ({most}, {text(entry['config'])}),")
    return "\n".join(lines)


def print_tables(cases: list[dict]) -> None:
    for shape in dict.fromkeys(c["shape"] for c in cases):
        print(f"\n{shape} (device us, bf16; ratios < 1: the tensor-core GEMM is faster)")
        print(
            f"{'rows':>5} | {'dense':>8} | {'route':>8} | {'table':>8} | {'best':>8} | best/route | best/dense | best config"
        )
        for case in (c for c in cases if c["shape"] == shape):
            dense, route = case["dense"].get("us"), case["route"].get("us")
            table = case["tc"].get("table", {}).get("us")
            best = case.get("best", {})
            us = best.get("us")

            def cell(value: float | None) -> str:
                return f"{value:8.1f}" if value is not None else f"{'-':>8}"

            def ratio(a: float | None, b: float | None) -> str:
                return f"{a / b:10.2f}" if a is not None and b else f"{'-':>10}"

            print(
                f"{case['rows']:>5} | {cell(dense)} | {cell(route)} | {cell(table)} | {cell(us)} | "
                f"{ratio(us, route)} | {ratio(us, dense)} | {best.get('label', '-')}"
            )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tc_gemm_sweep.json"), help="JSON path when $OUT is not set")
    parser.add_argument("--shapes", nargs="*", default=[f"{n}x{k}" for n, k in SHAPES], help="N x K")
    parser.add_argument("--rows", nargs="*", type=int, default=list(ROWS))
    parser.add_argument("--samples", type=int, default=SAMPLES)
    parser.add_argument("--jobs", type=int, default=min(16, os.cpu_count() or 1), help="compile processes (0: none)")
    parser.add_argument("--budget-s", type=float, default=200.0, help="no new candidates timed past this many seconds")
    parser.add_argument("--double-quant", action="store_true")
    parser.add_argument("--kernel", choices=("tc", "ws"), default="tc", help="the GEMM swept (module docstring)")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke run of the script in Triton's interpreter (TRITON_INTERPRET=1)"
    )
    args = parser.parse_args()
    started = time.perf_counter()
    out_path = Path(os.environ["OUT"]) / "tc_gemm_sweep.json" if os.environ.get("OUT") else args.out

    import torch.nn.functional as F

    from pytest_qconform.backends.base import QuantSpec
    from pytest_qconform.backends.registry import create
    from pytest_qconform.benchmark import harness
    from qconform_triton_nf4 import kernels
    from qconform_triton_nf4 import plans as triton_nf4_plans
    from qconform_triton_nf4.backend import FUSED_MAX_ROWS
    from qconform_triton_nf4.kernels import nf4_tc_gemm

    device = torch.device(args.device)
    on_gpu = device.type == "cuda"
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference products in fp32, not tf32
    shapes = [tuple(int(v) for v in text.split("x")) for text in args.shapes]
    multiprocessors = torch.cuda.get_device_properties(device).multi_processor_count if on_gpu else 1
    record: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if on_gpu else "cpu (Triton's interpreter)",
        "capability": list(torch.cuda.get_device_capability(device)) if on_gpu else None,
        "arch_class": nf4_tc_gemm.arch_class(device),
        "multiprocessors": multiprocessors,
        "torch": torch.__version__,
        "triton": __import__("triton").__version__,
        "commit": _commit(),
        "dtype": "bfloat16",
        "format": f"nf4 blocksize {BLOCKSIZE}" + (" double-quant" if args.double_quant else ""),
        "samples": args.samples,
        "fused_max_rows": FUSED_MAX_ROWS,
        "kernel": args.kernel,
        "cases": [],
    }

    def write() -> None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(record, indent=1) + "\n")

    if args.jobs > 0 and on_gpu:
        jobs = [
            (n, k, rows, config.as_dict(), args.kernel)
            for n, k in shapes
            for rows in args.rows
            for _, config in case_configs(n, rows, device, args.kernel)
        ]
        try:
            record["compile_ahead"] = compile_ahead(jobs, multiprocessors, args.jobs)
        except Exception as exc:  # noqa: BLE001 - the timing loop compiles what is missing
            record["compile_ahead"] = {"error": f"{type(exc).__name__}: {exc}"[:500]}
        print(f"compiled ahead: {record['compile_ahead']}", flush=True)

    facts = harness.measure_facts(device)
    ours = create("triton-nf4")
    spec = QuantSpec("nf4", BLOCKSIZE, double_quant=args.double_quant)
    dtype = torch.bfloat16
    skipped_for_budget = 0
    with torch.no_grad():
        for n, k in shapes:
            gen = torch.Generator(device=device).manual_seed(0)
            weight = torch.randn(n, k, generator=gen, device=device).to(dtype)
            first = ours.quantize(weight, spec)
            state_bytes = first.handle.packed.numel() + first.handle.absmax.numel() * first.handle.absmax.element_size()
            count = harness.copies_for(state_bytes, facts.cache_bytes)
            states = [first.handle] + [copy.deepcopy(first.handle) for _ in range(count - 1)]
            dense_weights = [weight] + [
                weight.clone() for _ in range(harness.copies_for(n * k * 2, facts.cache_bytes) - 1)
            ]
            state = states[0]
            dequantized = kernels.dequantize_4bit(
                state.packed, state.absmax, out_dtype=dtype, **state.kernel_args()
            ).float()  # what dequantize-then-matmul multiplies, widened exactly
            for rows in args.rows:
                xs = [torch.randn(rows, k, generator=gen, device=device).to(dtype) for _ in range(count)]
                reference = xs[0].float() @ dequantized.T
                magnitude = xs[0].float().abs() @ dequantized.abs().T
                case: dict[str, Any] = {"shape": f"{n}x{k}", "n": n, "k": k, "rows": rows, "copies": count, "tc": {}}
                n_dense = len(dense_weights)
                case["dense"] = _timed(
                    lambda i, xs=xs, ws=dense_weights, c=count, d=n_dense: F.linear(xs[i % c], ws[i % d]),
                    max(count, n_dense),
                    args.samples,
                    facts,
                    device,
                )

                def routed(swept_max_rows: int, xs: list[torch.Tensor] = xs, states: list[Any] = states) -> list[Any]:
                    """The adapter's plan per weight copy, the swept GEMM routed up to ``swept_max_rows``
                    (with ``ws`` swept, the tensor-core GEMM's threshold its arch class's)."""
                    thresholds = (
                        {"ws_max_rows": swept_max_rows}
                        if args.kernel == "ws"
                        else {"tc_max_rows": swept_max_rows, "ws_max_rows": 0}
                    )
                    return [
                        triton_nf4_plans.linear_plan(
                            xs[i],
                            s.packed,
                            s.absmax,
                            s.kernel_args(),
                            None,
                            FUSED_MAX_ROWS,
                            lambda dt, s=s: ours.buffered_weight(s, dt),
                            **thresholds,
                        )
                        for i, s in enumerate(states)
                    ]

                try:
                    route_plans = routed(0)  # the route without the swept GEMM
                    route_error = _error(route_plans[0](xs[0], None), reference, magnitude, k)
                    case["route"] = _timed(
                        lambda i, xs=xs, p=route_plans: p[i](xs[i], None), count, args.samples, facts, device
                    ) | {"error": round(route_error, 3)}
                except Exception as exc:  # noqa: BLE001 - reported; the candidates still run
                    case["route"] = {"failed": f"{type(exc).__name__}: {exc}"[-400:]}
                route_plans = []
                for name, config in case_configs(n, rows, device, args.kernel):
                    entry: dict[str, Any] = {"config": config.as_dict()}
                    case["tc"][name] = entry
                    if name != "table" and time.perf_counter() - started > args.budget_s:
                        entry["skipped"] = "past --budget-s"
                        skipped_for_budget += 1
                        continue
                    try:
                        if name == "table" and rows > FUSED_MAX_ROWS:
                            tc_plans = routed(2**31)  # the route forced on: the table's configuration
                        else:
                            plan_of = kernels.ws_gemm_4bit_plan if args.kernel == "ws" else kernels.tc_gemm_4bit_plan
                            tc_plans = [
                                plan_of(xs[i], s.packed, s.absmax, config=config, **s.kernel_args())
                                for i, s in enumerate(states)
                            ]
                        entry["splits"] = tc_plans[0].splits
                        entry["error"] = round(_error(tc_plans[0](xs[0], None), reference, magnitude, k), 3)
                        if entry["error"] > 1:
                            entry["failed"] = "result outside the dequantize-then-matmul check"
                            continue
                        entry.update(
                            _timed(lambda i, xs=xs, p=tc_plans: p[i](xs[i], None), count, args.samples, facts, device)
                        )
                    except Exception as exc:  # noqa: BLE001 - a configuration that does not compile or run
                        entry["failed"] = f"{type(exc).__name__}: {exc}"[-400:]
                    finally:
                        tc_plans = []
                record["cases"].append(case)
                summary = summarize(record["cases"], FUSED_MAX_ROWS)
                record.update(summary)
                write()
                best = case.get("best", {})
                print(
                    f"{n}x{k} rows {rows}: dense {case['dense']['us']} route {case['route'].get('us')} "
                    f"best {best.get('us')} ({best.get('label')}) [{time.perf_counter() - started:.0f} s]",
                    flush=True,
                )
                del xs, reference, magnitude
            del states, dense_weights, dequantized, weight, first
            if on_gpu:
                torch.cuda.empty_cache()
    record["skipped_for_budget"] = skipped_for_budget
    record["seconds"] = round(time.perf_counter() - started, 1)
    write()
    print_tables(record["cases"])
    print("\nCrossovers (rows where the best tensor-core configuration beats the route / dense):")
    for shape, found in record.get("crossovers", {}).items():
        print(f"  {shape}: {json.dumps(found)}")
    suggested = record.get("suggested_table", {})
    if suggested:
        module = "nf4_ws_gemm" if args.kernel == "ws" else "nf4_tc_gemm"
        print(f"\nSuggested {module}._GPU_CONFIGS for {record['arch_class']} (worst ratio to each case's best):")
        if args.kernel == "tc":
            print(table_source(suggested))
        for rows, entry in sorted(suggested.items(), key=lambda item: int(item[0])):
            print(f"  rows {rows}: {entry['label']} x{entry['worst_ratio_to_best']}")
    threshold = "WS_MAX_ROWS" if args.kernel == "ws" else "TC_MAX_ROWS"
    print(f"\nSuggested {threshold}[{record['arch_class']!r}] = {record.get('suggested_tc_max_rows', 0)}")
    if skipped_for_budget:
        print(f"{skipped_for_budget} candidate timings skipped past --budget-s {args.budget_s}")
    print(f"JSON: {out_path} ({record['seconds']} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
