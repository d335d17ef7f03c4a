"""Peers timed beside the backends: torch's int4 tinygemm and the unquantized bf16 layer.

Why: a claim that a 4-bit kernel is fast means little without the fastest 4-bit matmul
torch ships in the same run (``torch.ops.aten._weight_int4pack_mm``, issue 27), nor
without the layer it replaces: ``F.linear`` on the bf16 weight (issue 52: a 4-bit layer
should be no slower than it). They are peers, not backends: the suites never judge them,
their entries carry their own format labels (``int4-g64``: int4 with a bf16 scale and zero
point per group of 64 along K, 4.5 stored bits per weight as NF4 at blocksize 64 with fp32
absmax; ``bf16``: 16 bits per weight) and no bitsandbytes ratio. CUDA, bf16 only; timed
once per matmul case (shape, rows), the first time any backend's case runs, with the
suite's timing: device time (``bench.device_times``) and eager time (``bench.eager_time``).
"""

from __future__ import annotations

import statistics
import warnings
from typing import Any

import pytest
import torch

from pytest_qconform.benchmark import harness as bench
from pytest_qconform.report.benchmarks import Benchmark
from pytest_qconform.report.records import dump

PEER = "torch-int4-tinygemm"
PEER_FORMAT = "int4-g64"
DENSE = "torch-bf16-dense"
DENSE_FORMAT = "bf16"
GROUP = 64
INNER_K_TILES = 8  # what torchao passes for bf16 on sm80+; K must be a multiple of 16 * 8
_DONE = pytest.StashKey["set[tuple[Any, ...]]"]()


def _packed_weight(
    n: int, k: int, device: torch.device, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """(tinygemm-packed int4 weight, scales_and_zeros [K / GROUP, N, 2] bf16) of random codes."""
    codes = torch.randint(0, 16, (n, k), generator=generator, device=device, dtype=torch.int32)
    as_bytes = (codes[:, ::2] << 4 | codes[:, 1::2]).to(torch.uint8)
    packed = torch.ops.aten._convert_weight_to_int4pack(as_bytes, INNER_K_TILES)
    scales_and_zeros = torch.rand((k // GROUP, n, 2), generator=generator, device=device).to(torch.bfloat16)
    return packed, scales_and_zeros


def time_peer_once(
    harness: Any, shape: tuple[int, int], batch: int, dtype: torch.dtype, facts: bench.DeviceFacts
) -> None:
    """Time the peers for this case unless they were timed already in this session; record
    each on ``harness.item`` like a backend's entry."""
    n, k = shape
    key = (harness.target.id, shape, batch, dtype)
    done = harness.config.stash.setdefault(_DONE, set())
    if key in done or dtype != torch.bfloat16 or k % (16 * INNER_K_TILES) or k % GROUP:
        return
    done.add(key)
    device = harness.device
    generator = torch.Generator(device=device).manual_seed(bench.SEED + 2)
    activation_bytes, output_bytes = batch * k * 2, batch * n * 2
    case = (shape, batch, facts)
    weight_bytes = n * k // 2 + (k // GROUP) * n * 2 * 2
    count = bench.copies_for(weight_bytes + activation_bytes, facts.cache_bytes)
    try:
        weights = [_packed_weight(n, k, device, generator) for _ in range(count)]
    except (RuntimeError, AttributeError) as exc:  # a torch without the op for this device: no peer, say why
        warnings.warn(
            f"benchmark peer {PEER}: cannot pack a {n}x{k} weight on {device} "
            f"({type(exc).__name__}: {exc}); the report has no {PEER} entry for it",
            stacklevel=2,
        )
    else:
        xs = [torch.randn(batch, k, generator=generator, device=device).to(dtype) for _ in range(count)]

        def call(i: int) -> torch.Tensor:
            packed, scales_and_zeros = weights[i]
            return torch.ops.aten._weight_int4pack_mm(xs[i], packed, GROUP, scales_and_zeros)

        _record(harness, PEER, PEER_FORMAT, call, count, (weight_bytes, activation_bytes, output_bytes), case)
        del weights
    dense_bytes = n * k * 2
    count = bench.copies_for(dense_bytes + activation_bytes, facts.cache_bytes)
    dense = [torch.randn(n, k, generator=generator, device=device).to(dtype) for _ in range(count)]
    dense_xs = [torch.randn(batch, k, generator=generator, device=device).to(dtype) for _ in range(count)]
    _record(
        harness,
        DENSE,
        DENSE_FORMAT,
        lambda i: torch.nn.functional.linear(dense_xs[i], dense[i]),
        count,
        (dense_bytes, activation_bytes, output_bytes),
        case,
    )


def _record(
    harness: Any,
    name: str,
    format: str,
    call: Any,
    count: int,
    moved: tuple[int, int, int],
    case: tuple[tuple[int, int], int, bench.DeviceFacts],
) -> None:
    """Time ``call(i)`` over ``count`` rotated inputs (device and eager time) and record it
    on ``harness.item`` as peer ``name``'s entry; ``moved``: (weight, activation, output)
    bytes, ``case``: (shape, batch, the device's facts)."""
    weight_bytes, activation_bytes, output_bytes = moved
    shape, batch, facts = case
    device = harness.device
    with torch.no_grad(), torch.cuda.device(device):
        times, hidden = bench.device_times(call, count, bench.GPU_SAMPLES, facts, device)
        eager = bench.eager_time(call, count, device)
    entry = Benchmark(
        backend=name,
        operation="matmul",
        format=format,
        dtype="bf16",
        target=harness.target.id,
        shape=shape,
        batch=batch,
        median_s=statistics.median(times),
        timing="cuda-events",
        samples=len(times),
        copies=count,
        rotated_bytes=count * (weight_bytes + activation_bytes),
        weight_bytes=weight_bytes,
        activation_bytes=activation_bytes,
        output_bytes=output_bytes,
        copy_bandwidth_bytes_per_s=facts.copy_bandwidth_bytes_per_s,
        launch_hidden=hidden,
        nodeid=f"{harness.item.nodeid}::{name}",
        eager_median_s=eager,
    )
    harness.item.user_properties.append((bench.PROPERTY, dump(entry)))
