"""The warp-specialized Gluon GEMM (``kernels/nf4_ws_gemm``) and its route in ``plans.linear_plan``.

Its arithmetic is dequantize-then-GEMM, as ``nf4_tc_gemm``'s: so each result is checked as
``test_tc_gemm`` checks that kernel's, against the float64 product of ``dequantize_4bit``'s
weights within the dequantize-then-GEMM bound, and against the dequantize route's result.
Gluon has no interpreter: the kernel runs on sm_90 GPUs only, and these tests skip
elsewhere, except those of what every machine decides (which calls it reads, the refusal
elsewhere). The CPU's compile check compiles it for sm_90 (``nox -s compile-check``).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

from test_tc_gemm import DEVICE, planned_route, quantized_state  # noqa: E402
from test_tc_gemm import check_against_the_dequantize_route as check_tc  # noqa: E402

from qconform_triton_nf4 import kernels  # noqa: E402
from qconform_triton_nf4.backend import FUSED_MAX_ROWS  # noqa: E402
from qconform_triton_nf4.kernels import nf4_ws_gemm  # noqa: E402
from qconform_triton_nf4.kernels.nf4_ws_gemm import WsConfig  # noqa: E402

on_sm90 = pytest.mark.skipif(
    not nf4_ws_gemm.runs_on(DEVICE), reason="the warp-specialized GEMM runs on sm_90 GPUs only (Gluon: no interpreter)"
)


def check_against_the_dequantize_route(x, state, bias, config: WsConfig | None) -> torch.Tensor:
    """``ws_gemm_4bit`` checked as ``test_tc_gemm`` checks its kernel."""
    return check_tc(x, state, bias, config, kernels.ws_gemm_4bit)


@on_sm90
@pytest.mark.parametrize(
    "quant_type, double_quant, x_dtype, with_bias, rows, shape, blocksize, config",
    [
        # The 64-row class (K split by the plan), a partial weight tile (N = 200).
        ("nf4", False, torch.bfloat16, True, 64, (200, 4096), 64, None),
        # fp16 x, double quantization, K split 3 ways by the configuration, a partial x tile.
        ("fp4", True, torch.float16, False, 100, (64, 2048), 64, WsConfig(128, 4, 128, split_k=3)),
        # The 256-row class, double quantization with a bias.
        ("nf4", True, torch.bfloat16, True, 256, (128, 1024), 64, None),
        # Blocksize 32: K steps of 32 (four words a row).
        ("nf4", False, torch.bfloat16, False, 33, (64, 4096), 32, None),
        # The 32-row class (wgmma N 32), fp16 with a bias.
        ("nf4", False, torch.float16, True, 24, (192, 2048), 64, None),
        # Blocksize 128 (two steps a block), two x tiles of 256, the second partial.
        ("fp4", False, torch.bfloat16, True, 300, (96, 512), 128, None),
        # Two consumer warpgroups sharing each x tile (128 weight rows, the second tile partial).
        ("nf4", True, torch.bfloat16, True, 100, (200, 2048), 64, WsConfig(128, 4, 128, warpgroups=2)),
        ("fp4", False, torch.float16, False, 256, (128, 1024), 64, WsConfig(256, 4, 168, split_k=2, warpgroups=2)),
    ],
    ids=[
        "nf4-bias-ragged-n",
        "fp4-dq-fp16-split3",
        "nf4-dq-256",
        "nf4-b32",
        "nf4-fp16-24-rows",
        "fp4-b128-300-rows",
        "nf4-dq-two-warpgroups",
        "fp4-fp16-two-warpgroups-split2",
    ],
)
def test_ws_gemm_is_dequantize_then_gemm(quant_type, double_quant, x_dtype, with_bias, rows, shape, blocksize, config):
    state = quantized_state(shape, quant_type, double_quant, blocksize)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=gen).to(DEVICE, x_dtype)
    bias = torch.randn(shape[0], generator=gen).to(DEVICE, x_dtype) if with_bias else None
    check_against_the_dequantize_route(x, state, bias, config)


@on_sm90
def test_ws_gemm_takes_batched_x_and_is_deterministic_across_splits():
    """A [2, 40, K] x (a view of [80, K]) gives what its flat rows give, and a K split's
    tickets give the same bits on every call."""
    state = quantized_state((128, 4096), "nf4", False)
    x = torch.randn(2, 40, 4096, generator=torch.Generator().manual_seed(3)).to(DEVICE, torch.bfloat16)
    split = WsConfig(128, 4, 128, split_k=4)
    got = check_against_the_dequantize_route(x, state, None, split)
    again = kernels.ws_gemm_4bit(x, state.packed, state.absmax, config=split, **state.kernel_args())
    flat = kernels.ws_gemm_4bit(x.reshape(80, 4096), state.packed, state.absmax, config=split, **state.kernel_args())
    assert torch.equal(got, again) and torch.equal(got.reshape(80, -1), flat)


@on_sm90
@pytest.mark.parametrize("config", [None, WsConfig(64, 4, 96, split_k=3)], ids=["table", "split3"])
def test_a_bound_plan_reads_each_calls_x_and_bias(config):
    """After its first call a plan launches directly (``launch.BoundLaunch``: the weight's
    TMA descriptor encoded once, x's on every call): each later call, with a new x and bias
    at new addresses, gives what a fresh plan's first call gives for them."""
    state = quantized_state((192, 2048), "nf4", True)
    gen = torch.Generator().manual_seed(5)
    xs = [torch.randn(48, 2048, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3)]
    biases = [torch.randn(192, generator=gen).to(DEVICE, torch.bfloat16) for _ in range(3)]
    plan = nf4_ws_gemm.ws_gemm_4bit_plan(
        xs[0], state.packed, state.absmax, bias=biases[0], config=config, **state.kernel_args()
    )
    for x, bias in zip(xs, biases, strict=True):
        fresh = kernels.ws_gemm_4bit(x, state.packed, state.absmax, bias=bias, config=config, **state.kernel_args())
        assert torch.equal(plan(x, bias), fresh)


@on_sm90
def test_the_route_takes_the_ws_gemm_past_the_fused_rows_on_sm90():
    """On sm_90, rows from ``ws_min_rows`` (before the fused kernels' last) to
    ``ws_max_rows`` go here where x is contiguous; a transposed x there goes to the fused
    kernels, the tensor-core GEMM or the dequantize route."""
    state = quantized_state((64, 1024), "nf4", False)
    low, high = kernels.ws_min_rows(DEVICE), kernels.ws_max_rows(DEVICE)
    assert 1 < low <= FUSED_MAX_ROWS < high

    def route(x):
        return planned_route(x, state)

    for rows, expected in ((low - 1, False), (low, True), (FUSED_MAX_ROWS + 1, True), (high, True), (high + 1, False)):
        x = torch.randn(rows, 1024).to(DEVICE, torch.bfloat16)
        assert isinstance(getattr(route(x), "config", None), WsConfig) is expected, rows
    transposed = torch.randn(1024, FUSED_MAX_ROWS + 1).to(DEVICE, torch.bfloat16).t()
    assert not isinstance(getattr(route(transposed), "config", None), WsConfig)
    # a weight of LARGE_WEIGHT elements takes it for more rows
    state = quantized_state((8192, nf4_ws_gemm.LARGE_WEIGHT // 8192), "nf4", False)
    large = kernels.ws_max_rows(DEVICE, nf4_ws_gemm.LARGE_WEIGHT)
    assert large > high
    for rows, expected in ((high + 1, True), (large, True), (large + 1, False)):
        x = torch.randn(rows, state.shape[1]).to(DEVICE, torch.bfloat16)
        assert isinstance(getattr(route(x), "config", None), WsConfig) is expected, rows


def test_which_calls_the_ws_gemm_reads():
    """Contiguous bf16/fp16 x, 16-byte aligned, K a multiple of the K step (min(64, blocksize));
    anything else goes elsewhere (on every machine: the decision needs no GPU)."""
    packed = torch.zeros(64 * 256 // 2, dtype=torch.uint8)
    x = torch.zeros(40, 256, dtype=torch.bfloat16)
    assert kernels.ws_gemm_readable(x, packed, 256, 64)
    assert kernels.ws_gemm_readable(x.half(), packed, 256, 4096)
    assert not kernels.ws_gemm_readable(x.float(), packed, 256, 64)
    assert not kernels.ws_gemm_readable(torch.zeros(256, 40, dtype=torch.bfloat16).t(), packed, 40, 32)
    assert not kernels.ws_gemm_readable(torch.zeros(40, 96, dtype=torch.bfloat16), packed, 96, 64)
    assert kernels.ws_gemm_readable(torch.zeros(40, 96, dtype=torch.bfloat16), packed, 96, 32)
    assert not kernels.ws_gemm_readable(
        torch.zeros(40 * 256 + 1, dtype=torch.bfloat16)[1:].view(40, 256), packed, 256, 64
    )


@pytest.mark.skipif(nf4_ws_gemm.runs_on(DEVICE), reason="checks the refusal where the kernel does not run")
def test_the_ws_gemm_refuses_a_device_without_it_and_says_so():
    state = quantized_state((64, 256), "nf4", False)
    x = torch.zeros(40, 256, dtype=torch.bfloat16, device=DEVICE)
    with pytest.raises(ValueError, match="sm_90 GPUs only"):
        kernels.ws_gemm_4bit(x, state.packed, state.absmax, **state.kernel_args())
    assert kernels.ws_max_rows(DEVICE) == 0


def test_a_configuration_counts_its_consumer_warpgroups():
    """Two consumer warpgroups: 128 weight rows and 8 warps a program, whose registers (with
    the producer's warpgroup, 12 warps at ``max_registers``) fit one a multiprocessor."""
    one, two = WsConfig(256, 4, 168), WsConfig(256, 4, 168, warpgroups=2)
    assert (one.block_n, one.num_warps, one.programs_per_sm) == (64, 4, 1)
    assert (two.block_n, two.num_warps, two.programs_per_sm) == (128, 8, 1)
    assert WsConfig(64, 4, 96).programs_per_sm == 2 and WsConfig(64, 4, 96, warpgroups=2).programs_per_sm == 1
    assert two.label() == "m256g2s4r168p1x0" and one.label() == "m256s4r168p1x0"
