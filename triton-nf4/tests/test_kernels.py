"""Our Triton 4-bit kernels against bitsandbytes and against a float64 decode written here.

On a machine without CUDA the kernels run in Triton's interpreter, which must be switched
on before triton (and our kernels) are imported: Triton picks compiler or interpreter when
``@triton.jit`` decorates a function.

Findings these tests pin:
- ``dequantize_4bit`` is bit-identical to bitsandbytes 0.50.2 (CPU) for bf16, fp16 and fp32:
  both compute fp32 ``code * absmax`` and round once to nearest even. (Triton's interpreter
  truncates fp32 -> bf16 casts, so the kernel rounds bf16 with integer ops.)
- bitsandbytes 0.50.2's CPU ``dequantize_4bit`` itself returns wrong values when the last
  dim is a multiple of 32 but not of blocksize and blocks straddle rows (e.g. (4, 96) at
  blocksize 64), so the bitsandbytes comparison uses shapes outside that class and the
  straddling shapes are checked against the float64 decode only.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

bnb_functional = pytest.importorskip("bitsandbytes.functional")
pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from launch_spy import spy_launches, spy_on  # noqa: E402

from qconform_triton_nf4 import kernels  # noqa: E402  (after TRITON_INTERPRET)
from qconform_triton_nf4.kernels.nf4_mma import _sum_tile_splits  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP32_UNIT_ROUNDOFF = 2.0**-24

# numel 63 (odd, one partial block), 129 (odd, partial last block), 512 (whole blocks),
# 20480 (320 blocks of 64: two nested_absmax groups of 256 blocks under double quantization).
# (64, 256) fills every interpreter program exactly (the unmasked kernel).
BNB_SHAPES = ((7, 9), (3, 43), (4, 128), (80, 256), (64, 256))
# Blocks straddle rows with K even (bitsandbytes' CPU dequantize is wrong here) and K odd.
STRADDLE_SHAPES = ((6, 96), (5, 45))


def quantize(shape: tuple[int, ...], quant_type: str, blocksize: int, double_quant: bool, seed: int = 0):
    """bitsandbytes' packed bytes and the kernel keyword arguments describing them."""
    weight = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    packed, state = bnb_functional.quantize_4bit(
        weight, blocksize=blocksize, quant_type=quant_type, compress_statistics=double_quant
    )
    kwargs = dict(blocksize=blocksize, code=state.code.to(DEVICE))
    if double_quant:
        kwargs.update(
            nested_absmax=state.state2.absmax.to(DEVICE),
            nested_code=state.state2.code.to(DEVICE),
            nested_blocksize=state.state2.blocksize,
            offset=float(state.offset),
        )
    return packed, state, kwargs


