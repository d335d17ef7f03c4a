"""Fused 4-bit matmul on tensor cores for tens to thousands of rows: ``y = x W^T + b``.

Why: past the fused kernels' 32 rows (``nf4_gemv``, ``nf4_mma``) the wing dequantized W
into a bf16 buffer and called cuBLAS: the weight written at 2 bytes a value and read back,
where one read of its packed half byte would do. On an H200 that route is 1.4-2.3 times
slower than the unquantized bf16 layer from 64 to 512 rows (issue 52). Here a Triton GEMM
reads bitsandbytes' packed bytes and absmax tile by tile inside its K loop, decodes each
tile in registers and hands it to ``tl.dot``: no dequantized weight is ever written, and
the loads of x, bytes and absmax are software-pipelined over ``num_stages`` K steps.

Arithmetic, the same as dequantize-then-GEMM, so the suites' error model for the
dequantize + cuBLAS route applies unchanged: each weight is fp32 ``code[nibble] * absmax``
(a double-quantized absmax decoded as ``nested_code[c] * nested_absmax + offset``, two
fp32 roundings: the kernel is built with fp-fusion off, as ``dequantize_4bit`` is), rounded
once to nearest even to x's dtype (bf16 or fp16): bit for bit the value ``dequantize_4bit``
writes. The tensor cores multiply it with x exactly and accumulate in fp32, in an order of
their own (so not bit-identical to cuBLAS on the dequantized weight, within the same bound);
the sums of a K split are added in fp32 in split order, then the bias, and the result is
rounded once to x's dtype. fp32 x is not taken: a tf32 dot would change the arithmetic.

Layout. W is (N, K), flat element ``n K + k`` in byte ``(n K + k) // 2``, the even element
in the HIGH nibble, scaled by ``absmax[(n K + k) // blocksize]`` (``nf4_dequant``). A program
computes a tile of BLOCK_N weight rows by BLOCK_M rows of x as ``W_tile @ x_tile^T``: the
decoded weight is the dot's left operand, so a tile 16 rows of x wide is a tensor-core
shape without padding x. A K step of BLOCK_K columns reads, per weight row, BLOCK_K / 2
bytes in groups of GROUP = min(BLOCK_K, blocksize) columns that share one absmax (a
[BLOCK_N, BLOCK_K / GROUP, GROUP / 2] byte tile and a [BLOCK_N, BLOCK_K / GROUP] absmax
tile, indexed from the flat element, so blocks that straddle rows need nothing else).
The code lookup (LOOKUP) is the decode's cost (an L1 access per value, as in the
tensor-core kernel: bench/notes.md v11): "nibbles" loads each value from the 16-entry
table, one 64-byte line, so a warp's 32 lookups are one L1 wavefront; "pairs" reads both
values of a byte in one 8-byte load from a 256-entry table of (code[high], code[low]) that
the plan builds from the state's own fp32 code, half the loads but a 2 KB table, so a
warp's loads touch up to 16 lines; "gather" looks the value up in a register copy of the
table (``nf4_dequant.lookup``, through shared memory; Triton 3.6 gave wrong sums with it
at 512-column tiles in v4, so the sweep checks every result). Compiled for NVIDIA the
table loads are inline ``ld.global.nc``: a ``tl.load`` from a table is staged through
shared memory by Triton's pipeliner, a ``cp.async`` per value (v3, and the TTGIR here). Compiled for sm_90 on
a CPU (Triton 3.9, the compile check's machinery), the loop is what this intends: x, bytes
and absmax ``cp.async``-pipelined, the decoded tile handed to ``wgmma`` from registers
with x from shared memory, the table loads inline, no spills. Which lookup is fastest
is the sweep's to say (bench/tc_gemm_sweep.py). The plan shrinks BLOCK_K to the largest power of two that
divides K, so K steps never mask; a route needs K to be a multiple of 32 (then a group
never straddles a quantization block). Rows of x past M and weight rows past N are
clamped (read again) rather than masked, and not stored. Programs are ordered GROUP_M
tiles of x rows per weight tile, so the tiles sharing a weight tile run together (L2).

Split K (``SPLIT_SUMS``, where there are too few output tiles to fill the GPU): program
(tile, split) takes a contiguous run of K steps and stores its fp32 sums in ``work``
[splits, M, N]; the last program of a tile to draw a ticket (one int32 per tile, zero
between launches, per stream) adds the tile's splits from zero in split order, the bias,
and rounds: the scheme, and so the determinism, of ``nf4_mma``'s splits.

In Triton's interpreter (the CPU tests) ``tl.dot`` on bf16 returns wrong values (Triton
3.9), and fp32 -> bf16 casts truncate: ``EMULATED`` rounds the decoded weights with integer
ops (``bf16_bits``) or numpy's fp16 cast, and multiplies in an fp32 dot (``ieee``) with x
widened, which is exact for the products (bf16 and fp16 products fit fp32's mantissa), so
the interpreter computes the same model: exact products, fp32 sums, one rounding.
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

from qconform_triton_nf4.kernels.launch import BoundLaunch, pointers
from qconform_triton_nf4.kernels.nf4_dequant import (
    bf16_bits,
    check_launchable,
    interpreter_active,
    load_block_absmax,
    lookup,
    nested_args,
    store_as,
)

K_MULTIPLE = 32  # K the kernel reads: BLOCK_K >= 32 divides it, and a group stays in one block
LOOKUPS = ("pairs", "nibbles", "gather")
MAX_SPLITS = 16
MIN_STEPS_PER_SPLIT = 4  # K steps a split keeps at least, when the plan chooses the splits


@dataclass(frozen=True)
class TcConfig:
    """A launch configuration: tiles of ``block_m`` rows of x by ``block_n`` weight rows,
    ``block_k`` columns a K step (shrunk to divide K), ``num_warps``, ``num_stages``
    (software pipeline depth), ``split_k`` programs along K per tile (0: as many as fill
    the multiprocessors once, ``splits_for``), ``group_m`` tiles of x rows per weight tile
    in the program order, and the code ``lookup`` (one of ``LOOKUPS``)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    split_k: int = 0
    group_m: int = 8
    lookup: str = "nibbles"

    def label(self) -> str:
        """A short name: ``m64n128k64w4s3x0g8-nibbles`` (x: split_k, 0 = chosen by the plan)."""
        return (
            f"m{self.block_m}n{self.block_n}k{self.block_k}w{self.num_warps}s{self.num_stages}"
            f"x{self.split_k}g{self.group_m}-{self.lookup}"
        )

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


