"""Fused 4-bit matmul on tensor cores past the fused kernels' 32 rows: ``y = x W^T + b``.

Why: past ``nf4_gemv``/``nf4_mma``'s 32 rows the wing dequantized W into a bf16 buffer and
called cuBLAS: the weight written at 2 bytes a value and read back, where one read of its
packed half byte would do. On an H200 that route took 1.4-2.3 times the unquantized bf16
layer's time from 64 to 512 rows (issue 52). Here a Triton GEMM reads bitsandbytes' packed
bytes and absmax tile by tile inside its K loop, decodes each tile in registers and hands it
to ``tl.dot`` (``wgmma`` on sm_90, the decoded tile in registers, x from shared memory): no
dequantized weight is written, and the loads of x, bytes and absmax are software-pipelined
over ``num_stages`` K steps (``cp.async``).

Arithmetic, the same as dequantize-then-GEMM, so the suites' error model for the
dequantize + cuBLAS route applies unchanged: each weight is fp32 ``code[nibble] * absmax``
(a double-quantized absmax decoded as ``nested_code[c] * nested_absmax + offset``, two fp32
roundings: the kernel is built with fp-fusion off, as ``dequantize_4bit`` is), rounded once
to nearest even to x's dtype (bf16 or fp16): bit for bit the value ``dequantize_4bit``
writes. The tensor cores multiply it with x exactly and accumulate in fp32, in an order of
their own (so not bit-identical to cuBLAS on the dequantized weight, within the same bound);
the sums of a K split are added in fp32 in split order, then the bias, and the result is
rounded once to x's dtype. fp32 x is not taken: a tf32 dot would change the arithmetic.

Layout. W is (N, K), flat element ``n K + k`` in byte ``(n K + k) // 2``, the even element
in the HIGH nibble, scaled by ``absmax[(n K + k) // blocksize]`` (``nf4_dequant``). A program
computes a tile of BLOCK_N weight rows by BLOCK_M rows of x as ``W_tile @ x_tile^T``: the
decoded weight is the dot's left operand (in registers), so a tile 32 rows of x wide is a
tensor-core shape without padding x. A K step of BLOCK_K columns reads a [BLOCK_N, BLOCK_K / 2]
byte tile and, where the step lies in one quantization block, one absmax per weight row
(else one per byte). The decode (v21, bench/notes.md) looks each nibble's code up with one
warp shuffle (``shfl.sync.idx``: lane ``l`` holds ``code[l % 16]``, as in ``nf4_gemv``),
multiplies by the absmax and joins the two nibbles of a byte into adjacent columns; Triton
turns the join into register moves (no shared memory), and ``wgmma`` runs a step behind the
decode. v20 (commit 0aa6b87) looked codes up in memory and in a 3-D group layout: 1.5-3.7
times dense bf16. Rows of x past M and weight rows past N are clamped (read again) rather
than masked, and not stored. Programs are ordered GROUP_M tiles of x rows per weight tile,
so the tiles sharing a weight tile run together (L2).

Split K (``SPLIT_SUMS``). Few rows make few output tiles, and one program of 4-8 warps per
multiprocessor cannot hide the decode's latency: the table splits K 4-8 ways at 32-128 rows
(measured), and a configuration without a split count (``split_k`` 0) splits until about
``programs_per_sm`` programs run on each multiprocessor (``splits_for``). Program (tile, split) takes a contiguous run of K steps and stores its
fp32 sums in ``work`` [splits, M, N]; the last program of a tile to draw a ticket (one int32
per tile, zero between launches, per stream) adds the tile's splits from zero in split order,
the bias, and rounds: the scheme, and so the determinism, of ``nf4_mma``'s splits.

In Triton's interpreter (the CPU tests) there is no inline PTX, ``tl.dot`` on bf16 returns
wrong values (Triton 3.9) and fp32 -> bf16 casts truncate: ``EMULATED`` loads the code from
the table, rounds the decoded weights with integer ops (``bf16_bits``) or numpy's fp16 cast,
and multiplies in an fp32 dot (``ieee``) with x widened, which is exact for the products
(bf16 and fp16 products fit fp32's mantissa), so the interpreter computes the same model:
exact products, fp32 sums, one rounding.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
import triton
import triton.language as tl

import qconform_triton_nf4.kernels.nf4_gemv as nf4_gemv
from qconform_triton_nf4.kernels.launch import BoundLaunch, pointers
from qconform_triton_nf4.kernels.nf4_dequant import (
    bf16_bits,
    check_launchable,
    interpreter_active,
    load_block_absmax,
    nested_args,
    store_as,
)
from qconform_triton_nf4.kernels.split_sums import SplitSums

K_MULTIPLE = 32  # K the kernel reads: BLOCK_K >= 32 divides it
MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 4  # K steps a split keeps at least, when the plan chooses the splits


@dataclass(frozen=True)
class TcConfig:
    """A launch configuration: tiles of ``block_m`` rows of x by ``block_n`` weight rows,
    ``block_k`` columns a K step (shrunk to divide K), ``num_warps``, ``num_stages``
    (software pipeline depth), ``split_k`` programs along K per tile (0: chosen by the plan,
    ``splits_for``, to run about ``programs_per_sm`` programs on each multiprocessor), and
    ``group_m`` tiles of x rows per weight tile in the program order."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 0
    group_m: int = 8
    programs_per_sm: int = 4

    def label(self) -> str:
        """A short name: ``m64n64k64w4s3x0g8p4`` (x: split_k, 0 = chosen by the plan)."""
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
            f"x{self.split_k}g{self.group_m}p{self.programs_per_sm}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# The GPU's configuration by rows: (most rows, config), the first entry whose most rows >= M,