def decode_float64(packed: torch.Tensor, absmax: torch.Tensor, numel: int, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact float64 decode of the flat weight, and a bound on the fp32 kernel's error per element.

    Byte i holds flat elements 2i (high nibble) and 2i+1 (low nibble); element e is
    code[nibble] * absmax[e // blocksize], absmax = nested_code[c] * nested_absmax[b // nb] + offset.
    The kernel rounds the product (and the double-quant product and sum) to fp32: each rounding
    adds at most FP32_UNIT_ROUNDOFF relative to the value it rounds.
    """
    flat = packed.reshape(-1).cpu().to(torch.int64)
    nibbles = torch.stack([flat >> 4, flat & 15], dim=1).reshape(-1)[:numel]
    code = kw["code"].cpu().double()[nibbles]
    block = torch.arange(numel) // kw["blocksize"]
    if "nested_absmax" in kw:
        nested_block = torch.arange(absmax.numel()) // kw["nested_blocksize"]
        nested = (
            kw["nested_code"].cpu().double()[absmax.cpu().long()] * kw["nested_absmax"].cpu().double()[nested_block]
        )
        block_absmax = nested + kw["offset"]
        absmax_error = FP32_UNIT_ROUNDOFF * (nested.abs() + 2 * block_absmax.abs())
    else:
        block_absmax = absmax.cpu().double()
        absmax_error = torch.zeros_like(block_absmax)
    exact = code * block_absmax[block]
    error = code.abs() * absmax_error[block] + FP32_UNIT_ROUNDOFF * exact.abs()
    return exact, error


def rounding_bound(exact: torch.Tensor, fp32_error: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 error plus one rounding to ``dtype`` (relative half-ulp, or half the subnormal step)."""
    info = torch.finfo(dtype)
    unit = info.eps / 2
    return fp32_error * (1 + unit) + unit * (exact.abs() + fp32_error) + info.smallest_normal * unit


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("blocksize", [64, 128])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_bit_identical_to_bitsandbytes(quant_type, blocksize, double_quant, out_dtype):
    for shape in BNB_SHAPES:
        packed, state, kw = quantize(shape, quant_type, blocksize, double_quant)
        state.dtype = out_dtype
        expected = bnb_functional.dequantize_4bit(packed, state)
        got = kernels.dequantize_4bit(
            packed.to(DEVICE), state.absmax.to(DEVICE), shape=shape, out_dtype=out_dtype, **kw
        )
        assert got.shape == shape and got.dtype == out_dtype and got.device.type == DEVICE.type
        assert torch.equal(got.cpu(), expected), f"{shape}: not bit-identical to bitsandbytes"


@pytest.mark.parametrize("out_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_dequantize_matches_float64_decode(quant_type, double_quant, out_dtype):
    for shape in BNB_SHAPES + STRADDLE_SHAPES:
        packed, state, kw = quantize(shape, quant_type, 64, double_quant, seed=1)
        exact, error = decode_float64(packed, state.absmax, math.prod(shape), **kw)
        got = kernels.dequantize_4bit(
            packed.to(DEVICE), state.absmax.to(DEVICE), shape=shape, out_dtype=out_dtype, **kw
        )
        deviation = (got.cpu().double().reshape(-1) - exact).abs()
        bound = rounding_bound(exact, error, out_dtype)
        assert bool((deviation <= bound).all()), f"{shape}: max excess {(deviation - bound).max().item():.3g}"


def test_dequantize_any_bytes_partial_block_and_out():
    """Random bytes (all 16 codes), odd numel, partial last block, caller-provided ``out``."""
    gen = torch.Generator().manual_seed(2)
    shape, blocksize = (5, 41), 64  # numel 205: 4 blocks, the last holding 13 elements
    packed = torch.randint(0, 256, (103,), dtype=torch.uint8, generator=gen)
    absmax = torch.rand(4, generator=gen) + 0.5
    code = torch.linspace(-1, 1, 16)
    exact, error = decode_float64(packed, absmax, 205, blocksize=blocksize, code=code)
    out = torch.full(shape, float("nan"), device=DEVICE)
    got = kernels.dequantize_4bit(
        packed.to(DEVICE),
        absmax.to(DEVICE),
        blocksize=blocksize,
        shape=shape,
        code=code.to(DEVICE),
        out_dtype=torch.float32,
        out=out,
    )
    assert got is out
    # A float64 product of two fp32 numbers is exact, so rounding it to fp32 is the fp32 product.
    assert torch.equal(got.cpu().reshape(-1), exact.float())


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16], ids=str)
def test_dequantize_rounds_ties_to_even(out_dtype):
    """Code values halfway between two out_dtype neighbours: nearest-even, not half-up or truncation."""
    half_ulp = torch.finfo(out_dtype).eps / 2
    ties = [1 + half_ulp, 1 + 3 * half_ulp, -(1 + half_ulp), -(1 + 3 * half_ulp), 2 - half_ulp, 0.5 + half_ulp / 2]
    code = torch.tensor(ties + [0.0] * (16 - len(ties)), dtype=torch.float32)
    packed = torch.tensor([0x01, 0x23, 0x45], dtype=torch.uint8)
    got = kernels.dequantize_4bit(
        packed.to(DEVICE),
        torch.ones(1, device=DEVICE),
        blocksize=64,
        shape=(6,),
        code=code.to(DEVICE),
        out_dtype=out_dtype,
    )
    assert torch.equal(got.cpu(), code[:6].to(out_dtype)), "torch's fp32 -> half casts round to nearest even"


@pytest.mark.parametrize("x_dtype", OUT_DTYPES, ids=str)
@pytest.mark.parametrize("double_quant", [False, True], ids=["plain", "double_quant"])
def test_gemv_matches_float64_matmul(double_quant, x_dtype):
    gen = torch.Generator().manual_seed(3)
    cases = [
        ((24, 128), (1, 128), False),  # one row, whole blocks
        ((6, 96), (3, 96), True),  # three rows, blocks straddle rows, bias
        ((5, 45), (2, 3, 45), True),  # 3-D x, odd K: rows start mid-byte
        # Rows start on a block (K % blocksize == 0): per-(row, block) absmax tiles. With the
        # interpreter's tiles, (80, 256) has a partial feature tile and two nested groups,
        # (128, 1024) and (64, 512) fill every tile (no masks); 4 and 16 rows take the
        # tensor-core kernel, 1 row the elementwise one.
        ((80, 256), (4, 256), True),
        ((128, 1024), (1, 1024), False),
        ((64, 512), (16, 512), False),
    ]
    for (N, K), x_shape, with_bias in cases:
        check_gemv((N, K), x_shape, with_bias, double_quant, x_dtype, gen)


def check_gemv(weight_shape, x_shape, with_bias, double_quant, x_dtype, gen, blocksize=64, x=None):
    """``gemv_4bit`` within the fp32-accumulation bound of the float64 matmul, for a drawn x
    of ``x_shape`` (or ``x`` itself). The weights are fp32 ``code * absmax``; the
    tensor-core route rounds them once more, to x's dtype."""
    from qconform_triton_nf4.kernels import nf4_gemv

    N, K = weight_shape
    packed, state, kw = quantize((N, K), "nf4", blocksize, double_quant, seed=N)
    exact_w, w_error = decode_float64(packed, state.absmax, N * K, **kw)
    exact_w, w_error = exact_w.reshape(N, K), w_error.reshape(N, K)
    if x is None:
        x = torch.randn(x_shape, generator=gen).to(x_dtype)
    x_shape = tuple(x.shape)
    if nf4_gemv.mma_route(x.to(DEVICE).reshape(-1, K), packed.to(DEVICE).reshape(-1), K):
        w_error = rounding_bound(exact_w, w_error, x_dtype)
    bias = torch.randn(N, generator=gen) if with_bias else None
    got = kernels.gemv_4bit(
        x if x.device == DEVICE else x.to(DEVICE),
        packed.to(DEVICE),
        state.absmax.to(DEVICE),
        shape=(N, K),
        bias=None if bias is None else bias.to(DEVICE),
        **kw,
    )
    assert got.shape == (*x_shape[:-1], N) and got.dtype == x_dtype
    x64 = x.cpu().double().reshape(-1, K)
    expected = x64 @ exact_w.T + (0 if bias is None else bias.double())
    # Weights off by w_error each; fp32 accumulation of K products plus a bias: (K + 2) roundings.
    magnitude = x64.abs() @ (exact_w.abs() + w_error).T + (0 if bias is None else bias.double().abs())
    fp32_error = x64.abs() @ w_error.T + (K + 2) * FP32_UNIT_ROUNDOFF * magnitude
    bound = rounding_bound(expected, fp32_error, x_dtype)
    deviation = (got.cpu().double().reshape(-1, N) - expected).abs()
    assert bool((deviation <= bound).all()), f"W {(N, K)}, x {x_shape}: max excess {(deviation - bound).max():.3g}"


@pytest.fixture
def per_row_kernels(monkeypatch):
    """Send every batch to the per-row kernels (the tensor-core kernel takes 2+ rows it can read)."""
    from qconform_triton_nf4.kernels import nf4_gemv

    monkeypatch.setattr(nf4_gemv, "mma_rows", lambda: (nf4_gemv.MAX_ROWS + 1, nf4_gemv.MAX_ROWS))


def compiled_variants(monkeypatch, module, name):
    """Replace kernel ``name`` of ``module`` by a wrapper that collects what each launch
    returns: on a GPU, Triton's compiled kernel, one object per specialization key."""
    variants = set()
    kernel = getattr(module, name)

    def launcher(grid):
        def launch(*args, **kwargs):
            compiled = kernel[grid](*args, **kwargs)
            variants.add(id(compiled))
            return compiled

        return launch

    monkeypatch.setattr(module, name, type("Collect", (), {"__getitem__": lambda _, grid: launcher(grid)})())
    return variants


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter compiles nothing")
def test_kernels_compile_one_variant_for_every_length(monkeypatch):
    """Lengths and batch sizes are not specialized (``do_not_specialize``): Triton would
    otherwise compile a variant per class of each integer (1, a multiple of 16, other), and
    a cold conformance run pays for every one (bench/notes.md "Compile census")."""
    from qconform_triton_nf4.kernels import nf4_dequant, nf4_gemv

    dequant = compiled_variants(monkeypatch, nf4_dequant, "_dequantize_4bit_kernel")
    elementwise = compiled_variants(monkeypatch, nf4_gemv, "_gemv_4bit_kernel")
    words = compiled_variants(monkeypatch, nf4_gemv, "_gemv_4bit_words_kernel")
    # numel 64 (one block), 129 and 2048, all short of a full program (masked): the
    # classes (numel, blocks) are (multiple of 16, 1), (other, other), (multiple, multiple).
    for shape in ((1, 64), (3, 43), (2, 1024)):
        packed, state, kw = quantize(shape, "nf4", 64, False, seed=1)
        kernels.dequantize_4bit(packed.to(DEVICE), state.absmax.to(DEVICE), shape=shape, out_dtype=torch.float32, **kw)
    # Batches of 1 and 2 against 1 and 17 features: K = 45 (not whole blocks) takes the
    # elementwise kernel, K = 512 with fp32 x the word kernel.
    gen = torch.Generator().manual_seed(15)
    for K in (45, 512):
        for N in (1, 17):
            packed, state, kw = quantize((N, K), "nf4", 64, False, seed=N)
            for rows in (1, 2):
                x = torch.randn(rows, K, generator=gen).to(DEVICE)
                kernels.gemv_4bit(x, packed.to(DEVICE), state.absmax.to(DEVICE), shape=(N, K), **kw)
    assert (len(dequant), len(elementwise), len(words)) == (1, 1, 1), "one compiled variant per kernel"


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("lookup", ["shuffle", "gather", "index"])
@pytest.mark.parametrize("tile", [(16, 256, 1, True), (8, 128, 1, False)], ids=["prefetch", "no-prefetch"])
def test_gemv_word_kernel_configurations(monkeypatch, per_row_kernels, tile, lookup):
    """The word kernel (K a multiple of the blocksize) with the GPU's choices, run here:
    prefetched words, a partial feature tile (N = 40), a step shorter than a block
    (blocksize 256 > 128 columns per step), each lookup (the shuffle runs on a GPU only, with
    prefetch; elsewhere it falls back to the gather), several rows, double quant."""
    from qconform_triton_nf4.kernels import nf4_gemv

    monkeypatch.setattr(nf4_gemv, "_ROWS_KERNEL", False)  # bf16 x here would take the rows kernel
    monkeypatch.setattr(nf4_gemv, "_GPU_WORDS_TILE" if DEVICE.type == "cuda" else "_INTERPRETER_WORDS_TILE", tile)
    monkeypatch.setattr(nf4_gemv, "_WORDS_LOOKUP", lookup)
    launched = spy_on(monkeypatch, nf4_gemv, "_gemv_4bit_words_kernel")
    gen = torch.Generator().manual_seed(11)
    for blocksize in (64, 256):
        for double_quant in (False, True):
            check_gemv((40, 512), (3, 512), True, double_quant, torch.bfloat16, gen, blocksize)
            check_gemv((32, 1024), (1, 1024), False, double_quant, torch.float32, gen, blocksize)
    assert len(launched) == 8, "every case must take the word kernel"


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("step_words", [None, (32, 1)], ids=["default-steps", "32-word-steps"])
def test_gemv_rows_kernel_configurations(monkeypatch, per_row_kernels, step_words, x_dtype):
    """The rows kernel (bf16/fp16 x, K a multiple of 256 and of the blocksize) in the
    configurations the GPU meets: N not a multiple of 4 (the last group's rows clamped and
    not stored), 1 and 3 rows of x, several steps per row (32-word steps: 1024 columns are 4
    steps), programs that walk several row groups (the interpreter runs 3 programs), the
    prefetch crossing from one group (or row of x) to the next, blocksizes 32 to 256, double
    quant, bias. On a GPU the code values come from warp shuffles, here from loads."""
    from qconform_triton_nf4.kernels import nf4_gemv

    if step_words is not None:
        monkeypatch.setattr(nf4_gemv, "_ROWS_WORDS", (step_words,))
        monkeypatch.setattr(nf4_gemv, "_ROWS_WORDS_MANY_ITEMS", (step_words,))
    launched = spy_on(monkeypatch, nf4_gemv, "_gemv_4bit_rows_kernel")
    gen = torch.Generator().manual_seed(12)
    cases = 0
    for blocksize, double_quant in ((64, False), (32, True), (256, False), (128, True)):
        check_gemv((42, 1024), (3, 1024), True, double_quant, x_dtype, gen, blocksize)
        check_gemv((12, 512), (1, 512), False, double_quant, x_dtype, gen, blocksize)
        cases += 2
    assert len(launched) == cases, "every case must take the rows kernel"


@pytest.mark.skipif(DEVICE.type != "cuda", reason="the interpreter always takes the table loads (every test here)")
def test_gemv_table_lookup_compiled_for_a_gpu(monkeypatch, per_row_kernels):
    """The path a ROCm GPU takes (no PTX shuffle: code values loaded from the table),
    compiled and run on this GPU: the rows kernel and the word kernel (prefetch on, which
    with the shuffle unavailable falls back to the shared-memory gather)."""
    from qconform_triton_nf4.kernels import nf4_gemv

    monkeypatch.setattr(nf4_gemv, "ptx_shuffle_ok", lambda device: False)
    rows = spy_on(monkeypatch, nf4_gemv, "_gemv_4bit_rows_kernel")
    words = spy_on(monkeypatch, nf4_gemv, "_gemv_4bit_words_kernel")
    gen = torch.Generator().manual_seed(14)
    for double_quant in (False, True):
        check_gemv((42, 2048), (3, 2048), True, double_quant, torch.bfloat16, gen)
        check_gemv((40, 512), (2, 512), False, double_quant, torch.float32, gen)
    assert len(rows) == 2 and len(words) == 2, "each kernel must run twice"


def test_gemv_rows_kernel_only_where_it_can_read_x(monkeypatch, per_row_kernels):
    """fp32 x, x with strided columns, rows of x off 16-byte boundaries and K not a multiple
    of 256 go to the other kernels (and still compute the right numbers)."""
    from qconform_triton_nf4.kernels import nf4_gemv

    launched = spy_on(monkeypatch, nf4_gemv, "_gemv_4bit_rows_kernel")
    gen = torch.Generator().manual_seed(13)
    check_gemv((8, 512), (1, 512), False, False, torch.float32, gen)
    check_gemv((8, 192), (2, 192), False, False, torch.bfloat16, gen)  # K = 192: no step size divides 24 words
    packed, state, kw = quantize((8, 512), "nf4", 64, False, seed=4)
    args = (packed.to(DEVICE), state.absmax.to(DEVICE))
    wide = torch.randn(2, 1024, generator=gen).bfloat16().to(DEVICE)
    offset_rows = (
        torch.randn(2 * 516, generator=gen).bfloat16().to(DEVICE)[4:].view(2, 514)[:, :512]
    )  # rows at 8-byte offsets
    for x in (wide[:, ::2], offset_rows):
        assert torch.equal(
            kernels.gemv_4bit(x, *args, shape=(8, 512), **kw),
            kernels.gemv_4bit(x.contiguous(), *args, shape=(8, 512), **kw),
        )
    assert len(launched) == 2, "only the two contiguous copies may take the rows kernel"


@pytest.mark.kernel_sweep
@pytest.mark.parametrize("config", [None, (2, 2, 8)], ids=["default", "two-tiles-two-warps-two-splits"])
def test_gemv_tensor_core_kernel_configurations(monkeypatch, config):
    """The tensor-core kernel (2-32 rows of bf16/fp16 x, K a multiple of 64) in the
    configurations the GPU meets: one to four groups of 8 rows of x (5, 11, 19 and 29 rows;
    three and four groups always in one row tile), N not a
    multiple of the 16- or 32-row tiles (the last rows clamped and not stored), K = 320
    (5 chunks: with 2 warps and 2 splits some warps get none in the last iteration), the
    warps' and the splits' sums (the second config: 2 tiles per program, 2 warps, 2 splits),
    blocksizes 32 to 256, double quant, bias. On a GPU the products are mma.sync, here the
    same kernel computes them without PTX."""
    from qconform_triton_nf4.kernels import nf4_gemv, nf4_mma

    # the interpreter's narrower range (nf4_gemv.INTERPRETED_MMA_ROWS) widened to every group count
    monkeypatch.setattr(nf4_gemv, "INTERPRETED_MMA_ROWS", (4, nf4_mma.MAX_ROWS))
    if config is not None:
        monkeypatch.setattr(
            nf4_mma,
            "_GPU_CONFIG" if DEVICE.type == "cuda" else "_INTERPRETER_CONFIG",
            {1: config, 2: config, 3: (1, *config[1:]), 4: (1, *config[1:])},
        )
    launched = spy_on(monkeypatch, nf4_mma, "_gemm_4bit_mma_kernel")
    gen = torch.Generator().manual_seed(16)
    cases = 0
    for blocksize, double_quant, x_dtype, most_rows in (
        (64, False, torch.bfloat16, 19),
        (32, True, torch.float16, 29),
        (128, True, torch.bfloat16, 29),
        (256, False, torch.float16, 19),
    ):
        check_gemv((42, 320), (5, 320), True, double_quant, x_dtype, gen, blocksize)
        check_gemv((42, 320), (11, 320), False, double_quant, x_dtype, gen, blocksize)
        check_gemv((42, 320), (most_rows, 320), most_rows == 19, double_quant, x_dtype, gen, blocksize)
        cases += 3
    assert len(launched) == cases, "every case must take the tensor-core kernel"
    if config is not None:
        split = [grid for grid in launched if grid[1] == 2]
        assert split, "two splits, added by the last program of each tile"


@pytest.mark.parametrize("x_dtype, rows, with_bias", [(torch.bfloat16, 5, True), (torch.float16, 19, False)])
def test_tensor_core_split_sums_are_added_in_split_order_by_the_last_program(monkeypatch, x_dtype, rows, with_bias):
    """With K split over programs, the last program of each tile to draw its ticket writes
    ``((0 + split 0) + split 1) + ... + bias`` of the splits' fp32 sums, rounded once, bit
    for bit (the order of the separate sum kernel this replaced), and leaves every ticket
    zero for the next launch."""
    from qconform_triton_nf4.kernels import nf4_gemv, nf4_mma

    monkeypatch.setattr(nf4_gemv, "INTERPRETED_MMA_ROWS", (4, nf4_mma.MAX_ROWS))
    config = (1, 2, 64)  # 2 warps, as many splits as K's 8 units allow: 4
    monkeypatch.setattr(
        nf4_mma, "_GPU_CONFIG" if DEVICE.type == "cuda" else "_INTERPRETER_CONFIG", dict.fromkeys(range(1, 5), config)
    )
    monkeypatch.setattr(nf4_mma, "_GPU_CONFIG_NARROW", {})
    launches = spy_launches(monkeypatch, nf4_mma, "_gemm_4bit_mma_kernel")
    N = 40
    K = 512 * (nf4_mma.RUN if DEVICE.type == "cuda" else 1)  # 8 units: chunks, on a GPU runs (ABSMAX_QUADS)
    packed, state, kw = quantize((N, K), "nf4", 64, False, seed=3)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, K, generator=gen).to(x_dtype).to(DEVICE)
    bias = torch.randn(N, generator=gen).to(x_dtype).to(DEVICE) if with_bias else None
    got = kernels.gemv_4bit(x, packed.to(DEVICE), state.absmax.to(DEVICE), shape=(N, K), bias=bias, **kw)
    ((grid, args),) = launches
    work, tickets = args[6], args[7]
    assert grid[1] == 4 and tuple(work.shape) == (4, rows, N) and work.dtype == torch.float32
    expected = torch.zeros(rows, N, dtype=torch.float32, device=DEVICE)
    for split in work:
        expected = expected + split
    if bias is not None:
        expected = expected + bias.float()
    assert torch.equal(got, expected.to(x_dtype))
    assert not bool(tickets.any()), "the last program zeroes its tile's ticket"


