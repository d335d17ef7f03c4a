"""Fused 4-bit matmul on Hopper, warp-specialized (Gluon): ``y = x W^T + b`` from 33 rows to prefill.

Why: ``nf4_tc_gemm`` (Triton) decodes a weight tile in registers, but Triton hands it to
``wgmma`` through shared memory (a ``convert_layout``, barriers every K step) and its warps
both load and decode, so with one program of four warps a multiprocessor the decode's
latency is exposed: on an H200 at 8192^2 it took 56 us at 64 rows and 84 at 128, against
39-40 for the unquantized bf16 layer (bench/notes.md v21, v22). Here (v22), written in
Gluon, which states layouts and warps explicitly:

- a producer warp brings each K step's x tile and the weight's packed bytes into a ring of
  ``stages`` shared-memory slots with TMA (ready/empty mbarriers), ahead of the decode;
- one consumer warpgroup reads a slot's bytes as int32 words in a layout chosen so that
  decoding them gives ``wgmma``'s register A operand directly (``word_layout``: the
  ``convert_layout`` to the dot operand is checked trivial at compile time), multiplies
  them with the x tile in shared memory, and frees the slot once that ``wgmma`` is done.

No dequantized weight is written anywhere, not even to shared memory.

Arithmetic, the same as ``nf4_tc_gemm``'s and so as dequantize-then-GEMM's: each weight is
fp32 ``code[nibble] * absmax`` (a double-quantized absmax decoded as ``nested_code[c] *
nested_absmax + offset``, two fp32 roundings: built with fp-fusion off), rounded once to
nearest even to x's dtype, bit for bit what ``dequantize_4bit`` writes; the tensor cores
multiply exactly and accumulate in fp32; the sums of a K split are added in fp32 in split
order by the last program of a tile (a ticket per tile, zero between launches), then the
bias, and the result is rounded once to x's dtype.

Layout. A program computes BLOCK_N weight rows by BLOCK_M rows of x as ``W_tile @
x_tile^T`` (the weight is the A operand, 64 rows a warpgroup). A K step of BLOCK_K = min(64,
blocksize) columns lies in one quantization block, so one absmax per weight row. Each
thread's words: lane ``l`` holds byte ``l % 4`` of every word of two weight rows (rows
``l / 4`` and ``l / 4 + 8`` of its warp's 16), which is where ``wgmma`` wants that byte's
two values (k = 8 w + 2 (l % 4) + {0, 1}). Codes are looked up with one warp shuffle a value
(lane ``l`` holds ``code[l % 16]``; the shuffle reads its index's low five bits, so the
nibble needs no mask).

Where it runs: sm_90 only (``wgmma`` and TMA as Hopper has them), x bf16/fp16 with
contiguous rows, 16-byte aligned data and K a multiple of BLOCK_K (``ws_gemm_readable``).
Not in Triton's interpreter (Gluon has none), so the CPU tests compile it and the GPU
tests run it; ``plans.linear_plan`` routes to it up to ``WS_MAX_ROWS`` of the arch class.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

import qconform_triton_nf4.kernels.nf4_gemv as nf4_gemv
from qconform_triton_nf4.kernels.launch import BoundLaunch, pointers
from qconform_triton_nf4.kernels.nf4_dequant import nested_args
from qconform_triton_nf4.kernels.nf4_tc_gemm import arch_class, split_count
from qconform_triton_nf4.kernels.split_sums import SplitSums

# Triton 3.6 names the TMA load async_copy_global_to_shared; 3.9 renamed it async_load.
_tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared
# and renamed the CTA barrier from thread_barrier to barrier.
_cta_barrier = getattr(gl, "barrier", None) or gl.thread_barrier

_ALIGNMENT = 16  # TMA: base address and row strides in bytes


# A program's registers are allocated by warpgroup: the consumers', and the producer warp's
# (its own warpgroup), each at the launch's ``maxnreg``; a multiprocessor holds 64 Ki.
PRODUCER_WARPS_ALLOCATED = 4
REGISTERS_PER_SM = 65536


@dataclass(frozen=True)
class WsConfig:
    """A launch configuration: tiles of ``block_m`` rows of x by 64 weight rows a consumer
    warpgroup (``warpgroups`` of them share each x tile), ``stages`` ring slots,
    ``max_registers`` a thread (the launch's ``maxnreg``: the consumers' budget, and so how
    many programs share a multiprocessor, ``programs_per_sm``, from which the plan chooses
    the K splits) and ``split_k`` (0: chosen by the plan, ``splits_for``)."""

    block_m: int
    stages: int
    max_registers: int
    split_k: int = 0
    group_m: int = 8
    warpgroups: int = 1

    @property
    def block_n(self) -> int:
        """Weight rows a program: 64 a consumer warpgroup (``wgmma``'s M)."""
        return 64 * self.warpgroups

    @property
    def num_warps(self) -> int:
        """The consumers' warps (the launch's ``num_warps``; the producer warp is added)."""
        return 4 * self.warpgroups

    @property
    def programs_per_sm(self) -> int:
        """Programs a multiprocessor holds at ``max_registers`` (one warpgroup: 96: 2, 128: 2,
        168: 1, 72: 3; two: 128: 1, 168: 1)."""
        return REGISTERS_PER_SM // ((self.num_warps + PRODUCER_WARPS_ALLOCATED) * 32 * self.max_registers)

    def label(self) -> str:
        groups = f"g{self.warpgroups}" if self.warpgroups != 1 else ""
        return f"m{self.block_m}{groups}s{self.stages}r{self.max_registers}p{self.programs_per_sm}x{self.split_k}"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


WS_ARCH = "sm90"  # wgmma and TMA as this kernel uses them (Blackwell has tcgen05 instead): an arch class

# By rows of x: (most rows, config), the first entry whose most rows >= M. Measured on an
# H200 through the backend's plans (bench/tc_gemm_sweep.py --kernel ws: bf16, NF4 blocksize
# 64, device us, 4096^2, 8192^2, 14336 x 4096, 4096 x 14336; bench/notes.md v22): each row
# class's configuration whose worst ratio to the best of each shape was smallest (24 and 32
# rows 1.08, 64 rows 1.03, 128 rows 1.25; 256 rows: the 512-row class's, 1.0-1.3 at the
# three large shapes).
_GPU_CONFIGS: tuple[tuple[int, WsConfig], ...] = (
    (32, WsConfig(32, 6, 96)),
    (64, WsConfig(64, 4, 96)),
    (128, WsConfig(128, 6, 128)),
    (2**31, WsConfig(256, 4, 168)),
)

# The rows ``plans.linear_plan`` sends here, by arch class: from WS_MIN_ROWS (before the
# fused kernels' last rows) to WS_MAX_ROWS, and to WS_MAX_ROWS_LARGE_WEIGHT for a weight of
# at least LARGE_WEIGHT elements. On an H200 (bench/notes.md v22) this kernel beat the route
# before it (the fused kernels to 32 rows, ``nf4_tc_gemm`` to 64, dequantize + cuBLAS past)
# at every swept shape from 24 to 128 rows (0.51-0.83 times its time; at 24 to 64 rows
# 0.88-0.98 times dense bf16's at the three large shapes); at 16 rows at two of four; at
# 256 rows at the three shapes of 32 Mi weights and more (0.67-0.79 times) but not at
# 4096^2 (1.01-1.18 times); at 512 rows at three of four (14336 x 4096 2.5 % slower).
# Only sm_90 has it.
WS_MIN_ROWS: dict[str, int] = {WS_ARCH: 17}
WS_MAX_ROWS: dict[str, int] = {WS_ARCH: 128}
WS_MAX_ROWS_LARGE_WEIGHT: dict[str, int] = {WS_ARCH: 256}
LARGE_WEIGHT = 2**25


def runs_on(device: torch.device) -> bool:
    """Whether the kernel runs on ``device``: an sm_90 GPU (the compile check answers for
    the arch it compiles for)."""
    return device.type == "cuda" and arch_class(device) == WS_ARCH


def ws_min_rows(device: torch.device) -> int:
    """The fewest rows ``plans.linear_plan`` routes to this kernel on ``device`` (where
    ``ws_max_rows`` is not 0): fewer go to the fused kernels."""
    return WS_MIN_ROWS.get(arch_class(device), 0)


def ws_max_rows(device: torch.device, weight_elements: int = 0) -> int:
    """The most rows ``plans.linear_plan`` routes to this kernel on ``device`` (0: none) for
    a weight of ``weight_elements`` (N K; 0: any weight)."""
    arch = arch_class(device)
    rows = WS_MAX_ROWS.get(arch, 0)
    if weight_elements >= LARGE_WEIGHT:
        rows = max(rows, WS_MAX_ROWS_LARGE_WEIGHT.get(arch, 0))
    return rows


def config_for(M: int) -> WsConfig:
    for most_rows, config in _GPU_CONFIGS:
        if M <= most_rows:
            return config
    return _GPU_CONFIGS[-1][1]


def block_k(blocksize: int) -> int:
    """Columns a K step: 64, or the blocksize where smaller (a step lies in one block)."""
    return min(64, blocksize)


def ws_gemm_readable(x: torch.Tensor, packed: torch.Tensor, K: int, blocksize: int) -> bool:
    """Whether this kernel takes x [..., K] and the packed bytes as they are: contiguous
    bf16/fp16 x, both 16-byte aligned, K a multiple of the K step (TMA reads them in place)."""
    return (
        x.dtype in (torch.bfloat16, torch.float16)
        and K > 0
        and K % block_k(blocksize) == 0
        and x.is_contiguous()
        and x.data_ptr() % _ALIGNMENT == 0
        and packed.data_ptr() % _ALIGNMENT == 0
    )


@gluon.constexpr_function
def word_layout(block_n, words, num_warps):
    """[BLOCK_N, words, 4, 2] (weight row, int32 word of 8 values, byte of the word, nibble)
    laid out so that its reshape to [BLOCK_N, 8 words] is ``wgmma``'s register A operand
    (k_width 2): registers hold the nibble, the words and row + 8 (then further rows),
    lanes the byte then rows 0-7, warps rows 16, 32 (the 16 rows of ``m16n8k16``)."""
    registers = [[0, 0, 0, 1]]
    w = 1
    while w < words:
        registers.append([0, w, 0, 0])
        w *= 2
    registers.append([8, 0, 0, 0])
    lanes = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warps, row = [], 16
    for _ in range(num_warps.bit_length() - 1):
        warps.append([row, 0, 0, 0])
        row *= 2
    while row < block_n:
        registers.append([row, 0, 0, 0])
        row *= 2
    return gl.DistributedLinearLayout(registers, lanes, warps, [], [block_n, words, 4, 2])


@gluon.jit
def _lane_code(code_ptr, like):
    """``code[lane % 16]`` as int32 bits in every element of a tensor shaped ``like``."""
    address = gl.full(like.shape, 0, gl.int64, like.type.layout) + code_ptr.to(gl.int64, bitcast=True)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 15; mul.wide.u32 a, l, 4; "
        "add.s64 a, a, $1; ld.global.nc.b32 $0, [a]; }",
        "=r,l",
        [address],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    )


