"""The fused tensor-core GEMM (``kernels/nf4_tc_gemm``) and its route in ``plans.linear_plan``.

The kernel's arithmetic is dequantize-then-GEMM: the weights it multiplies are bit for bit
``dequantize_4bit``'s in x's dtype, the products exact, the sums fp32, the result rounded
once. So each result is checked against the float64 product of ``dequantize_4bit``'s
weights (what the dequantize + matmul route multiplies) within the dequantize-then-GEMM
bound: K + 2 fp32 roundings of ``|x| |W|`` (products, sums, bias) and one rounding to x's
dtype; and against the route's own result within the sum of both results' bounds. Not bit for bit: the tensor cores' (and
here numpy's) summation order is not torch.matmul's.

On a CPU the kernel runs in Triton's interpreter at small shapes (40-70 rows, K 96-256,
N 32-64); a GPU runs the same tests compiled (``tl.dot`` on the tensor cores, the pair
shuffle lookup's inline PTX).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from launch_spy import spy_launches, spy_on  # noqa: E402

from pytest_qconform.backends.base import QuantSpec  # noqa: E402  (after TRITON_INTERPRET)
from qconform_triton_nf4 import kernels  # noqa: E402
from qconform_triton_nf4 import plans as triton_nf4_plans  # noqa: E402
from qconform_triton_nf4.backend import FUSED_MAX_ROWS, TritonNf4Backend  # noqa: E402
from qconform_triton_nf4.kernels import nf4_tc_gemm, nf4_ws_gemm  # noqa: E402
from qconform_triton_nf4.kernels.nf4_tc_gemm import TcConfig  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FP32_UNIT_ROUNDOFF = 2.0**-24
BACKEND = TritonNf4Backend()


def quantized_state(shape: tuple[int, int], quant_type: str, double_quant: bool, blocksize: int = 64):
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(sum(shape))).to(DEVICE)
    return BACKEND.quantize(weight, QuantSpec(quant_type, blocksize, double_quant=double_quant)).handle


def dequantize_matmul_bound(
    x: torch.Tensor, state, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The float64 product of ``dequantize_4bit``'s weights in x's dtype with x, the same
    plus the bias, and the bound of a dequantize-then-GEMM result: (K + 2) fp32 roundings of
    |x| |W| (+ |b|) and one rounding to x's dtype (half an ulp, or half the subnormal step)."""
    K = state.shape[1]
    weight = kernels.dequantize_4bit(state.packed, state.absmax, out_dtype=x.dtype, **state.kernel_args())
    x64, w64 = x.reshape(-1, K).cpu().double(), weight.cpu().double()
    b64 = bias.cpu().double() if bias is not None else torch.zeros(state.shape[0], dtype=torch.float64)
    product = x64 @ w64.T
    exact = product + b64
    magnitude = x64.abs() @ w64.abs().T + b64.abs()
    info = torch.finfo(x.dtype)
    fp32_error = (K + 2) * FP32_UNIT_ROUNDOFF * magnitude
    bound = fp32_error + info.eps / 2 * (exact.abs() + fp32_error) + info.smallest_normal * info.eps / 2
    return product, exact, bound


def planned_route(x, state, bias=None, **thresholds):
    """The adapter's plan for x (``plans.linear_plan``), the routes' thresholds their arch
    class's unless given (``tc_max_rows``, ``ws_max_rows``)."""
    return triton_nf4_plans.linear_plan(
        x,
        state.packed,
        state.absmax,
        state.kernel_args(),
        bias,
        FUSED_MAX_ROWS,
        lambda dtype: BACKEND.buffered_weight(state, dtype),
        **thresholds,
    )