# the last for more. Measured on an H200 (bench/tc_gemm_sweep.py: bf16, NF4 blocksize 64,
# device us, 48 configurations a case at 8192^2, 4096^2, 14336 x 4096 and 4096 x 14336;
# results/tc-gemm-v21-h200.json): each row class's configuration whose worst ratio to the
# best of each shape is smallest (32 rows 1.06, 64 rows 1.08, 128 rows 1.16); past 64 rows,
# where the route does not take this kernel (direct calls, the sweep), 128 rows' entry.
_GPU_CONFIGS: tuple[tuple[int, TcConfig], ...] = (
    (32, TcConfig(32, 64, 64, 4, 3, split_k=8)),
    (64, TcConfig(64, 64, 64, 4, 4, split_k=4)),
    (2**31, TcConfig(128, 64, 64, 8, 3, split_k=4)),
)
# ROCm (no class routes here there, ``TC_MAX_ROWS``; a direct call compiles it): small tiles
# and no software pipeline, so that no listed AMD arch spills (the GPU table's 64 x 64 tiles
# spilled up to 1034 registers on gfx906 and 39-44 on RDNA3 in the compile check; with two
# stages, the default run's logged calls, transposed and strided activations among them,
# spilled 2 registers on gfx906 and gfx942).
_ROCM_CONFIG = TcConfig(32, 32, 64, 4, 1)
# The interpreter: each interpreted operation costs about the same at any width, so few,
# large programs; one K split (the tests pass configurations that split).
_INTERPRETER_CONFIG = TcConfig(32, 32, 64, 1, 1, split_k=1, group_m=2)

# Rows up to which ``plans.linear_plan`` sends a call past the fused kernels to this one,
# by arch class (``arch_class``): the most rows at which the table's configuration beat
# dequantize + cuBLAS at every swept shape (bench/notes.md v21: on an H200 at 64 rows
# 0.64-0.93 times the route's time; at 128 rows 0.89-0.97 at best, and slower than the
# route at 14336 x 4096 with the table's choice; from 256 rows slower everywhere). A class
# not measured is off (0).
TC_MAX_ROWS: dict[str, int] = {"sm80": 0, "sm90": 64, "sm100": 0, "sm120": 0, "rocm": 0, "interpreter": 0}