@gluon.jit
def _code_values(lane_code, index):
    """fp32 ``code[index % 16]``: a shuffle from the lane that holds it."""
    return gl.inline_asm_elementwise(
        "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
        "=r,r,r",
        [lane_code, index],
        dtype=gl.int32,
        is_pure=True,
        pack=1,
    ).to(gl.float32, bitcast=True)


@gluon.jit
def _absmax(
    absmax_ptr,
    block,
    nested_absmax_ptr,
    nested_code_ptr,
    offset,
    NESTED_BLOCKSIZE: gl.constexpr,
    DOUBLE_QUANT: gl.constexpr,
):
    """fp32 absmax of the quantization blocks ``block`` (double quantization decoded)."""
    if DOUBLE_QUANT:
        codes = gl.load(absmax_ptr + block).to(gl.int32)
        nested_scale = gl.load(nested_absmax_ptr + block // NESTED_BLOCKSIZE)
        return gl.load(nested_code_ptr + codes) * nested_scale + offset
    else:
        return gl.load(absmax_ptr + block)


@gluon.jit
def _producer(
    x_desc,
    w_desc,
    x_slots,
    w_slots,
    ready,
    empty,
    off_m,
    off_n,
    first_step,
    count,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One warp: each K step's x tile and weight words into the next free slot by TMA."""
    WORDS: gl.constexpr = BLOCK_K // 8
    for i in range(count):
        slot = i % STAGES
        mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1)  # a fresh barrier counts as freed
        mbarrier.expect(ready.index(slot), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        step = first_step + i
        _tma_load(x_desc, [off_m, step * BLOCK_K], ready.index(slot), x_slots.index(slot))
        _tma_load(w_desc, [off_n, step * WORDS], ready.index(slot), w_slots.index(slot))


@gluon.jit
def _consumer(
    x_slots,
    w_slots,
    ready,
    empty,
    absmax_ptr,
    code_ptr,
    nested_absmax_ptr,
    nested_code_ptr,
    offset,
    row_flat,
    count,
    block_shift,
    NESTED_BLOCKSIZE: gl.constexpr,
    DOUBLE_QUANT: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    num_warps: gl.constexpr,
):
    """The warpgroup: decode each slot's words into the A operand and multiply; returns the
    fp32 sums [BLOCK_N, BLOCK_M] in the wgmma layout."""
    WORDS: gl.constexpr = BLOCK_K // 8
    L4: gl.constexpr = word_layout(BLOCK_N, WORDS, num_warps)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    byte = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    nibble = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    # the value's shift in its word: byte b's high nibble is the even element (bits 8b+4..8b+7)
    shift = (byte * 8)[None, None, :, None] + (4 - 4 * nibble)[None, None, None, :]
    lane_code = _lane_code(code_ptr, gl.full([BLOCK_N, WORDS, 4, 2], 0, gl.int32, L4))
    acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
    # absmax two steps ahead (a load of the global table per weight row and step)
    scale = _absmax(
        absmax_ptr, row_flat >> block_shift, nested_absmax_ptr, nested_code_ptr, offset, NESTED_BLOCKSIZE, DOUBLE_QUANT
    )
    scale_next = _absmax(
        absmax_ptr,
        (row_flat + gl.minimum(1, count - 1) * BLOCK_K) >> block_shift,
        nested_absmax_ptr,
        nested_code_ptr,
        offset,
        NESTED_BLOCKSIZE,
        DOUBLE_QUANT,
    )
    for i in range(count):
        slot = i % STAGES
        scale_after = _absmax(
            absmax_ptr,
            (row_flat + gl.minimum(i + 2, count - 1) * BLOCK_K) >> block_shift,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
        )
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        words = w_slots.index(slot).load(L2)
        values = _code_values(lane_code, words[:, :, None, None] >> shift) * scale[:, None, None, None]
        w = gl.reshape(values.to(x_slots.dtype), [BLOCK_N, BLOCK_K])
        a = gl.convert_layout(w, a_layout, assert_trivial=True)
        acc = warpgroup_mma(a, x_slots.index(slot).permute((1, 0)), acc, is_async=True)
        acc, a = warpgroup_mma_wait(1, deps=(acc, a))
        # the previous step's wgmma is done (one left in flight): its slot is free
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        scale = scale_next
        scale_next = scale_after
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return (acc,)


# One variant for every row count, width and blocksize: M and N only bound masks here, and the
# blocksize (a power of two) only shifts an element's index to its block's; specialized, they
# made 128 variants of the default run's 221 calls, compiled in the tests' time (now 40).
@gluon.jit(do_not_specialize=["M", "N", "block_shift"])
def _gemm_4bit_ws_kernel(
    x_desc,
    w_desc,
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
    block_shift,
    NESTED_BLOCKSIZE: gl.constexpr,
    DOUBLE_QUANT: gl.constexpr,
    HAS_BIAS: gl.constexpr,
    BLOCK_M: gl.constexpr,
    BLOCK_N: gl.constexpr,
    BLOCK_K: gl.constexpr,
    STAGES: gl.constexpr,
    GROUP_M: gl.constexpr,
    SPLIT_SUMS: gl.constexpr,
    num_warps: gl.constexpr,
):
    """Output tile ``program_id(0)`` (GROUP_M tiles of x rows per weight tile), K steps of
    split ``program_id(1)``; one split: bias and rounding here; several: fp32 sums into
    ``work_ptr`` and the last program of the tile to draw a ticket adds them in split order."""
    pid = gl.program_id(0)
    split = gl.program_id(1)
    splits = gl.num_programs(1)
    tiles_m = gl.cdiv(M, BLOCK_M)
    tiles_n = gl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    steps = K // BLOCK_K
    per_split = gl.cdiv(steps, splits)
    first_step = split * per_split
    count = gl.minimum(first_step + per_split, steps) - first_step

    x_slots = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_slots = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    WORDS: gl.constexpr = BLOCK_K // 8
    L2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, word_layout(BLOCK_N, WORDS, num_warps)))
    rows = gl.minimum(pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, L2)), N - 1).to(gl.int64)
    row_flat = rows * K + first_step * BLOCK_K  # each row's first element of this split
    (acc,) = gl.warp_specialize(
        [
            (
                _consumer,
                (
                    x_slots,
                    w_slots,
                    ready,
                    empty,
                    absmax_ptr,
                    code_ptr,
                    nested_absmax_ptr,
                    nested_code_ptr,
                    offset,
                    row_flat,
                    count,
                    block_shift,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                    BLOCK_M,
                    BLOCK_N,
                    BLOCK_K,
                    STAGES,
                    num_warps,
                ),
            ),
            (
                _producer,
                (
                    x_desc,
                    w_desc,
                    x_slots,
                    w_slots,
                    ready,
                    empty,
                    pid_m * BLOCK_M,
                    pid_n * BLOCK_N,
                    first_step,
                    count,
                    BLOCK_K,
                    STAGES,
                ),
            ),
        ],
        [1],
        [40],
    )

    mma: gl.constexpr = gl.NVMMADistributedLayout(
        version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_M, 16]
    )
    n = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, mma))
    m = pid_m * BLOCK_M + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, mma))
    at = m[None, :].to(gl.int64) * N + n[:, None]  # [BLOCK_N, BLOCK_M] in out [M, N]
    ok = (m < M)[None, :] & (n < N)[:, None]
    n_read = gl.minimum(n, N - 1)
    if SPLIT_SUMS:
        gl.store(work_ptr + split.to(gl.int64) * M * N + at, acc, mask=ok)
        # every thread's sums stored before one thread takes the tile's ticket (release, GPU
        # scope); the program that draws the last one reads the others' after its acquire
        _cta_barrier()
        ticket = gl.atomic_add(ticket_ptr + pid, 1, sem="acq_rel")
        if ticket == splits - 1:
            y = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, mma)
            partial = work_ptr + at
            slab = M.to(gl.int64) * N
            for _ in range(0, splits):
                y += gl.load(partial, mask=ok, other=0.0, cache_modifier=".cg")
                partial += slab
            if HAS_BIAS:
                y += gl.load(bias_ptr + n_read).to(gl.float32)[:, None]
            gl.store(out_ptr + at, y.to(out_ptr.dtype.element_ty), mask=ok)
            gl.store(ticket_ptr + pid, 0)  # zero again for the next launch on this stream
    else:
        if HAS_BIAS:
            acc += gl.load(bias_ptr + n_read).to(gl.float32)[:, None]
        gl.store(out_ptr + at, acc.to(out_ptr.dtype.element_ty), mask=ok)