@triton.jit
def _sum_tile_splits_probe(work_ptr, bias_ptr, out_ptr, M, N, splits, ROWS: tl.constexpr):
    _sum_tile_splits(work_ptr, bias_ptr, out_ptr, tl.program_id(0) * ROWS, M, N, splits, ROWS, True, False)


def test_split_sums_are_added_from_zero_in_split_order() -> None:
    """Splits 2^24, 1, -2^24: in split order the 1 is lost to fp32 rounding (0 + bias),
    in any order that adds 1 to -2^24 first it is kept (1 + bias). So the sum's bits, and a
    result bit-equal run after run, follow from the order alone."""
    M, N, rows = 2, 20, 16
    work = torch.empty(3, M, N, dtype=torch.float32)
    work[0], work[1], work[2] = 2.0**24, 1.0, -(2.0**24)
    bias = torch.arange(N, dtype=torch.float16)
    out = torch.full((M, N), -7.0, dtype=torch.float16)
    work, bias, out = work.to(DEVICE), bias.to(DEVICE), out.to(DEVICE)
    _sum_tile_splits_probe[(triton.cdiv(N, rows),)](work, bias, out, M, N, 3, ROWS=rows)
    assert torch.equal(out.cpu(), bias.cpu().float().expand(M, N).half())


