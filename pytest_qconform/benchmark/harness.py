"""Timing for the benchmark suite (``suites/test_benchmark.py``): shapes, bytes, input
rotation, device timing and the copy floor each result is compared with.

How a case is timed, and why:

- **GPU: CUDA events, not pytest-benchmark's timer.** pytest-benchmark times on the host
  (``time.perf_counter``); a kernel launch returns before the kernel ran, and adding
  ``torch.cuda.synchronize()`` to each call adds the host's launch and wake-up latency
  (several microseconds, comparable to a batch-1 gemv) to every sample. So each call is
  bracketed by CUDA events and the events' elapsed time is the sample. Before a batch of
  calls the stream is held by ``torch.cuda._sleep`` long enough for the host to queue the
  whole batch, so the device runs the calls back to back and a sample is device time
  alone, not Python or launch overhead; ``launch_hidden`` says whether that held (the
  device had not started the batch when the host finished queuing it; if a backend
  synchronizes inside its call it cannot hold, and the sample includes the gaps). The
  result is the median over ``GPU_SAMPLES`` samples (fewer, down to ``LEAST_SAMPLES``,
  where they would take more than ``MEASURE_SECONDS``) after a warm-up that compiles,
  autotunes and fills the allocator. pytest-benchmark still runs (``benchmark.pedantic``)
  on a synchronized call: its table is the latency a host sees (``host_median_s``).
- **Weights out of L2.** A benchmark that reads the same 9 MB weight every call times
  the L2 cache (50 MB on an H100), not memory. Each case rotates through copies of its
  inputs (weight state and activations) whose total is at least ``ROTATE_FACTOR`` times
  the L2 size, so a copy is evicted before it is read again. (``triton.testing.do_bench``
  flushes L2 with a memset before every call instead; rotation keeps the flush out of
  the stream and makes back-to-back queuing possible.)
- **The floor.** The bytes a call cannot avoid moving (``weight_bytes``: the stored
  packed codes, absmax or scale/zero, nested state and code tables, as the backend
  stores them; activations read; output written), divided by the bandwidth of a
  device-to-device copy of a buffer much larger than L2, timed the same way once per
  session and device (``config.stash``). ``percent_of_floor`` is 100 at copy speed.
- **CPU** (``--qconform-bench-shapes=small`` only): pytest-benchmark's own timer, with
  ``benchmark.pedantic`` rotating the copies; the floor uses a host memory copy. Small
  shapes fit in CPU caches, so CPU numbers check the plumbing, they are not a roofline.
"""

from __future__ import annotations

import copy
import itertools
import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from pytest_qconform.backends.base import Backend, Quantized, QuantSpec
from pytest_qconform.hardware.targets import Target
from pytest_qconform.reference.packed import PackedBnb4, PackedHqq4
from pytest_qconform.report.benchmarks import RATIO_BASELINE, Benchmark, BenchOperation, Timing
from pytest_qconform.report.records import dump
from pytest_qconform.vocabulary import DtypeLabel

