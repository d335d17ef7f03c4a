"""Benchmarks: dequantize, matmul and quantize time, bandwidth and % of the copy floor, per backend.

Run only with ``pytest --qconform --benchmark-only`` (``nox -s bench``); a plain
``--qconform`` run skips them with the reason, as does a CPU run without
``--qconform-bench-shapes=small``. Weights N x K (out x in) of 4096x4096, 8192x8192,
14336x4096 and 4096x14336 (the shapes of 7-8B models' projections: attention, MLP up/gate,
down), bf16; matmul at batch 1 (decoding: the gemv path), 4 (a few rows: the fused gemv
too), 16, 64, 128, 256 and 512 (the window between decode and prefill, issue 52), 2048 and
8192 (prefill, where every implementation is bound by its GEMM), beside two peers on a GPU: torch's int4
tinygemm and the unquantized bf16 layer (``benchmark.peer``). NF4 at blocksize 64, the CUDA default, plain and
(dequantize) double-quantized; quantize of the bf16 weight at NF4 blocksize 64 (load time);
HQQ has no NF4 and is timed on its own 4-bit format at
group 64, which stores the same 4.5 bits per weight. What is timed and how (CUDA
events, inputs rotated out of L2, the floor) is in ``pytest_qconform.benchmark.harness``; the
results go to pytest-benchmark's ``extra_info`` and the run report's ``benchmarks``.
Correctness is the other suites' job: a benchmark checks only its output's shape.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip(
    "pytest_benchmark", reason="benchmark: pytest-benchmark is not installed (pip install 'pytest-qconform[bench]')"
)

from pytest_qconform.backends.base import QuantSpec  # noqa: E402
from pytest_qconform.benchmark.harness import BATCHES  # noqa: E402

from ._cases import dtype_id, require_claim, spec_id  # noqa: E402

NF4 = QuantSpec("nf4", 64)
NF4_DQ = QuantSpec("nf4", 64, double_quant=True)
HQQ4 = QuantSpec("hqq4", 64, axis=1)
DTYPES = (torch.bfloat16,)


@pytest.mark.qconform_benchmark
@pytest.mark.qconform_operation("dequantize")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", (NF4, NF4_DQ, HQQ4), ids=spec_id)
def test_benchmark_dequantize(qbench, qtarget, qbackend, benchmark, spec, dtype, qbench_shape):
    require_claim(qbackend, qtarget, spec, dtype, dequantize=True)
    qbench.dequantize(benchmark, qbackend, spec, qbench_shape, dtype)


@pytest.mark.qconform_benchmark
@pytest.mark.qconform_operation("matmul")
@pytest.mark.parametrize("batch", BATCHES, ids=lambda batch: f"M{batch}")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", (NF4, HQQ4), ids=spec_id)
def test_benchmark_matmul(qbench, qtarget, qbackend, benchmark, spec, dtype, qbench_shape, batch):
    require_claim(qbackend, qtarget, spec, dtype)
    qbench.matmul(benchmark, qbackend, spec, qbench_shape, batch, dtype)
    if qbench.device.type == "cuda":  # the peers (tinygemm, dense bf16), timed once per case beside the backends
        from pytest_qconform.benchmark import harness as bench
        from pytest_qconform.benchmark import peer as bench_peer

        bench_peer.time_peer_once(qbench, qbench_shape, batch, dtype, bench.device_facts(qbench.config, qbench.device))


@pytest.mark.qconform_benchmark
@pytest.mark.qconform_operation("quantize")
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("spec", (NF4,), ids=spec_id)
def test_benchmark_quantize(qbench, qtarget, qbackend, benchmark, spec, dtype, qbench_shape):
    """Quantizing a float weight at load time, beside bitsandbytes' ``quantize_4bit``."""
    require_claim(qbackend, qtarget, spec, dtype)
    qbench.quantize(benchmark, qbackend, spec, qbench_shape, dtype)