def check_against_the_dequantize_route(x, state, bias, config, entry=None) -> torch.Tensor:
    """``entry`` (``kernels.tc_gemm_4bit``, or another fused GEMM of the same arithmetic:
    ``test_ws_gemm``) with ``config`` within the dequantize-then-GEMM bound of the exact
    product of the dequantized weights, and within that and the route's bound (its bias is
    added after a first rounding) of the dequantize route's result."""
    N, K = state.shape
    entry = entry or kernels.tc_gemm_4bit
    got = entry(x, state.packed, state.absmax, bias=bias, config=config, **state.kernel_args())
    assert got.shape == (*x.shape[:-1], N) and got.dtype == x.dtype
    product, exact, bound = dequantize_matmul_bound(x, state, bias)
    deviation = (got.reshape(-1, N).cpu().double() - exact).abs()
    assert bool((deviation <= bound).all()), (
        f"W {(N, K)} x {tuple(x.shape)}: max excess {(deviation - bound).max():.3g}"
    )
    route = planned_route(x, state, bias, tc_max_rows=0, ws_max_rows=0)(x, bias)
    # The route rounds the product to x's dtype, then adds the bias in x's dtype: one more
    # rounding, of the product (eps / 2 of it, and its square: eps).
    info = torch.finfo(x.dtype)
    route_bound = bound if bias is None else bound + info.eps * (product.abs() + bound) + info.smallest_normal
    apart = (got.reshape(-1, N).cpu().double() - route.reshape(-1, N).cpu().double()).abs()
    assert bool((apart <= bound + route_bound).all()), f"W {(N, K)} x {tuple(x.shape)}: apart from the route"
    return got


@pytest.mark.parametrize(
    "quant_type, double_quant, x_dtype, with_bias, rows, shape, config",
    [
        # The interpreter's configuration (one split): 2 tiles of x rows, a partial one.
        ("nf4", False, torch.bfloat16, True, 40, (48, 128), None),
        # K split 3 ways over 4 steps (the last split takes one), tiles of 16 weight rows,
        # 5 tiles of x rows grouped 2 per weight tile (a partial group).
        ("fp4", True, torch.float16, False, 70, (64, 256), TcConfig(16, 16, 64, 1, 1, 3, 2)),
        # Blocks of 64 straddle rows of 96 (K steps of 32, each in one block), 4 splits.
        ("nf4", True, torch.bfloat16, True, 50, (40, 96), TcConfig(32, 16, 128, 1, 1, split_k=4)),
        # A block of 128 holds two K steps of 64.
        ("fp4", False, torch.bfloat16, False, 64, (32, 256), TcConfig(64, 32, 64, 1, 1, split_k=1)),
        # K steps of 128 over blocks of 64: an absmax per byte, two blocks a step.
        ("nf4", True, torch.float16, True, 33, (32, 256), TcConfig(32, 32, 128, 1, 1, split_k=2)),
    ],
    ids=["nf4-bf16-bias", "fp4-dq-fp16-split3", "nf4-dq-straddle", "fp4-b128", "nf4-dq-fp16-two-blocks-a-step"],
)
def test_tc_gemm_is_dequantize_then_gemm(quant_type, double_quant, x_dtype, with_bias, rows, shape, config):
    blocksize = 128 if config is not None and config.block_k == 64 and shape == (32, 256) else 64
    state = quantized_state(shape, quant_type, double_quant, blocksize)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, shape[1], generator=gen).to(x_dtype).to(DEVICE)
    bias = torch.randn(shape[0], generator=gen).to(x_dtype).to(DEVICE) if with_bias else None
    check_against_the_dequantize_route(x, state, bias, config)


def test_tc_gemm_reads_3d_and_strided_x() -> None:
    """x [2, 21, K] (rows flattened), a column-strided view and rows off 16-byte boundaries."""
    state = quantized_state((40, 128), "nf4", False)
    gen = torch.Generator().manual_seed(5)
    wide = torch.randn(42, 2 * 128 + 8, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16).to(DEVICE)
    config = TcConfig(32, 32, 64, 1, 1, split_k=2)
    check_against_the_dequantize_route(wide[:, :128].reshape(2, 21, 128), state, bias, config)
    check_against_the_dequantize_route(wide[:, 8 : 8 + 2 * 128 : 2], state, None, config)
    check_against_the_dequantize_route(wide[:, 3:131], state, bias, config)


def test_split_sums_are_added_in_split_order_and_the_tickets_left_zero(monkeypatch) -> None:
    """With K split, the last program of each tile writes ``((0 + split 0) + split 1) + ...
    + bias`` of the splits' fp32 sums, rounded once, bit for bit, and leaves every ticket
    zero for the next launch; a plan's second call gives the same bits."""
    launches = spy_launches(monkeypatch, nf4_tc_gemm, "_gemm_4bit_tc_kernel")
    state = quantized_state((40, 256), "nf4", True)
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(45, 256, generator=gen).to(torch.bfloat16).to(DEVICE)
    bias = torch.randn(40, generator=gen).to(torch.bfloat16).to(DEVICE)
    plan = kernels.tc_gemm_4bit_plan(
        x, state.packed, state.absmax, bias=bias, config=TcConfig(32, 32, 64, 1, 1, split_k=4), **state.kernel_args()
    )
    got = plan(x, bias)
    (grid, args), *_ = launches
    work, tickets = args[6], args[7]
    assert grid == (2 * 2, 4) and tuple(work.shape) == (4, 45, 40) and work.dtype == torch.float32
    expected = torch.zeros(45, 40, dtype=torch.float32, device=DEVICE)
    for split in work:
        expected = expected + split
    assert torch.equal(got, (expected + bias.float()).to(torch.bfloat16))
    assert not bool(tickets.any()), "the last program zeroes its tile's ticket"
    assert torch.equal(plan(x, bias), got)