# Outputs from which a weight is "wide" (the tables' second column), as in nf4_mma.
NARROW_N = 12288
# The GPU's configuration by shape class: (most rows, config below NARROW_N outputs, config
# from NARROW_N on), the first entry whose most rows >= M, the last for more. PLACEHOLDERS,
# not measured: bench/tc_gemm_sweep.py times a grid of candidates per (shape, rows) on a GPU
# and prints the table to put here (issue 52 item 2).
_GPU_CONFIGS: tuple[tuple[int, TcConfig, TcConfig], ...] = (
    (16, TcConfig(16, 64, 128, 4, 4), TcConfig(16, 64, 128, 4, 4)),
    (32, TcConfig(32, 64, 128, 4, 4), TcConfig(32, 64, 128, 4, 4)),
    (64, TcConfig(64, 64, 128, 4, 4), TcConfig(64, 64, 128, 4, 4)),
    (128, TcConfig(128, 64, 64, 4, 4), TcConfig(128, 64, 64, 4, 4)),
    (256, TcConfig(128, 128, 64, 8, 3), TcConfig(128, 128, 64, 8, 3)),
    (1024, TcConfig(128, 128, 64, 8, 3), TcConfig(128, 128, 64, 8, 3)),
    (2048, TcConfig(128, 128, 64, 8, 4), TcConfig(128, 128, 64, 8, 4)),
    (2**31, TcConfig(128, 256, 64, 8, 3), TcConfig(128, 256, 64, 8, 3)),
)
# The interpreter: each interpreted operation costs about the same at any width, so few,
# large programs; one K split (the tests pass configurations that split).
_INTERPRETER_CONFIG = TcConfig(32, 32, 128, 1, 1, split_k=1, group_m=2)

# Rows up to which ``plans.linear_plan`` sends a call past the fused kernels to this one,
# by arch class (``arch_class``): 0 (the route off) until bench/tc_gemm_sweep.py measures
# where it beats dequantize + cuBLAS on that class; a class not listed is off.
TC_MAX_ROWS: dict[str, int] = {"sm80": 0, "sm90": 0, "sm100": 0, "sm120": 0, "rocm": 0, "interpreter": 0}


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