@pytest.mark.parametrize(
    "n, k, multiprocessors, warps_per_sm, run, splits",
    [
        (
            8192,
            8192,
            132,
            32,
            1,
            2,
        ),  # 512 programs of 4 warps: 2 splits give 31 warps per SM (was 32 splits: 1 chunk each)
        (14336, 4096, 132, 32, 1, 1),  # 896 programs already give 27 warps per SM
        (4096, 4096, 132, 32, 1, 4),  # 256 programs: 4 splits, 8 chunks per warp
        (256, 8192, 132, 64, 1, 32),  # a narrow weight: capped where each warp keeps one chunk (128 chunks / 4 warps)
        (256, 8192, 132, 64, 4, 8),  # the same in runs of 4 chunks (ABSMAX_QUADS): one run per warp
        (4096, 4096, 132, 32, 4, 4),  # runs: 16 of them, 4 splits still give each warp one
    ],
)
def test_tensor_core_splits_fill_the_gpu_once(n, k, multiprocessors, warps_per_sm, run, splits):
    """K is split only as far as the grid needs to give each multiprocessor about
    ``warps_per_sm`` warps: the tiles along N count (a split count taken from the warps
    per program alone made every warp take one 64-column chunk and write fp32 partial
    sums: 87 us instead of 56 at 8192^2 and 16 rows on the H100, bench/notes.md v13), and
    every warp keeps at least one unit of K (a chunk, or a run of 4 on a GPU)."""
    from qconform_triton_nf4.kernels import nf4_mma

    tiles = math.ceil(n / 16)
    got = nf4_mma.splits_for(tiles, 4, warps_per_sm, k // nf4_mma.CHUNK // run, multiprocessors)
    assert got == splits


def test_tensor_core_route_only_where_it_can_read(monkeypatch):
    """One row, fp32 x, strided or misaligned x and K not a multiple of 64 go to the per-row
    kernels (and still compute the right numbers); ``fused_rows_limit`` says so."""
    from qconform_triton_nf4.kernels import nf4_mma

    launched = spy_on(monkeypatch, nf4_mma, "_gemm_4bit_mma_kernel")
    gen = torch.Generator().manual_seed(17)
    check_gemv((8, 512), (1, 512), False, False, torch.bfloat16, gen)
    check_gemv((8, 512), (4, 512), False, False, torch.float32, gen)
    check_gemv((8, 96), (4, 96), False, False, torch.bfloat16, gen)
    packed = torch.zeros(8 * 512 // 2, dtype=torch.uint8, device=DEVICE)
    wide = torch.randn(4, 1024, generator=gen).bfloat16().to(DEVICE)
    offset_rows = torch.randn(4 * 516 + 1, generator=gen).bfloat16().to(DEVICE)[1:].view(4, 516)[:, :512]
    for x in (wide[:, ::2], offset_rows):
        assert kernels.fused_rows_limit(x, packed, 512) == kernels.nf4_gemv.PER_ROW_MAX_ROWS
        check_gemv((8, 512), None, False, False, torch.bfloat16, gen, x=x)
    assert kernels.fused_rows_limit(wide[:, :512], packed, 512) == kernels.nf4_gemv.mma_rows()[1]
    assert not launched, "no case here may take the tensor-core kernel"


def test_tensor_core_ptx_only_on_nvidia_sm80(monkeypatch):
    """mma.sync with bf16/fp16 needs an NVIDIA GPU of compute capability 8.0+; a ROCm build,
    an older GPU and the interpreter compute without PTX (and ROCm is not routed there)."""
    from qconform_triton_nf4.kernels import nf4_mma

    monkeypatch.setattr(nf4_mma, "interpreter_active", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    assert nf4_mma.mma_ptx_ok(torch.device("cuda", 0))
    assert not nf4_mma.mma_ptx_ok(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    assert not nf4_mma.mma_ptx_ok(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    assert not nf4_mma.mma_ptx_ok(torch.device("cuda", 0))


def test_ptx_shuffle_only_on_nvidia(monkeypatch):
    """The shuffle lookup is inline PTX: a ROCm build (torch.version.hip set, devices still
    named "cuda") and the interpreter must take the table loads instead."""
    from qconform_triton_nf4.kernels import nf4_gemv

    monkeypatch.setattr(nf4_gemv, "interpreter_active", lambda: False)
    monkeypatch.setattr(torch.version, "hip", None)
    assert nf4_gemv.ptx_shuffle_ok(torch.device("cuda", 0))
    assert not nf4_gemv.ptx_shuffle_ok(torch.device("cpu"))
    monkeypatch.setattr(torch.version, "hip", "6.4.43482")
    assert not nf4_gemv.ptx_shuffle_ok(torch.device("cuda", 0))
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(nf4_gemv, "interpreter_active", lambda: True)
    assert not nf4_gemv.ptx_shuffle_ok(torch.device("cuda", 0))


def test_gemv_reads_non_contiguous_x():
    packed, state, kw = quantize((8, 64), "fp4", 64, False, seed=4)
    wide = torch.randn(2, 128, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    x = wide[:, ::2]  # stride 2 along K
    assert not x.is_contiguous()
    args = (packed.to(DEVICE), state.absmax.to(DEVICE))
    got = kernels.gemv_4bit(x, *args, shape=(8, 64), **kw)
    expected = kernels.gemv_4bit(x.contiguous(), *args, shape=(8, 64), **kw)
    assert torch.equal(got, expected)
    transposed = torch.randn(64, 2, generator=torch.Generator().manual_seed(6)).to(DEVICE).T  # stride (1, 2)
    assert torch.equal(
        kernels.gemv_4bit(transposed, *args, shape=(8, 64), **kw),
        kernels.gemv_4bit(transposed.contiguous(), *args, shape=(8, 64), **kw),
    )


def test_gemv_refuses_more_than_32_rows():
    packed, state, kw = quantize((4, 64), "nf4", 64, False)
    x = torch.zeros(33, 64, device=DEVICE)
    with pytest.raises(ValueError, match="at most 32"):
        kernels.gemv_4bit(x, packed.to(DEVICE), state.absmax.to(DEVICE), shape=(4, 64), **kw)


def test_weight_buffer_follows_dtype_changes():
    """unsloth PR 4026: a buffer that kept its first dtype broke a bf16-then-fp16 sequence."""
    shape = (4, 128)
    packed, state, kw = quantize(shape, "nf4", 64, True)
    args = (packed.to(DEVICE), state.absmax.to(DEVICE))
    buffer = kernels.WeightBuffer()
    storages = []
    for dtype in (torch.bfloat16, torch.float16, torch.bfloat16, torch.float32):
        got = buffer.dequantize(*args, shape=shape, out_dtype=dtype, **kw)
        expected = kernels.dequantize_4bit(*args, shape=shape, out_dtype=dtype, **kw)
        assert got.dtype == dtype and got.shape == shape
        assert torch.equal(got, expected)
        assert got.data_ptr() == buffer.storage.data_ptr(), "result must be a view of the buffer"
        storages.append(buffer.storage)
    assert all(a is not b for a, b in zip(storages, storages[1:])), "each dtype change must reallocate"


def test_weight_buffer_reuses_storage_and_overwrites_previous_result():
    packed_a, state_a, kw = quantize((4, 128), "nf4", 64, False, seed=7)
    packed_b, state_b, _ = quantize((2, 64), "nf4", 64, False, seed=8)
    buffer = kernels.WeightBuffer()
    first = buffer.dequantize(
        packed_a.to(DEVICE), state_a.absmax.to(DEVICE), shape=(4, 128), out_dtype=torch.float16, **kw
    )
    first_values = first.clone()
    storage = buffer.storage
    second = buffer.dequantize(
        packed_b.to(DEVICE), state_b.absmax.to(DEVICE), shape=(2, 64), out_dtype=torch.float16, **kw
    )
    assert buffer.storage is storage, "a smaller request of the same dtype must reuse the storage"
    assert second.shape == (2, 64)
    assert not torch.equal(first, first_values), "the previous result is overwritten, as documented"
    bigger = buffer.dequantize(
        packed_a.to(DEVICE), state_a.absmax.to(DEVICE), shape=(4, 128), out_dtype=torch.float16, **kw
    )
    assert torch.equal(bigger, first_values)


def test_state_errors_name_the_problem():
    packed, state, kw = quantize((4, 128), "nf4", 64, True)
    packed, absmax = packed.to(DEVICE), state.absmax.to(DEVICE)
    with pytest.raises(ValueError, match="absmax has 3 entries but 512 elements"):
        kernels.dequantize_4bit(packed, absmax[:3], shape=(4, 128), out_dtype=torch.float32, **kw)
    plain = {k: v for k, v in kw.items() if k in ("blocksize", "code")}
    with pytest.raises(ValueError, match="nested_absmax/nested_code were not given"):
        kernels.dequantize_4bit(packed, absmax, shape=(4, 128), out_dtype=torch.float32, **plain)
    with pytest.raises(ValueError, match="blocksize 48 is not one of"):
        kernels.dequantize_4bit(packed, absmax, shape=(4, 128), out_dtype=torch.float32, **{**kw, "blocksize": 48})


@pytest.mark.skipif(torch.cuda.is_available(), reason="interpreter mode is only used without a GPU")
def test_interpreter_active_on_cpu():
    assert kernels.interpreter_active()


def test_interpreter_mode_is_fixed_when_the_kernels_are_defined(monkeypatch):
    """A tool that swaps the module's kernel objects (bench/compile_census.py wraps them)
    must not flip the mode the entry points dispatch on: the census once made H100 runs
    take the interpreter's paths this way (bench/notes.md, "Warm-up")."""
    from qconform_triton_nf4.kernels import nf4_dequant

    before = kernels.interpreter_active()

    def other_mode_kernel(x):
        pass

    import triton

    swapped = object() if not before else triton.runtime.JITFunction(other_mode_kernel)
    monkeypatch.setattr(nf4_dequant, "_dequantize_4bit_kernel", swapped)
    assert kernels.interpreter_active() == before