def _x_layout(config: WsConfig, dtype: torch.dtype, blocksize: int) -> Any:
    element = gl.bfloat16 if dtype == torch.bfloat16 else gl.float16
    return gl.NVMMASharedLayout.get_default_for([config.block_m, block_k(blocksize)], element)


_WORDS_LAYOUT = gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2)


def plan_gemm_4bit_ws(
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
    config: WsConfig | None = None,
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]:
    """The launch for [M, K] x like ``x2``, decided and bound once (``BoundLaunch``: after
    the first call, Triton's C launch called directly): ``plan(x2, out, bias)`` writes
    ``out`` [M, N]. The weight's descriptor is made, and encoded at the first call, once;
    x's on every call (TMA reads x where it is, or its copy in whole x tiles)."""
    M, K = x2.shape
    config = config or config_for(M)
    step = block_k(blocksize)
    steps = K // step
    tiles = math.ceil(M / config.block_m) * math.ceil(N / config.block_n)
    splits = split_count(config.split_k, tiles, steps, multiprocessors, config.programs_per_sm)
    words = packed.view(torch.int32).view(N, K // 8)
    w_desc = TensorDescriptor.from_tensor(words, [config.block_n, step // 8], _WORDS_LAYOUT)
    x_layout = _x_layout(config, x2.dtype, blocksize)
    split_sums = SplitSums(splits, tiles, M, N, x2.device)
    launch = BoundLaunch(
        _gemm_4bit_ws_kernel,
        (tiles, splits),
        dict(
            NESTED_BLOCKSIZE=nested_blocksize,
            DOUBLE_QUANT=double_quant,
            HAS_BIAS=has_bias,
            BLOCK_M=config.block_m,
            BLOCK_N=config.block_n,
            BLOCK_K=step,
            STAGES=config.stages,
            GROUP_M=config.group_m,
            SPLIT_SUMS=splits > 1,
            num_warps=config.num_warps,
            maxnreg=config.max_registers,
            enable_fp_fusion=False,  # keep nested_code * scale + offset two roundings, like dequantize_4bit
        ),
    )
    fixed, nested = (absmax, code), (nested_absmax, nested_code)
    fixed_pointers, nested_pointers = pointers(fixed), pointers(nested)  # for the bound launch
    tail = (offset, M, N, K, blocksize.bit_length() - 1)  # blocksizes are powers of two

    # TMA reads a box of x rows that crosses the end of x slowly: on an H200 at 8192^2, 192
    # rows in one x tile of 256 took 98.8 us, the same rows in 256 rows of memory 61.4 (320
    # rows: 242 against 117; bench/notes.md "Partial x tiles"). So where M is not a whole
    # number of tiles, x is staged into a buffer of whole tiles first (one copy, M K elements).
    # The staged buffer's rows past M are left as they are: each output column is one x row's,
    # and the rows past M are never stored (the kernel masks them), so they reach no result.
    staged_rows = math.ceil(M / config.block_m) * config.block_m

    def run(x2: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        if staged_rows != M:
            staged = x2.new_empty((staged_rows, K))
            staged[:M].copy_(x2)
            x2 = staged
        x_desc = TensorDescriptor(x2, [staged_rows, K], [K, 1], [config.block_m, step], x_layout)
        bound = launch.bound
        a, c = fixed_pointers if bound else fixed
        work, ticket = split_sums.buffers(out, a)
        launch(x_desc, w_desc, a, c, bias if bias is not None else a, out, work, ticket,
               *(nested_pointers if bound else nested), *tail)  # fmt: skip

    run.splits = splits  # type: ignore[attr-defined]
    run.config = config  # type: ignore[attr-defined]
    return run


def ws_gemm_4bit_plan(
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
    config: WsConfig | None = None,
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``ws_gemm_4bit``'s arguments validated and its launch decided: ``plan(x, bias)`` for
    every x and bias laid out as these (dtype, shape, strides, 16-byte alignment, device)."""
    where = "kernels.ws_gemm_4bit"
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
    if not runs_on(x.device):
        raise ValueError(f"{where}: runs on sm_90 GPUs only (wgmma, TMA), not on {x.device} ({arch_class(x.device)})")
    packed_flat = packed.reshape(-1)
    if not ws_gemm_readable(x, packed_flat, K, blocksize):
        raise ValueError(
            f"{where}: takes bf16/fp16 x with contiguous rows, x and the packed bytes 16-byte aligned and K a "
            f"multiple of {block_k(blocksize)}; got {x.dtype} x of strides {tuple(x.stride())}, K={K}: use tc_gemm_4bit"
        )
    x2 = x.reshape(-1, K)
    absmax_flat = absmax.reshape(-1).contiguous()
    nested_absmax_arg, nested_code_arg, offset_value, double_quant = nested_args(
        absmax_flat, nested_absmax, nested_code, offset
    )
    run = plan_gemm_4bit_ws(
        x2,
        packed_flat,
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
        multiprocessors=nf4_gemv._multiprocessors(x.device),
        config=config,
    )
    out_shape = (*x.shape[:-1], N)
    bias_flat = bias is not None and bias.dim() == 1 and bias.stride(0) == 1

    def planned(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x.new_empty(out_shape)
        if bias is not None and not bias_flat:
            bias = bias.reshape(-1).contiguous()
        run(x.reshape(-1, K), out, bias)
        return out

    planned.splits = run.splits  # type: ignore[attr-defined]
    planned.config = run.config  # type: ignore[attr-defined]
    return planned


def ws_gemm_4bit(
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
    config: WsConfig | None = None,
) -> torch.Tensor:
    """``x @ W.T + bias`` with W (N, K) read from bitsandbytes-packed 4-bit bytes on an sm_90
    GPU (module docstring): x [..., K] bf16/fp16 (``ws_gemm_readable``). Returns [..., N] in
    x's dtype, with dequantize-then-GEMM's arithmetic. ``ws_gemm_4bit_plan(...)(x, bias)``."""
    return ws_gemm_4bit_plan(
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