def arch_class(device: torch.device) -> str:
    """``TC_MAX_ROWS``' key for ``device``: "interpreter" (the kernels built for Triton's
    interpreter), "rocm", or ``sm<major><minor>`` of an NVIDIA GPU."""
    if interpreter_active() or device.type != "cuda":
        return "interpreter"
    if torch.version.hip is not None:
        return "rocm"
    major, minor = _capability(device.index if device.index is not None else torch.cuda.current_device())
    return f"sm{major}{minor}"


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def tc_max_rows(device: torch.device) -> int:
    """The most rows ``plans.linear_plan`` routes to this kernel on ``device`` (0: none)."""
    return TC_MAX_ROWS.get(arch_class(device), 0)


def config_for(M: int, device: torch.device) -> TcConfig:
    """The configuration table's choice for M rows of x on ``device`` (one table for every
    shape: the sweep's choice per rows over four shapes)."""
    if device.type == "cpu":
        return _INTERPRETER_CONFIG
    if torch.version.hip is not None:
        return _ROCM_CONFIG
    for most_rows, config in _GPU_CONFIGS:
        if M <= most_rows:
            return config
    return _GPU_CONFIGS[-1][1]


def split_count(split_k: int, tiles: int, steps: int, multiprocessors: int, programs_per_sm: int) -> int:
    """A plan's K splits: ``split_k`` where a configuration sets it, else ``splits_for``'s;
    then as many as keep every split at least one of the ``steps`` K steps."""
    splits = split_k or splits_for(tiles, steps, multiprocessors, programs_per_sm)
    per_split = math.ceil(steps / max(1, min(splits, steps)))
    return math.ceil(steps / per_split)


def splits_for(tiles: int, steps: int, multiprocessors: int, programs_per_sm: int = 4) -> int:
    """K splits so that the ``tiles`` output tiles make about ``programs_per_sm`` programs a
    multiprocessor (rounded), each split keeping at least ``MIN_STEPS_PER_SPLIT`` of the
    ``steps`` K steps, at most ``MAX_SPLITS``."""
    wanted = round(programs_per_sm * multiprocessors / max(tiles, 1))
    return max(1, min(wanted, steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))


def tc_gemm_readable(x: torch.Tensor, K: int) -> bool:
    """Whether this kernel takes x [..., K] (any strides): bf16/fp16 and K a positive
    multiple of ``K_MULTIPLE``."""
    return x.dtype in (torch.bfloat16, torch.float16) and K > 0 and K % K_MULTIPLE == 0


@triton.jit
def _lane_code(code_ptr, like, PTX: tl.constexpr):
    """``code[lane % 16]`` as int32 bits in every element of a tensor shaped ``like`` (each
    thread's own lane's entry: the shuffle's table), or unused zeros without PTX. One pure
    asm with the same operand in every element, so the compiler keeps one register."""
    if PTX:
        address = tl.full(like.shape, 0, tl.int64) + code_ptr.to(tl.int64, bitcast=True)
        return tl.inline_asm_elementwise(
            "{ .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 15; mul.wide.u32 a, l, 4; "
            "add.s64 a, a, $1; ld.global.nc.b32 $0, [a]; }",
            "=r,l",
            [address],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        )
    return like * 0


@triton.jit
def _code_values(lane_code, code_ptr, nibbles, PTX: tl.constexpr):
    """fp32 ``code[nibbles]``: compiled for NVIDIA a shuffle from the lane holding it;
    otherwise a load from the table."""
    if PTX:
        return tl.inline_asm_elementwise(
            "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
            "=r,r,r",
            [lane_code, nibbles],
            dtype=tl.int32,
            is_pure=True,
            pack=1,
        ).to(tl.float32, bitcast=True)
    return tl.load(code_ptr + nibbles)