FULL_SHAPES: tuple[tuple[int, int], ...] = ((4096, 4096), (8192, 8192), (14336, 4096), (4096, 14336))  # (N, K)
SMALL_SHAPES: tuple[tuple[int, int], ...] = tuple((n // 32, k // 32) for n, k in FULL_SHAPES)
BATCHES: tuple[int, ...] = (1, 4, 16, 64, 128, 256, 512, 2048, 8192)

MARKER = "qconform_benchmark"
PROPERTY = "qconform_benchmark"  # user_properties key carrying a result's to_dict() to the recorder
SKIP_PREFIX = "benchmark:"

ROTATE_FACTOR = 2  # rotated inputs total at least this many cache sizes
MIN_COPIES, MAX_COPIES = 2, 64
FALLBACK_L2_BYTES = 50 * 2**20  # when torch does not report the L2 size (H100: 50 MB)
CPU_CACHE_BYTES = 32 * 2**20  # an assumed last-level cache, for the CPU rotation
GPU_SAMPLES = 200  # timed calls per case (median)
GPU_QUEUE = 50  # calls queued behind one sleep
GPU_WARMUP_CALLS = 10
HOST_ROUNDS = 20  # pytest-benchmark rounds of a synchronized call (GPU)
EAGER_LOOPS, EAGER_CALLS = 7, 100  # eager time: median over loops of this many back-to-back calls
# The timed calls of one measurement are fewer where a call is slow, so that a case takes
# about this long (the peer tinygemm takes 37-65 ms a call at 8192 rows: its 200 device and
# 700 eager calls were a minute a case), but never fewer than these many.
MEASURE_SECONDS = 1.0
LEAST_SAMPLES, LEAST_EAGER_CALLS = 20, 5


def calls_within(seconds_per_call: float, most: int, least: int, budget_s: float = MEASURE_SECONDS) -> int:
    """How many calls of ``seconds_per_call`` fit ``budget_s``, from ``least`` to ``most``."""
    fitting = int(budget_s / seconds_per_call) if seconds_per_call > 0 else most
    return max(least, min(most, fitting))


CPU_ROUNDS, CPU_WARMUP_ROUNDS = 20, 2
GPU_COPY_MIN_BYTES, CPU_COPY_BYTES = 256 * 2**20, 64 * 2**20
SEED = 0


@dataclass(frozen=True)
class DeviceFacts:
    """What every case on one device is measured against, measured once per session."""

    cache_bytes: int  # L2 on a GPU; CPU_CACHE_BYTES on the CPU
    copy_bandwidth_bytes_per_s: float  # (read + write) bytes / time of a large copy
    sleep_cycles_per_s: float | None  # torch.cuda._sleep calibration; None on the CPU


_FACTS = pytest.StashKey["dict[str, DeviceFacts]"]()
_WEIGHTS = pytest.StashKey["dict[tuple[Any, ...], tuple[Quantized, int]]"]()
_BASELINES = pytest.StashKey["dict[tuple[Any, ...], float]"]()  # bitsandbytes' median per case


# ---------------------------------------------------------------- selection


def shapes(config: pytest.Config) -> tuple[tuple[int, int], ...]:
    return SMALL_SHAPES if config.getoption("qconform_bench_shapes") == "small" else FULL_SHAPES


def shape_id(shape: tuple[int, int]) -> str:
    return f"{shape[0]}x{shape[1]}"


def skip_reason(config: pytest.Config, target: Target) -> str | None:
    """Why this benchmark does not run here, or None when it does."""
    if not config.getoption("benchmark_only", default=False):
        return (
            f"{SKIP_PREFIX} run with --benchmark-only (pytest --qconform --benchmark-only); "
            "a plain --qconform run checks conformance and times nothing"
        )
    if target.kind == "cpu" and config.getoption("qconform_bench_shapes") != "small":
        return (
            f"{SKIP_PREFIX} full-size shapes ({', '.join(map(shape_id, FULL_SHAPES))}) are too slow on the CPU; "
            "pass --qconform-bench-shapes=small to time small shapes there"
        )
    return None


def is_benchmark(item: pytest.Item) -> bool:
    return item.get_closest_marker(MARKER) is not None


def _order_key(item: pytest.Item) -> tuple[Any, ...]:
    params = item.callspec.params if hasattr(item, "callspec") else {}
    backend = str(params.get("qbackend", ""))
    target = params.get("qtarget")
    spec = params.get("spec")
    operation = item.get_closest_marker("qconform_operation")
    return (
        backend != RATIO_BASELINE,
        backend,
        getattr(target, "id", ""),
        spec.label() if spec else "",
        params.get("qbench_shape", ()),
        operation.args[0] if operation else "",
        params.get("batch", 0),
    )


def order_items(items: list[pytest.Item]) -> None:
    """Benchmarks last, bitsandbytes first among them (so the others' ``extra_info`` gets
    its ratio), and cases sharing a quantized weight adjacent (it is quantized once)."""
    benchmarks = [item for item in items if is_benchmark(item)]
    if benchmarks:
        items[:] = [item for item in items if not is_benchmark(item)] + sorted(benchmarks, key=_order_key)


# ---------------------------------------------------------------- bytes


def _itemsize(dtype_name: str) -> int:
    from pytest_qconform.backends.adapter_helpers import dtype_from_name

    try:
        return dtype_from_name(dtype_name).itemsize
    except ValueError as exc:
        raise ValueError(f"{exc} stored in an HQQ export") from None


def weight_state_bytes(packed: PackedBnb4 | PackedHqq4) -> int:
    """Bytes of the stored quantized weight, as the backend stores it (what a dequantize
    or matmul must read at least once)."""
    if isinstance(packed, PackedBnb4):
        arrays = [packed.packed, packed.absmax, packed.code]
        if packed.double_quant:
            arrays += [packed.nested_absmax, packed.nested_code]
        return int(sum(a.nbytes for a in arrays))
    # HQQ exports bf16 scale/zero widened to fp32 (NumPy has no bf16): count the stored dtype.
    meta = packed.meta
    return int(
        packed.packed.nbytes
        + packed.scale.size * _itemsize(meta.get("scale_dtype", packed.scale.dtype.name))
        + packed.zero.size * _itemsize(meta.get("zero_dtype", packed.zero.dtype.name))
    )


def copies_for(bytes_per_copy: int, cache_bytes: int) -> int:
    """How many input copies to rotate through so that they total ROTATE_FACTOR caches."""
    return max(MIN_COPIES, min(MAX_COPIES, math.ceil(ROTATE_FACTOR * cache_bytes / max(bytes_per_copy, 1))))


# ---------------------------------------------------------------- timing


def _cuda_sleep(seconds: float, facts: DeviceFacts) -> None:
    torch.cuda._sleep(int(min(seconds, 2.0) * (facts.sleep_cycles_per_s or 0)))


def device_times(
    call: Callable[[int], Any], n_inputs: int, samples: int, facts: DeviceFacts, device: torch.device
) -> tuple[list[float], bool]:
    """Per-call device seconds of ``call(i % n_inputs)`` for ``samples`` calls after a
    warm-up (fewer where calls are slow: ``calls_within``), and whether every batch was
    queued ahead of the device (launch cost hidden)."""
    counter = itertools.count()

    def next_call() -> None:
        call(next(counter) % n_inputs)

    for _ in range(max(GPU_WARMUP_CALLS, n_inputs)):  # compile, autotune, allocator
        next_call()
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for _ in range(n_inputs):  # host cost of queuing one call, now that nothing compiles
        next_call()
    host_per_call = (time.perf_counter() - started) / n_inputs
    torch.cuda.synchronize(device)
    samples = calls_within((time.perf_counter() - started) / n_inputs, samples, LEAST_SAMPLES)

    queue = min(GPU_QUEUE, samples)
    sleep_s = 2 * queue * host_per_call + 1e-3
    times: list[float] = []
    hidden, retries = True, 0
    while len(times) < samples:
        n = min(queue, samples - len(times))
        events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
        _cuda_sleep(sleep_s, facts)
        events[0].record()
        for i in range(n):
            next_call()
            events[i + 1].record()
        queued = not events[0].query()  # the device is still asleep: it never waited for the host
        torch.cuda.synchronize(device)
        if not queued and retries < 3:
            sleep_s, retries = sleep_s * 4, retries + 1
            continue
        hidden = hidden and queued
        times += [events[i].elapsed_time(events[i + 1]) / 1e3 for i in range(n)]
    return times, hidden


def eager_time(call: Callable[[int], Any], n_inputs: int, device: torch.device) -> float:
    """Seconds per call of ``call(i % n_inputs)`` issued back to back from Python with
    nothing queued ahead: the median over ``EAGER_LOOPS`` loops of ``EAGER_CALLS`` calls
    (fewer where calls are slow: ``calls_within``), each loop closed by one synchronize.
    Whichever is slower, the host issuing a call or the device running it, sets this time:
    it is what a model's forward sees without a CUDA graph (issue 27), where
    ``device_times`` hides the host."""
    for i in range(max(GPU_WARMUP_CALLS, n_inputs)):
        call(i % n_inputs)
    torch.cuda.synchronize(device)
    started = time.perf_counter()
    for i in range(n_inputs):
        call(i % n_inputs)
    torch.cuda.synchronize(device)
    per_loop = calls_within((time.perf_counter() - started) / n_inputs / EAGER_LOOPS, EAGER_CALLS, LEAST_EAGER_CALLS)
    loops = []
    for _ in range(EAGER_LOOPS):
        started = time.perf_counter()
        for i in range(per_loop):
            call(i % n_inputs)
        torch.cuda.synchronize(device)
        loops.append((time.perf_counter() - started) / per_loop)
    return statistics.median(loops)


def _sleep_rate(device: torch.device) -> float:
    """Cycles per second of ``torch.cuda._sleep`` (the SM clock under load)."""
    cycles = 20_000_000
    torch.cuda._sleep(1000)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) / 1e3)