def config_for(M: int, N: int, device: torch.device) -> TcConfig:
    """The configuration table's choice for M rows of x and N outputs on ``device``."""
    if device.type == "cpu":
        return _INTERPRETER_CONFIG
    for most_rows, narrow, wide in _GPU_CONFIGS:
        if M <= most_rows:
            return narrow if N < NARROW_N else wide
    return _GPU_CONFIGS[-1][2] if N >= NARROW_N else _GPU_CONFIGS[-1][1]


def splits_for(tiles: int, steps: int, multiprocessors: int) -> int:
    """K splits so that the ``tiles`` output tiles' programs fill the multiprocessors once
    without starting a second wave (``multiprocessors // tiles``), each split keeping at
    least ``MIN_STEPS_PER_SPLIT`` of the ``steps`` K steps, at most ``MAX_SPLITS``."""
    return max(1, min(multiprocessors // max(tiles, 1), steps // MIN_STEPS_PER_SPLIT, MAX_SPLITS))


def tc_ptx_ok(device: torch.device) -> bool:
    """Whether the kernel may use its inline PTX (the pair lookup's ``ld.global.nc``):
    compiled for an NVIDIA GPU."""
    return device.type == "cuda" and torch.version.hip is None and not interpreter_active()


def tc_gemm_readable(x: torch.Tensor, K: int) -> bool:
    """Whether this kernel takes x [..., K] (any strides): bf16/fp16 and K a positive
    multiple of ``K_MULTIPLE``."""
    return x.dtype in (torch.bfloat16, torch.float16) and K > 0 and K % K_MULTIPLE == 0


@triton.jit
def _pair_values(table_ptr, packed, PTX: tl.constexpr):
    """(code[high nibble], code[low nibble]) of int32 bytes ``packed`` from the 256-entry
    pair table: joined along a new last axis, [..., 2] fp32 in column order."""
    if PTX:
        high, low = tl.inline_asm_elementwise(
            "ld.global.nc.v2.f32 {$0, $1}, [$2];",
            "=f,=f,l",
            [(table_ptr + 2 * packed).to(tl.int64)],
            dtype=(tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
        return tl.join(high, low)
    return tl.load(table_ptr + 2 * packed[:, :, :, None] + tl.arange(0, 2)[None, None, None, :])


@triton.jit
def _code_values(table_ptr, nibbles, PTX: tl.constexpr):
    """fp32 ``code[nibbles]`` from the 16-entry table: compiled for NVIDIA, an inline
    ``ld.global.nc.f32`` (one 64-byte line for a warp's 32 lookups, not staged by the
    pipeliner); otherwise a ``tl.load``."""
    if PTX:
        return tl.inline_asm_elementwise(
            "ld.global.nc.f32 $0, [$1];",
            "=f,l",
            [(table_ptr + nibbles).to(tl.int64)],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
    return tl.load(table_ptr + nibbles)


@triton.jit
def _decode_tile(
    packed,
    scale,
    table_ptr,
    table,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    LOOKUP: tl.constexpr,
    PTX: tl.constexpr,
):
    """fp32 ``code * absmax`` of a [BLOCK_N, groups, bytes] tile of int32 bytes and its
    [BLOCK_N, groups] absmax: [BLOCK_N, BLOCK_K], column 2j the high nibble of byte j."""
    if LOOKUP == 0:
        values = _pair_values(table_ptr, packed, PTX)
    elif LOOKUP == 1:
        values = tl.join(_code_values(table_ptr, packed >> 4, PTX), _code_values(table_ptr, packed & 15, PTX))
    else:
        values = tl.join(lookup(table, packed >> 4), lookup(table, packed & 15))
    return tl.reshape(values * scale[:, :, None, None], (BLOCK_N, BLOCK_K))


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
    table_ptr,
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
    LOOKUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
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
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    HALF: tl.constexpr = GROUP // 2
    steps = K // BLOCK_K
    per_split = tl.cdiv(steps, splits)
    first_step = split * per_split
    last_step = tl.minimum(first_step + per_split, steps)
    k_first = first_step * BLOCK_K
    column = k_first + tl.arange(0, BLOCK_K)
    x_tile = x_ptr + m_read[None, :] * stride_xm + column[:, None] * stride_xk  # [BLOCK_K, BLOCK_M]: x^T
    group = tl.arange(0, GROUPS)
    byte = tl.arange(0, HALF)
    w_bytes = (
        packed_ptr
        + (n_read * (K // 2))[:, None, None]
        + (k_first // 2 + group * HALF)[None, :, None]
        + byte[None, None, :]
    )
    group_flat = (n_read * K)[:, None] + (k_first + group * GROUP)[None, :]  # flat element of each group's first
    table = tl.zeros((16,), dtype=tl.float32)
    if LOOKUP == 2:
        table = tl.load(table_ptr + tl.arange(0, 16))
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for _ in range(first_step, last_step):
        xt = tl.load(x_tile)
        packed = tl.load(w_bytes).to(tl.int32)
        scale = load_block_absmax(
            absmax_ptr,
            group_flat // BLOCKSIZE,
            0,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            False,
        )
        w = _decode_tile(packed, scale, table_ptr, table, BLOCK_N, BLOCK_K, LOOKUP, PTX)
        acc = _multiply(w, xt, acc, EMULATED, X_FP16)
        x_tile += BLOCK_K * stride_xk
        w_bytes += BLOCK_K // 2
        group_flat += BLOCK_K
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


def pair_table(code: torch.Tensor) -> torch.Tensor:
    """float32 [256, 2]: row b holds (code[b >> 4], code[b & 15]), the values of byte b's
    high (even) and low (odd) element: the state's own fp32 code values, unchanged."""
    index = torch.arange(256, device=code.device)
    return torch.stack((code[index >> 4], code[index & 15]), dim=1).contiguous()


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
    config = config or config_for(M, N, device)
    if config.lookup not in LOOKUPS:
        raise ValueError(f"kernels.tc_gemm_4bit: lookup must be one of {LOOKUPS}, got {config.lookup!r}")
    block_k = min(config.block_k, K & -K)  # the largest power of two <= block_k that divides K
    steps = K // block_k
    tiles = math.ceil(M / config.block_m) * math.ceil(N / config.block_n)
    splits = config.split_k or splits_for(tiles, steps, multiprocessors)
    per_split = math.ceil(steps / max(1, min(splits, steps)))
    splits = math.ceil(steps / per_split)  # every split keeps at least one step
    lookup_index = LOOKUPS.index(config.lookup)
    table = pair_table(code) if lookup_index == 0 else code
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
            PTX=tc_ptx_ok(device),
            LOOKUP=lookup_index,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=block_k,
            GROUP=min(block_k, blocksize),
            GROUP_M=config.group_m,
            SPLIT_SUMS=splits > 1,
            num_warps=config.num_warps,
            num_stages=config.num_stages,
            enable_fp_fusion=False,  # keep nested_code * scale + offset two roundings, like dequantize_4bit
        ),
    )
    fixed, nested = (packed, absmax, table), (nested_absmax, nested_code)
    fixed_pointers, nested_pointers = pointers(fixed), pointers(nested)  # for the bound launch
    tickets: dict[int, torch.Tensor] = {}  # per stream: one int32 per tile, zero between launches
    stream_of: Callable[[int], int] | None = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    device_index = device.index if device.index is not None else 0
    tail = (offset, M, N, K, stride_xm, stride_xk)

    def run(x2: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        bound = launch.bound
        p, a, t = fixed_pointers if bound else fixed
        nested_arguments = nested_pointers if bound else nested
        out_arg = out.view(torch.int16) if bf16_bits else out
        if splits == 1:
            work: Any = out_arg
            ticket: Any = a
        else:
            work = torch.empty((splits, M, N), dtype=torch.float32, device=device)
            stream = stream_of(device_index) if device.type == "cuda" and stream_of is not None else 0
            ticket = tickets.get(stream)
            if ticket is None:
                ticket = tickets[stream] = torch.zeros(tiles, dtype=torch.int32, device=device)
        launch(x2, p, a, t, bias if bias is not None else a, out_arg, work, ticket, *nested_arguments, *tail)

    def native(x: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple[int, ...]) -> Any:
        if bf16_bits:
            return None
        p, a, t = fixed_pointers
        args = (None, p, a, t, a, None, None, None if splits > 1 else a, *nested_pointers, *tail)
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
    from qconform_triton_nf4.kernels.nf4_gemv import _multiprocessors, check_linear_call, empty_linear_plan

    where = "kernels.tc_gemm_4bit"
    N, K = check_linear_call(
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
    empty = empty_linear_plan(x, N, K)
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
        multiprocessors=_multiprocessors(x.device) if x.device.type != "cpu" else 1,
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