@triton.jit
def _multiply(w, xt, acc, EMULATED: tl.constexpr, X_FP16: tl.constexpr):
    """``acc + round(w) @ xt``: fp32 ``w`` [BLOCK_N, BLOCK_K] rounded to x's dtype, ``xt``
    [BLOCK_K, BLOCK_M] in x's dtype, fp32 accumulators (module docstring, interpreter)."""
    if EMULATED:
        if X_FP16:
            rounded = w.to(tl.float16).to(tl.float32)
        else:
            rounded = (bf16_bits(w) << 16).to(tl.float32, bitcast=True)
        return tl.dot(rounded, xt.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(w.to(xt.dtype), xt, acc)


@triton.jit(do_not_specialize=["M"])  # one variant for every batch
def _gemm_4bit_tc_kernel(
    x_ptr,
    packed_ptr,
    absmax_ptr,
    code_ptr,
    bias_ptr,
    out_ptr,
    work_ptr,
    ticket_ptr,
    nested_absmax_ptr,
    nested_code_ptr,
    offset,
    M,
    N,
    K,
    stride_xm,
    stride_xk,
    BLOCKSIZE: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    EMULATED: tl.constexpr,
    X_FP16: tl.constexpr,
    PTX: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    SPLIT_SUMS: tl.constexpr,
):
    """Output tile ``program_id(0)`` (GROUP_M tiles of x rows per weight tile), K steps of
    split ``program_id(1)``; one split: bias and rounding here; several: fp32 sums into
    ``work_ptr`` and the last program of the tile adds them (``_sum_splits``)."""
    pid = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_read = tl.minimum(m, M - 1).to(tl.int64)
    n_read = tl.minimum(n, N - 1).to(tl.int64)
    HALF: tl.constexpr = BLOCK_K // 2
    ONE_BLOCK: tl.constexpr = BLOCK_K <= BLOCKSIZE  # a K step lies in one block (K % BLOCK_K == 0)
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, splits)
    first_step = split * per_split
    last_step = tl.minimum(first_step + per_split, steps)
    k_first = first_step * BLOCK_K
    column = k_first + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + m_read[None, :] * stride_xm + column[:, None] * stride_xk  # [BLOCK_K, BLOCK_M]: x^T
    byte = tl.arange(0, HALF)
    w_bytes = packed_ptr + (n_read * (K // 2))[:, None] + (k_first // 2 + byte)[None, :]
    if ONE_BLOCK:
        first_flat = n_read * K + k_first  # [BLOCK_N]: the flat element starting each row's step
    else:
        first_flat = (n_read * K)[:, None] + (k_first + 2 * byte)[None, :]  # [BLOCK_N, HALF]
    lane_code = _lane_code(code_ptr, tl.zeros((BLOCK_N, HALF), dtype=tl.int32), PTX)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(first_step, last_step):
        xt = tl.load(x_tile)
        packed = tl.load(w_bytes).to(tl.int32) & 255
        scale = load_block_absmax(
            absmax_ptr,
            first_flat // BLOCKSIZE,
            0,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            False,
        )
        if ONE_BLOCK:
            scale = scale[:, None]
        high = _code_values(lane_code, code_ptr, packed >> 4, PTX) * scale
        low = _code_values(lane_code, code_ptr, packed & 15, PTX) * scale
        w = tl.reshape(tl.join(high, low), (BLOCK_N, BLOCK_K))  # column 2j: byte j's high nibble
        acc = _multiply(w, xt, acc, EMULATED, X_FP16)
        x_tile += BLOCK_K * stride_xk
        w_bytes += HALF
        first_flat += BLOCK_K
    at = m[None, :].to(tl.int64) * N + n[:, None]  # [BLOCK_N, BLOCK_M] in out [M, N]
    ok = (m < M)[None, :] & (n < N)[:, None]
    if SPLIT_SUMS:
        tl.store(work_ptr + split.to(tl.int64) * M * N + at, acc, mask=ok)
        # Every thread's sums stored before one thread takes the tile's ticket (release, GPU
        # scope); the program that draws the last one reads the others' after its acquire.
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + pid, 1, sem="acq_rel")
        if ticket == splits - 1:
            _sum_splits(
                work_ptr, bias_ptr, out_ptr, at, ok, n_read, M, N, splits, HAS_BIAS, BF16_BITS, BLOCK_N, BLOCK_M
            )
            tl.store(ticket_ptr + pid, 0)  # zero again for the next launch on this stream
    else:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + n_read).to(tl.float32)[:, None]
        store_as(out_ptr + at, acc, ok, BF16_BITS)