def measure_facts(device: torch.device) -> DeviceFacts:
    """``device``'s facts measured now (its cache size, a device-to-device copy's bandwidth,
    the sleep kernel's rate): what ``device_facts`` keeps per session, for the benchmark
    scripts that run outside one (triton-nf4/bench)."""
    if device.type != "cuda":
        src = torch.empty(CPU_COPY_BYTES, dtype=torch.uint8)
        src.fill_(1)
        dst = torch.empty_like(src)
        for _ in range(2):
            dst.copy_(src)
        times = []
        for _ in range(10):
            started = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - started)
        return DeviceFacts(CPU_CACHE_BYTES, 2 * src.numel() / statistics.median(times), None)
    with torch.cuda.device(device):
        props = torch.cuda.get_device_properties(device)
        l2 = int(getattr(props, "L2_cache_size", 0) or FALLBACK_L2_BYTES)
        partial = DeviceFacts(l2, 1.0, _sleep_rate(device))
        size = max(GPU_COPY_MIN_BYTES, 8 * l2)
        src = torch.ones(size, dtype=torch.uint8, device=device)
        dst = torch.empty_like(src)

        def copy(_: int, src: torch.Tensor = src, dst: torch.Tensor = dst) -> torch.Tensor:
            return dst.copy_(src)

        times, _ = device_times(copy, 1, 30, partial, device)
        del src, dst
        return DeviceFacts(l2, 2 * size / statistics.median(times), partial.sleep_cycles_per_s)