@triton.jit
def _sum_splits_probe(work_ptr, bias_ptr, out_ptr, M, N, splits, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
    m = tl.arange(0, BLOCK_M)
    n = tl.arange(0, BLOCK_N)
    at = m[None, :].to(tl.int64) * N + n[:, None]
    ok = (m < M)[None, :] & (n < N)[:, None]
    n_read = tl.minimum(n, N - 1).to(tl.int64)
    nf4_tc_gemm._sum_splits(work_ptr, bias_ptr, out_ptr, at, ok, n_read, M, N, splits, True, False, BLOCK_N, BLOCK_M)


def test_split_sums_start_from_zero_in_split_order() -> None:
    """Splits 2^24, 1, -2^24: in split order the 1 is lost to fp32 rounding (0 + bias), in
    any order that adds 1 to -2^24 first it is kept (1 + bias): the bits follow the order."""
    M, N = 2, 20
    work = torch.empty(3, M, N, dtype=torch.float32)
    work[0], work[1], work[2] = 2.0**24, 1.0, -(2.0**24)
    bias = torch.arange(N, dtype=torch.float16)
    out = torch.full((M, N), -7.0, dtype=torch.float16)
    work, bias, out = work.to(DEVICE), bias.to(DEVICE), out.to(DEVICE)
    _sum_splits_probe[(1,)](work, bias, out, M, N, 3, BLOCK_N=32, BLOCK_M=16)
    assert torch.equal(out.cpu(), bias.cpu().float().expand(M, N).half())


@pytest.fixture
def without_the_ws_route(monkeypatch) -> None:
    """The warp-specialized GEMM's route off (on sm_90 it takes the rows past the fused
    kernels first, ``test_ws_gemm``), so that these tests meet the tensor-core GEMM's."""
    monkeypatch.setitem(nf4_ws_gemm.WS_MAX_ROWS, nf4_tc_gemm.arch_class(DEVICE), 0)


def test_linear_plan_routes_past_the_fused_rows_up_to_the_threshold(monkeypatch, without_the_ws_route) -> None:
    """Rows past the fused kernels' limit go to the tensor-core GEMM up to ``tc_max_rows``
    (the threshold of the arch class where not given: 0, the route off, where not measured);
    more rows, fp32 x and K not a multiple of 32 go to dequantize + matmul."""
    launched = spy_on(monkeypatch, nf4_tc_gemm, "_gemm_4bit_tc_kernel")
    fused = min(FUSED_MAX_ROWS, kernels.nf4_gemv.mma_rows()[1])
    class_rows = nf4_tc_gemm.TC_MAX_ROWS[nf4_tc_gemm.arch_class(DEVICE)]

    def route(x, state, tc_max_rows):
        before = len(launched)
        planned_route(x, state, tc_max_rows=tc_max_rows)(x, None)
        return len(launched) > before

    state = quantized_state((32, 128), "nf4", False)
    x = torch.randn(64, 128).to(torch.bfloat16).to(DEVICE)
    assert route(x[: fused + 1], state, None) == (class_rows > fused)  # the arch class's threshold
    assert route(x[: fused + 1], state, 64) and route(x[:64], state, 64)
    assert not route(x[:fused], state, 64)  # the fused kernels' rows
    assert not route(x[:64], state, 63)  # past the threshold
    assert not route(x[:64].float(), state, 64)  # fp32 x: dequantize + matmul
    odd = quantized_state((32, 80), "nf4", False)
    assert not route(torch.randn(40, 80).to(torch.bfloat16).to(DEVICE), odd, 64)  # K = 80


def test_a_threshold_adds_its_boundary_to_the_dispatch_rows(monkeypatch) -> None:
    """The matmul suite checks each route's first and last rows (``dispatch_rows``): a
    threshold past the fused rows adds its boundary; the route off adds none. The
    warp-specialized GEMM's threshold likewise, where it lies past the tensor-core GEMM's."""
    device = torch.device("cpu") if DEVICE.type == "cpu" else DEVICE
    monkeypatch.setitem(nf4_ws_gemm.WS_MAX_ROWS, nf4_tc_gemm.arch_class(device), 0)
    monkeypatch.setitem(nf4_tc_gemm.TC_MAX_ROWS, nf4_tc_gemm.arch_class(device), 0)
    off = BACKEND.capabilities(device).dispatch_rows
    monkeypatch.setitem(nf4_tc_gemm.TC_MAX_ROWS, nf4_tc_gemm.arch_class(device), 256)
    assert BACKEND.capabilities(device).dispatch_rows == (*off, 257)
    monkeypatch.setitem(nf4_ws_gemm.WS_MAX_ROWS, nf4_tc_gemm.arch_class(device), 512)
    low = kernels.ws_min_rows(device)  # where the kernel runs: its first rows, before the fused kernels' last
    assert BACKEND.capabilities(device).dispatch_rows == (*off, 257, *((low,) if low else ()), 513)


def test_the_table_and_the_splits() -> None:
    """Every table entry is a configuration the kernel takes; the plan splits K until about
    ``programs_per_sm`` programs a multiprocessor, keeping MIN_STEPS_PER_SPLIT steps a split."""
    for _, config in nf4_tc_gemm._GPU_CONFIGS:
        assert config.block_m >= 16 and config.block_n >= 16 and config.block_k >= nf4_tc_gemm.K_MULTIPLE
    assert nf4_tc_gemm.config_for(64, torch.device("cuda")) == nf4_tc_gemm._GPU_CONFIGS[1][1]
    assert nf4_tc_gemm.config_for(10**6, torch.device("cuda")) == nf4_tc_gemm._GPU_CONFIGS[-1][1]
    # 8192^2 at 64 rows: 128 tiles of 64 weight rows, 128 steps: 4 programs a multiprocessor
    assert nf4_tc_gemm.splits_for(tiles=128, steps=128, multiprocessors=132, programs_per_sm=4) == 4
    assert nf4_tc_gemm.splits_for(tiles=128, steps=128, multiprocessors=132, programs_per_sm=2) == 2
    assert nf4_tc_gemm.splits_for(tiles=8, steps=32, multiprocessors=132) == 8  # 4 steps a split
    assert nf4_tc_gemm.splits_for(tiles=600, steps=64, multiprocessors=132) == 1
    # A plan's count (both GEMMs): the configuration's or the rule's, then every split a step at least.
    assert nf4_tc_gemm.split_count(0, tiles=128, steps=128, multiprocessors=132, programs_per_sm=2) == 2
    assert nf4_tc_gemm.split_count(4, tiles=1, steps=6, multiprocessors=132, programs_per_sm=2) == 3  # 2 steps each
    assert nf4_tc_gemm.split_count(8, tiles=1, steps=5, multiprocessors=132, programs_per_sm=2) == 5
    assert TcConfig(64, 64, 64, 4, 3).label() == "m64n64k64w4s3x0g8p4"


def test_unreadable_x_is_refused_with_the_way_out() -> None:
    state = quantized_state((32, 128), "nf4", False)
    with pytest.raises(ValueError, match="bf16/fp16 x with K a multiple of 32"):
        kernels.tc_gemm_4bit(torch.zeros(40, 128, device=DEVICE), state.packed, state.absmax, **state.kernel_args())


def test_the_adapter_takes_the_route_where_it_is_on(monkeypatch, without_the_ws_route) -> None:
    """With a threshold set, the adapter's planned matmul (its kept plan and, on a GPU, the
    native launch made from it) returns the tensor-core GEMM's result."""
    monkeypatch.setitem(nf4_tc_gemm.TC_MAX_ROWS, nf4_tc_gemm.arch_class(DEVICE), 128)
    weight = torch.randn(32, 128, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    q = BACKEND.quantize(weight, QuantSpec("nf4", 64))
    q = copy.deepcopy(q)
    x = torch.randn(40, 128, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16).to(DEVICE)
    state = q.handle
    expected = kernels.tc_gemm_4bit(x, state.packed, state.absmax, **state.kernel_args())
    assert torch.equal(BACKEND.matmul(x, q, None, torch.bfloat16), expected)
    assert torch.equal(BACKEND.matmul(x.clone(), q, None, torch.bfloat16), expected)  # the kept plan