@triton.jit
def _sum_splits(
    work_ptr,
    bias_ptr,
    out_ptr,
    at,
    ok,
    n_read,
    M,
    N,
    splits,
    HAS_BIAS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    """``out = sum over splits of work[split] (+ bias)`` for one tile, from zero in split
    order, rounded once. The loads bypass L1 (``.cg``): the other splits' sums were written
    from other multiprocessors."""
    y = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    partial = work_ptr + at
    slab = M.to(tl.int64) * N
    for _ in range(0, splits):
        y += tl.load(partial, mask=ok, other=0.0, cache_modifier=".cg")
        partial += slab
    if HAS_BIAS:
        y += tl.load(bias_ptr + n_read).to(tl.float32)[:, None]
    store_as(out_ptr + at, y, ok, BF16_BITS)


# Argument positions of the per-call tensors of a launch (x, bias, out; work, tickets).
NATIVE_ROLES = {"x": 0, "bias": 4, "out": 5}


def plan_gemm_4bit_tc(
    x2: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    N: int,
    *,
    has_bias: bool,
    blocksize: int,
    nested_absmax: torch.Tensor,
    nested_code: torch.Tensor,
    nested_blocksize: int,
    offset: float,
    double_quant: bool,
    code: torch.Tensor,
    multiprocessors: int,
    config: TcConfig | None = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]:
    """The launch of ``tc_gemm_4bit`` for [M, K] x like ``x2`` (dtype, shape, strides,
    alignment), decided and bound once: ``plan(x2, out, bias)`` writes ``out`` [M, N] (x2's
    dtype). ``tc_gemm_4bit_plan``'s step after its checks (``tc_gemm_readable``; packed and
    absmax flat, the nested arguments from ``nested_args``); ``config``: the table's
    (``config_for``) where None."""
    M, K = x2.shape
    device = x2.device
    config = config or config_for(M, device)
    block_k = min(config.block_k, K & -K)  # the largest power of two <= block_k that divides K
    steps = K // block_k
    tiles = math.ceil(M / config.block_m) * math.ceil(N / config.block_n)
    splits = split_count(config.split_k, tiles, steps, multiprocessors, config.programs_per_sm)
    bf16_bits = x2.dtype == torch.bfloat16 and interpreter_active()
    stride_xm = x2.stride(0) if M > 1 else K
    stride_xk = x2.stride(1)
    launch = BoundLaunch(
        _gemm_4bit_tc_kernel,
        (tiles, splits),
        dict(
            BLOCKSIZE=blocksize,
            NESTED_BLOCKSIZE=nested_blocksize,
            DOUBLE_QUANT=double_quant,
            HAS_BIAS=has_bias,
            BF16_BITS=bf16_bits,
            EMULATED=interpreter_active(),
            X_FP16=x2.dtype == torch.float16,
            PTX=nf4_gemv.ptx_shuffle_ok(device),  # the lookup by warp shuffle, as the gemv kernels
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=block_k,
            GROUP_M=config.group_m,
            SPLIT_SUMS=splits > 1,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            enable_fp_fusion=False,  # keep nested_code * scale + offset two roundings, like dequantize_4bit
        ),
    )
    fixed, nested = (packed, absmax, code), (nested_absmax, nested_code)
    fixed_pointers, nested_pointers = pointers(fixed), pointers(nested)  # for the bound launch
    split_sums = SplitSums(splits, tiles, M, N, device)
    tail = (offset, M, N, K, stride_xm, stride_xk)

    def run(x2: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        bound = launch.bound
        p, a, c = fixed_pointers if bound else fixed
        nested_arguments = nested_pointers if bound else nested
        out_arg = out.view(torch.int16) if bf16_bits else out
        work, ticket = split_sums.buffers(out_arg, a)
        launch(x2, p, a, c, bias if bias is not None else a, out_arg, work, ticket, *nested_arguments, *tail)

    def native(x: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple[int, ...]) -> Any:
        if bf16_bits:
            return None
        p, a, c = fixed_pointers
        args = (None, p, a, c, a, None, None, None if splits > 1 else a, *nested_pointers, *tail)
        if splits == 1:
            return launch.native(args, NATIVE_ROLES, x, bias, out_shape)
        roles = dict(NATIVE_ROLES, work=6, counters=7)
        return launch.native(args, roles, x, bias, out_shape, work_numel=splits * M * N, counter_numel=tiles)

    run.native = native  # type: ignore[attr-defined]
    run.splits = splits  # type: ignore[attr-defined]
    run.config = config  # type: ignore[attr-defined]
    return run


def tc_gemm_4bit(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    blocksize: int,
    shape: tuple[int, int],
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None = None,
    nested_code: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: TcConfig | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with W (N, K) read from bitsandbytes-packed 4-bit bytes, on tensor
    cores, for any number of rows: x [..., K] bf16/fp16, any strides, K a multiple of 32
    (``tc_gemm_readable``). Returns [..., N] in x's dtype; the arithmetic of
    dequantize-then-GEMM (module docstring). ``tc_gemm_4bit_plan(...)(x, bias)``."""
    return tc_gemm_4bit_plan(
        x,
        packed,
        absmax,
        blocksize=blocksize,
        shape=shape,
        code=code,
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=nested_blocksize,
        offset=offset,
        bias=bias,
        config=config,
    )(x, bias)


def tc_gemm_4bit_plan(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    blocksize: int,
    shape: tuple[int, int],
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None = None,
    nested_code: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: float | torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    config: TcConfig | None = None,
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``tc_gemm_4bit``'s arguments validated and its launch bound: ``plan(x, bias)`` for
    every x and bias laid out as these (dtype, shape, strides, data-pointer alignment,
    device), as ``gemv_4bit_plan``; ``config`` overrides the table's (the sweep's)."""
    where = "kernels.tc_gemm_4bit"
    N, K = nf4_gemv.check_linear_call(
        x,
        packed,
        absmax,
        blocksize=blocksize,
        shape=shape,
        code=code,
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=nested_blocksize,
        bias=bias,
        where=where,
    )
    empty = nf4_gemv.empty_linear_plan(x, N, K)
    if empty is not None:
        return empty
    if not tc_gemm_readable(x, K):
        raise ValueError(
            f"{where}: takes bf16/fp16 x with K a multiple of {K_MULTIPLE}, got {x.dtype} x with K={K}: "
            "use gemv_4bit, or dequantize_4bit and a matmul"
        )
    check_launchable(x.device, where)
    x2 = x.reshape(-1, K)  # a view whenever the strides allow: the kernel takes strides
    absmax_flat = absmax.reshape(-1).contiguous()
    nested_absmax_arg, nested_code_arg, offset_value, double_quant = nested_args(
        absmax_flat, nested_absmax, nested_code, offset
    )
    run = plan_gemm_4bit_tc(
        x2,
        packed.reshape(-1).contiguous(),
        absmax_flat,
        N,
        has_bias=bias is not None,
        blocksize=blocksize,
        nested_absmax=nested_absmax_arg,
        nested_code=nested_code_arg,
        nested_blocksize=nested_blocksize,
        offset=offset_value,
        double_quant=double_quant,
        code=code.contiguous(),
        multiprocessors=nf4_gemv._multiprocessors(x.device) if x.device.type != "cpu" else 1,
        config=config,
    )
    out_shape = (*x.shape[:-1], N)
    flat = x.dim() == 2  # x is its own [M, K] view: no reshape per call
    bias_flat = bias is not None and bias.dim() == 1 and bias.stride(0) == 1

    def planned(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x.new_empty(out_shape)
        if bias is not None and not bias_flat:
            bias = bias.reshape(-1).contiguous()
        run(x if flat else x.reshape(-1, K), out, bias)
        return out

    def native(x: torch.Tensor, bias: torch.Tensor | None) -> Any:
        """The plan as one native call (``native_launch``), made after a first call; None
        where x's rows are not a view of x or bias is not flat, or none is had here."""
        if (bias is not None and not bias_flat) or x.reshape(-1, K).data_ptr() != x.data_ptr():
            return None
        return run.native(x, bias, out_shape)  # type: ignore[attr-defined]

    planned.native = native  # type: ignore[attr-defined]
    planned.splits = run.splits  # type: ignore[attr-defined]
    planned.config = run.config  # type: ignore[attr-defined]
    return planned