def device_facts(config: pytest.Config, device: torch.device) -> DeviceFacts:
    """This session's facts for ``device``, measured on first use."""
    facts = config.stash.setdefault(_FACTS, {})
    if str(device) not in facts:
        facts[str(device)] = measure_facts(device)
    return facts[str(device)]


# ---------------------------------------------------------------- cases


class Harness:
    """The ``qbench`` fixture's value: times one case and records it (``extra_info`` and
    the run report)."""

    def __init__(self, config: pytest.Config, item: pytest.Item, target: Target) -> None:
        assert target.torch_device is not None
        self.config, self.item, self.target = config, item, target
        self.device = torch.device(target.torch_device)

    def _weight(
        self, backend: Backend, spec: QuantSpec, shape: tuple[int, int], dtype: torch.dtype
    ) -> tuple[Quantized, int]:
        """The case's quantized weight and its stored bytes; the last one is kept (cases
        sharing it run adjacent, see ``order_items``) so it is quantized once."""
        cache = self.config.stash.setdefault(_WEIGHTS, {})
        key = (backend.name, spec, shape, str(self.device), dtype)
        if key not in cache:
            cache.clear()  # free the previous weight before making the next
            generator = torch.Generator(device=self.device).manual_seed(SEED)
            weight = torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32).to(dtype)
            quantized = backend.quantize(weight, spec)
            cache[key] = (quantized, weight_state_bytes(backend.export_packed(quantized)))
        return cache[key]

    def _copies(self, quantized: Quantized, count: int) -> list[Quantized]:
        try:
            return [quantized] + [copy.deepcopy(quantized) for _ in range(count - 1)]
        except Exception as exc:  # noqa: BLE001 - say which backend and what to do
            raise RuntimeError(
                f"benchmark: cannot copy a {quantized.backend} quantized weight to rotate inputs "
                f"({type(exc).__name__}: {exc}); its handle must support copy.deepcopy"
            ) from exc

    def dequantize(
        self, benchmark: Any, backend: Backend, spec: QuantSpec, shape: tuple[int, int], dtype: torch.dtype
    ) -> Benchmark:
        quantized, weight_bytes = self._weight(backend, spec, shape, dtype)
        facts = device_facts(self.config, self.device)
        weights = self._copies(quantized, copies_for(weight_bytes, facts.cache_bytes))
        output_bytes = shape[0] * shape[1] * dtype.itemsize
        self._check(backend.dequantize(weights[0], dtype), shape, dtype, "dequantize")
        return self._time(
            benchmark,
            backend,
            "dequantize",
            spec,
            shape,
            None,
            dtype,
            facts,
            lambda i: backend.dequantize(weights[i], dtype),
            len(weights),
            weight_bytes,
            0,
            output_bytes,
        )

    def matmul(
        self, benchmark: Any, backend: Backend, spec: QuantSpec, shape: tuple[int, int], batch: int, dtype: torch.dtype
    ) -> Benchmark:
        n, k = shape
        quantized, weight_bytes = self._weight(backend, spec, shape, dtype)
        facts = device_facts(self.config, self.device)
        activation_bytes, output_bytes = batch * k * dtype.itemsize, batch * n * dtype.itemsize
        count = copies_for(weight_bytes + activation_bytes, facts.cache_bytes)
        weights = self._copies(quantized, count)
        generator = torch.Generator(device=self.device).manual_seed(SEED + 1)
        xs = [
            torch.randn(batch, k, generator=generator, device=self.device, dtype=torch.float32).to(dtype)
            for _ in range(count)
        ]
        self._check(backend.matmul(xs[0], weights[0], None, dtype), (batch, n), dtype, "matmul")
        return self._time(
            benchmark,
            backend,
            "matmul",
            spec,
            shape,
            batch,
            dtype,
            facts,
            lambda i: backend.matmul(xs[i], weights[i], None, dtype),
            count,
            weight_bytes,
            activation_bytes,
            output_bytes,
        )

    def quantize(
        self, benchmark: Any, backend: Backend, spec: QuantSpec, shape: tuple[int, int], dtype: torch.dtype
    ) -> Benchmark:
        """Quantize a float weight: what loading a 4-bit model costs per layer. The float
        weight read is ``weight_bytes`` (its copies rotate), the stored state written
        ``output_bytes``; no activations."""
        facts = device_facts(self.config, self.device)
        generator = torch.Generator(device=self.device).manual_seed(SEED)
        weight = torch.randn(shape, generator=generator, device=self.device, dtype=torch.float32).to(dtype)
        input_bytes = weight.numel() * dtype.itemsize
        state_bytes = weight_state_bytes(backend.export_packed(backend.quantize(weight, spec)))
        weights = [weight] + [weight.clone() for _ in range(copies_for(input_bytes, facts.cache_bytes) - 1)]
        return self._time(
            benchmark,
            backend,
            "quantize",
            spec,
            shape,
            None,
            dtype,
            facts,
            lambda i: backend.quantize(weights[i], spec),
            len(weights),
            input_bytes,
            0,
            state_bytes,
        )

    @staticmethod
    def _check(out: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, what: str) -> None:
        """Timing a call that returns the wrong thing would be meaningless (correctness
        itself is the conformance suites' job)."""
        if tuple(out.shape) != tuple(shape) or out.dtype != dtype:
            raise AssertionError(
                f"benchmark {what}: returned {tuple(out.shape)} {out.dtype}, expected "
                f"{tuple(shape)} {dtype}; run the conformance suites (pytest --qconform)"
            )

    def _time(
        self,
        benchmark: Any,
        backend: Backend,
        operation: BenchOperation,
        spec: QuantSpec,
        shape: tuple[int, int],
        batch: int | None,
        dtype: torch.dtype,
        facts: DeviceFacts,
        call: Callable[[int], Any],
        count: int,
        weight_bytes: int,
        activation_bytes: int,
        output_bytes: int,
    ) -> Benchmark:
        rotation = itertools.count()
        timing: Timing

        def next_args() -> tuple[tuple[int], dict[str, Any]]:
            return (next(rotation) % count,), {}

        with torch.no_grad():
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):
                    times, hidden = device_times(call, count, GPU_SAMPLES, facts, self.device)
                    eager = eager_time(call, count, self.device)

                    def synchronized(i: int) -> None:
                        call(i)
                        torch.cuda.synchronize(self.device)

                    benchmark.pedantic(synchronized, setup=next_args, rounds=HOST_ROUNDS, warmup_rounds=2)
                median, samples, timing, launch_hidden = statistics.median(times), len(times), "cuda-events", hidden
                host_median: float | None = _pytest_benchmark_median(benchmark)
            else:
                eager = None
                benchmark.pedantic(call, setup=next_args, rounds=CPU_ROUNDS, warmup_rounds=CPU_WARMUP_ROUNDS)
                cpu_median = _pytest_benchmark_median(benchmark)
                if cpu_median is None:
                    raise RuntimeError(f"pytest-benchmark recorded no round of {operation} for {backend.name}")
                median, samples, timing, launch_hidden = cpu_median, CPU_ROUNDS, "host-timer", None
                host_median = None
        if median is None:
            pytest.skip(f"{SKIP_PREFIX} pytest-benchmark is disabled in this run (--benchmark-disable or xdist)")
        entry = Benchmark(
            backend=backend.name,
            operation=operation,
            format=spec.label(),
            dtype=DtypeLabel.of(dtype).value,
            target=self.target.id,
            shape=shape,
            batch=batch,
            median_s=median,
            timing=timing,
            samples=samples,
            copies=count,
            rotated_bytes=count * (weight_bytes + activation_bytes),
            weight_bytes=weight_bytes,
            activation_bytes=activation_bytes,
            output_bytes=output_bytes,
            copy_bandwidth_bytes_per_s=facts.copy_bandwidth_bytes_per_s,
            host_median_s=host_median,
            launch_hidden=launch_hidden,
            nodeid=self.item.nodeid,
            eager_median_s=eager,
        )
        baselines = self.config.stash.setdefault(_BASELINES, {})
        if backend.name == RATIO_BASELINE:
            baselines[entry.case_key] = entry.median_s
        if entry.case_key in baselines:
            entry = replace(entry, time_ratio_to_bitsandbytes=entry.median_s / baselines[entry.case_key])
        data = dump(entry)
        benchmark.extra_info.update({k: v for k, v in data.items() if k != "nodeid"})
        self.item.user_properties.append((PROPERTY, data))
        return entry


def _pytest_benchmark_median(benchmark: Any) -> float | None:
    stats = getattr(benchmark, "stats", None)
    return float(stats.stats.median) if stats else None
