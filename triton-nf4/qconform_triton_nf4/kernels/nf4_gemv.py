"""Fused 4-bit dequantize + matmul for small batches: ``y = x W^T + b``, W never materialized.

W is (N, K), stored as bitsandbytes packs it (see ``nf4_dequant``): flat element
``n * K + k``, byte ``(n * K + k) // 2`` (even flat index in the HIGH nibble), block
``(n * K + k) // blocksize``. Blocks run over the flattened weight, so when K is not a
multiple of blocksize a block straddles two rows, and when K is odd a row starts in the
middle of a byte: the kernel derives everything from the flat index, never from (n, k).

Each weight value is fp32 ``code[nibble] * absmax`` (the value ``dequantize_4bit`` rounds);
products with x are accumulated in fp32 and rounded once to x's dtype. Compiled on GPU,
the compiler may contract ``x * w + acc`` (and the double-quant ``* + offset``) into FMAs:
that is one rounding fewer, not a different formula.

From ``MMA_MIN_ROWS`` rows on (at most 32), where it can read x and W, the tensor-core
kernel (``nf4_mma``) decodes each weight once for all rows. Otherwise each row of x is
served on its own; the programs for the other rows of x run next to it and find the packed
bytes in L2. When K is a multiple of the blocksize (rows start on a block), these kernels
read int32 words of 8 nibbles and multiply absmax once per word's partial sum: the rows
kernel (bf16/fp16 x, K a multiple of 256; a persistent grid over groups of 4 weight rows)
or else the word kernel (BLOCK_N features per program). Otherwise the elementwise kernel
decodes every weight from its flat index. Kernel versions and their timings:
bench/notes.md.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl

import qconform_triton_nf4.kernels.nf4_mma as nf4_mma
from qconform_triton_nf4.kernels.launch import BoundLaunch, pointers
from qconform_triton_nf4.kernels.nf4_dequant import (
    check_launchable,
    check_packed_state,
    interpreter_active,
    load_block_absmax,
    lookup,
    nested_args,
    store_as,
)

MAX_ROWS = nf4_mma.MAX_ROWS
# From this many rows of x on, the tensor-core kernel (nf4_mma: each weight decoded once
# for every row) serves the batch where it can read x and W and the device runs its PTX;
# fewer rows, and batches it cannot take, go to the per-row kernels below. H100, bf16
# (bench/notes.md v11), per-row vs tensor-core kernel: 8192^2 2 rows 36.0 vs 53.6 us,
# 3 rows 50.6 vs 54.8, 4 rows 65.6 vs 55.9; 14336 x 4096 3 rows 49.0 vs 46.0; 4096^2
# 4 rows 20.5 vs 20.9. Since v13 (the K-split fix) it is faster from 2 rows at two of the
# three benchmark shapes (v15, matmul_routes.py: 2 rows 34.2 vs 35.8 us at 8192^2, 27.7
# vs 35.2 at 14336 x 4096, but 15.4 vs 13.4 at 4096^2; 3 rows faster at all three).
MMA_MIN_ROWS = 2
# In Triton's interpreter (the CPU tests) the tensor-core kernel takes 4-16 rows, its range
# before v15: its emulation costs about ten times the per-row kernels' there (a layer test
# of 9.3 s against 0.75 s), and the suites' layer and sequence checks pass 2-3 and 17-32
# rows often. Three and four groups of x still run in the interpreter in tests/test_kernels.py.
INTERPRETED_MMA_ROWS = (4, 16)
# The per-row kernels beat dequantize + GEMM up to this many rows (their time grows with
# the rows; notes "Few rows"), the tensor-core kernel up to MAX_ROWS.
PER_ROW_MAX_ROWS = 4

# (BLOCK_N, BLOCK_K, num_warps): GPU tiles of the elementwise kernel; the interpreter
# prefers few, large programs. Measured on the H100: bench/notes.md.
_GPU_TILE = (4, 512, 4)
_INTERPRETER_TILE = (64, 1024, 1)
# (BLOCK_N, BLOCK_K, num_warps, PREFETCH) of the word kernel, which serves the rows the
# other kernels do not take whenever K is a multiple of the blocksize (bench/notes.md v6, v6c).
# The interpreter's 128 rows: one program for most of the workloads' layers (64-128 wide),
# half the programs of 64 rows (their triton-nf4 workloads and lifecycles 84 -> 66 s; 256: 68).
_GPU_WORDS_TILE = (16, 512, 4, True)
_INTERPRETER_WORDS_TILE = (128, 1024, 1, False)
# How the word kernel looks code values up on the GPU: "shuffle" (a warp shuffle, needs
# PREFETCH), "gather" (lookup(), shared memory) or "index" (global loads). H100, 8192 x 8192,
# batch 1, x in 2-byte loads: 34.1, 37.7 and 59.1 us (bench/notes.md v6, v6c); shuffle with
# x in 8-byte loads 30.2 us (v7). Off NVIDIA (the interpreter, ROCm: no PTX) "shuffle" runs the gather.
_WORDS_LOOKUP = "shuffle"
# Read x in 8-byte loads where its layout allows: 30.2 vs 34.2 us (bench/notes.md v7).
_X_PACKED = True
# Fewer programs than this leave SMs idle (132 on the H100): halve BLOCK_N down to 4 rows.
_WORDS_MIN_PROGRAMS = 512
# The rows kernel (v8, v8c) serves bf16/fp16 x whenever K is a multiple of 256 and of the
# blocksize: H100, 8192 x 8192, batch 1: 22.4 us vs 30.0 us for the word kernel
# (bench/notes.md v8c). False sends those cases to the word kernel (sweeps, tests).
_ROWS_KERNEL = True
# Words per row and step of the rows kernel with num_warps for each (256 words: four word
# pairs per thread with one warp, two with two): the first that divides K / 8. One-warp
# programs where the work items fill _ROWS_MANY_ITEMS_PER_SM programs per multiprocessor,
# two-warp programs where they do not. H100, batch 1, 8192 x 8192 (2048 items): 256 words
# of one warp 22.3 us, 128 of one 23.0, 256 of two 24.3-24.9; 4096 x 14336 (1024 items):
# 256 of two 21.6, 256 of one 24.5 (bench/notes.md v8c).
_ROWS_WORDS_MANY_ITEMS = ((256, 1), (128, 1), (64, 1), (32, 1))
_ROWS_WORDS = ((256, 2), (128, 1), (64, 1), (32, 1))
_ROWS_MANY_ITEMS_PER_SM = 12
# Persistent grid of the rows kernel: at most this many programs per multiprocessor, spread
# so each walks the same number of items (_balanced_grid). The interpreter runs 3
# programs, so its tests take the path where one program walks several row groups.
_ROWS_PROGRAMS_PER_SM = 16
_INTERPRETER_ROWS_PROGRAMS = 3


@triton.jit
def load_weight_tile(
    packed_ptr,
    absmax_ptr,
    code,
    nested_absmax_ptr,
    nested_code,
    offset,
    n0,
    k0,
    N,
    K,
    BLOCKSIZE: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """fp32 weights ``W[n0 : n0 + BLOCK_N, k0 : k0 + BLOCK_K]`` ([BLOCK_N, BLOCK_K], 0 outside W).

    ALIGNED (K a multiple of BLOCKSIZE, BLOCK_K a multiple of BLOCKSIZE): every row starts
    on a block, so the tile is [rows, blocks, bytes of a block]: one absmax per (row,
    block), int32 offsets from the tile's first row, both nibbles of a byte interleaved.
    Otherwise each element is decoded from its flat index (blocks straddle rows; with K
    odd a row starts mid-byte). MASKED: the tile may reach past N or K. Each code lookup
    is a global load (L1 hits): with a shared-memory gather instead, Triton 3.6 gave
    wrong sums on the H100 for tiles of 512+ columns (bench/notes.md v4).
    """
    if ALIGNED:
        HALF: tl.constexpr = BLOCKSIZE // 2
        BLOCKS: tl.constexpr = BLOCK_K // BLOCKSIZE
        BLOCKS_PER_ROW = K // BLOCKSIZE
        row = tl.arange(0, BLOCK_N)  # [BN], from n0
        block_in_row = k0 // BLOCKSIZE + tl.arange(0, BLOCKS)  # [NB]
        block = row[:, None] * BLOCKS_PER_ROW + block_in_row[None, :]  # [BN, NB], from row n0
        byte = block[:, :, None] * HALF + tl.arange(0, HALF)[None, None, :]  # [BN, NB, H]
        first_block = n0.to(tl.int64) * BLOCKS_PER_ROW
        block_ok = ((n0 + row) < N)[:, None] & (block_in_row < BLOCKS_PER_ROW)[None, :]
        if DOUBLE_QUANT:  # nested groups count blocks from the start of absmax: index from there
            absmax = load_block_absmax(
                absmax_ptr,
                first_block + block,
                block_ok,
                nested_absmax_ptr,
                nested_code,
                offset,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
                MASKED,
            )
        else:
            absmax = load_block_absmax(
                absmax_ptr + first_block,
                block,
                block_ok,
                nested_absmax_ptr,
                nested_code,
                offset,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
                MASKED,
            )
        packed_tile = packed_ptr + first_block * HALF + byte
        if MASKED:
            packed = tl.load(packed_tile, mask=block_ok[:, :, None], other=0).to(tl.int32)
        else:
            packed = tl.load(packed_tile).to(tl.int32)
        scale = absmax[:, :, None]
        high = tl.load(code + (packed >> 4)) * scale  # column 2j of the block's bytes
        low = tl.load(code + (packed & 15)) * scale  # column 2j + 1
        w = tl.reshape(tl.join(high, low), (BLOCK_N, BLOCK_K))
    else:
        n = n0.to(tl.int64) + tl.arange(0, BLOCK_N)
        k = k0 + tl.arange(0, BLOCK_K)
        w_mask = (n < N)[:, None] & (k < K)[None, :]
        flat = n[:, None] * K + k[None, :]  # [BN, BK]
        packed = tl.load(packed_ptr + (flat >> 1), mask=w_mask, other=0).to(tl.int32)
        nibble = (packed >> (4 - 4 * (flat & 1).to(tl.int32))) & 15
        absmax = load_block_absmax(
            absmax_ptr,
            flat // BLOCKSIZE,
            w_mask,
            nested_absmax_ptr,
            nested_code,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
        )
        w = tl.load(code + nibble) * absmax
    return w


@triton.jit(do_not_specialize=["M", "N"])  # one variant for every batch and width
def _gemv_4bit_kernel(
    x_ptr,
    packed_ptr,
    absmax_ptr,
    code_ptr,
    bias_ptr,
    out_ptr,
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
    ALIGNED: tl.constexpr,
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """One program per (BLOCK_N features, one row of x); elementwise fp32 accumulator tile,
    reduced once after the K loop. The M programs of a feature block are adjacent, so the
    packed bytes come from DRAM once and from L2 for the other rows."""
    pid = tl.program_id(0)
    m = pid % M
    n0 = (pid // M) * BLOCK_N
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        w = load_weight_tile(
            packed_ptr,
            absmax_ptr,
            code_ptr,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            n0,
            k0,
            N,
            K,
            BLOCKSIZE,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            ALIGNED,
            MASKED,
            BLOCK_N,
            BLOCK_K,
        )
        k = k0 + tl.arange(0, BLOCK_K)
        if MASKED:
            x = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_row + k * stride_xk).to(tl.float32)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)  # [BN]
    n = n0 + tl.arange(0, BLOCK_N)
    n_ok = n < N
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    store_as(out_ptr + m.to(tl.int64) * N + n, y, n_ok, BF16_BITS)


@triton.jit
def x_value(quad, index: tl.constexpr, dtype: tl.constexpr):
    """fp32 value of the 16-bit float at position ``index`` (0-3, little-endian) of int64 ``quad``."""
    bits = ((quad >> (16 * index)) & 0xFFFF).to(tl.uint16)
    return bits.to(dtype, bitcast=True).to(tl.float32)


@triton.jit
def lane_code_table(like, code_ptr):
    """code[lane % 16] as int32 bits in every lane, for ``shuffle_code``, in ``like``'s layout.

    The lane id is not elementwise: computed from another tensor, Triton 3.6 gave it that
    tensor's layout and converted it, moving values to other lanes (bench/notes.md v6c).
    Computed from a tensor the loop uses (the loaded words), it has the loop's layout.
    """
    lane = tl.inline_asm_elementwise(
        "mov.u32 $0, %laneid;", "=r,r", [like.to(tl.int32)], dtype=tl.int32, is_pure=True, pack=1
    )
    return tl.load(code_ptr + (lane & 15)).to(tl.int32, bitcast=True)


@triton.jit
def shuffle_code(lane_code, nibble):
    """fp32 code value of ``nibble`` by a warp shuffle from the lane holding it in
    ``lane_code`` (``lane_code_table``). shfl.idx reads only bits 0-4 of its lane operand,
    and lanes n and n + 16 hold the same value, so a nibble with other bits above it
    (``word >> shift``) needs no mask."""
    return tl.inline_asm_elementwise(
        "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
        "=r,r,r",
        [lane_code, nibble.to(tl.int32, bitcast=True)],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.float32, bitcast=True)


@triton.jit(do_not_specialize=["M", "N"])  # one variant for every batch and width
def _gemv_4bit_words_kernel(
    x_ptr,
    words_ptr,
    absmax_ptr,
    code_ptr,
    bias_ptr,
    out_ptr,
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
    MASKED: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP: tl.constexpr,
    PREFETCH: tl.constexpr,
    GATHER: tl.constexpr,
    SHUFFLE: tl.constexpr,
    X_PACKED: tl.constexpr,
    EMULATED: tl.constexpr,
):
    """The gemv for K a multiple of BLOCKSIZE and of BLOCK_K: the weight read as int32
    words of 8 nibbles, one program per (BLOCK_N features, one row of x).

    The tile is [BLOCK_N, groups, GROUP] words, GROUP words (``min(BLOCKSIZE, BLOCK_K) // 8``)
    sharing one absmax, which is loaded once per (row, group). Per word, the 8 products
    ``code[nibble] * x`` go into an fp32 partial sum that absmax multiplies once
    (``absmax * sum(code * x)``: the exact value of ``sum((code * absmax) * x)``). The
    nibble of column ``8 w + j`` is taken with a constant shift (even flat index in the high
    nibble of its byte, bytes little-endian in the word): no interleave, no layout shuffle.
    GATHER: the 16 code values are held in registers and looked up with ``lookup`` (shared
    memory); otherwise every lookup is a global load (L1 hits), which measured 1.6x slower
    on the H100 (bench/notes.md v6). SHUFFLE (compiled, with PREFETCH): a warp shuffle
    from the lane that holds ``code[nibble]``, no shared memory and no barriers (v6c, the
    default on GPUs). PREFETCH loads the next step's words before decoding the current
    ones, so a warp has DRAM loads in flight while it decodes. MASKED: BLOCK_N does not
    divide N. X_PACKED (bf16/fp16 x, contiguous rows on 8-byte boundaries): a word's 8
    values of x come in two 8-byte loads instead of eight 2-byte ones (v7). EMULATED (Triton's
    interpreter, where every operation costs about the same at any width): a step's 8 nibbles
    per word are taken, looked up and multiplied at once (``_emulated_word_sums``) instead of
    in 8 steps; the loads, groups, absmax and stores are the compiled kernel's.
    """
    pid = tl.program_id(0)
    m = pid % M
    n0 = (pid // M) * BLOCK_N
    GROUPS: tl.constexpr = BLOCK_K // (8 * GROUP)
    WORDS_PER_BLOCK: tl.constexpr = BLOCKSIZE // 8
    words_per_row = K // 8
    blocks_per_row = K // BLOCKSIZE
    rows = tl.arange(0, BLOCK_N)
    row_ok = (n0 + rows) < N
    group_word = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]  # [G, GW], from w0
    word_rel = rows[:, None, None] * words_per_row + group_word[None, :, :]  # int32, from the tile's first word
    block_row = rows[:, None] * blocks_per_row  # int32, from the tile's first block
    first_word = words_ptr + n0.to(tl.int64) * words_per_row
    first_block = n0.to(tl.int64) * blocks_per_row
    if not DOUBLE_QUANT:
        absmax_ptr = absmax_ptr + first_block
    if GATHER:
        code_values = tl.load(code_ptr + tl.arange(0, 16))
    x_row = x_ptr + m.to(tl.int64) * stride_xm
    word_ok = row_ok[:, None, None]
    acc = tl.zeros((BLOCK_N, GROUPS, GROUP), dtype=tl.float32)
    if PREFETCH:
        if MASKED:
            words = tl.load(first_word + word_rel, mask=word_ok, other=0)
        else:
            words = tl.load(first_word + word_rel)
        if SHUFFLE:  # every lane holds code[lane % 16]; a lookup is one shuffle from lane `nibble`
            lane_code = lane_code_table(words, code_ptr)
    for k0 in range(0, K, BLOCK_K):
        w0 = k0 // 8
        if PREFETCH:
            current = words
            if k0 + BLOCK_K < K:
                if MASKED:
                    words = tl.load(first_word + (w0 + BLOCK_K // 8) + word_rel, mask=word_ok, other=0)
                else:
                    words = tl.load(first_word + (w0 + BLOCK_K // 8) + word_rel)
        else:
            if MASKED:
                current = tl.load(first_word + w0 + word_rel, mask=word_ok, other=0)
            else:
                current = tl.load(first_word + w0 + word_rel)
        block = block_row + ((w0 + tl.arange(0, GROUPS) * GROUP) // WORDS_PER_BLOCK)[None, :]  # [BN, G]
        if DOUBLE_QUANT:
            absmax = load_block_absmax(
                absmax_ptr,
                first_block + block,
                row_ok[:, None],
                nested_absmax_ptr,
                nested_code_ptr,
                offset,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
                MASKED,
            )
        else:
            absmax = load_block_absmax(
                absmax_ptr,
                block,
                row_ok[:, None],
                nested_absmax_ptr,
                nested_code_ptr,
                offset,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
                MASKED,
            )
        current = current.to(tl.uint32, bitcast=True)  # logical shifts
        if X_PACKED:  # x[8w : 8w + 8] as two int64 of four 16-bit values each
            x_quads = x_row.to(tl.pointer_type(tl.int64), bitcast=True) + (k0 // 4 + 2 * group_word)
            x_low = tl.load(x_quads)
            x_high = tl.load(x_quads + 1)
        else:
            x_cols = x_row + (k0 + 8 * group_word) * stride_xk  # [G, GW]
        if EMULATED:
            if X_PACKED:
                x8 = _emulated_x_words(x_low, x_high, x_ptr.dtype.element_ty)
            else:
                x8 = tl.load(x_cols[:, :, None] + tl.arange(0, 8)[None, None, :] * stride_xk).to(tl.float32)
            partial = _emulated_word_sums(current, code_ptr, x8)
        else:
            partial = tl.zeros((BLOCK_N, GROUPS, GROUP), dtype=tl.float32)
            for j in tl.static_range(8):
                # column 8w + j: byte j // 2 of the word, its high nibble for even j
                nibble = (current >> (8 * (j // 2) + 4 * (1 - j % 2))) & 15
                if SHUFFLE:  # code[nibble] from lane `nibble`, which holds it in `lane_code`
                    value = shuffle_code(lane_code, nibble)
                elif GATHER:
                    value = lookup(code_values, nibble.to(tl.int32))
                else:
                    value = tl.load(code_ptr + nibble)
                if X_PACKED:
                    xj = x_value(x_low if j < 4 else x_high, j % 4, x_ptr.dtype.element_ty)
                else:
                    xj = tl.load(x_cols + j * stride_xk).to(tl.float32)
                partial += value * xj[None, :, :]
        acc += partial * absmax[:, :, None]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)  # [BN]
    n = n0 + rows
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=row_ok, other=0.0).to(tl.float32)
    store_as(out_ptr + m.to(tl.int64) * N + n, y, row_ok, BF16_BITS)


@triton.jit
def _emulated_x_words(x_low, x_high, X_DTYPE: tl.constexpr):
    """The interpreter's x of ``[G, GW]`` words as ``[G, GW, 8]`` fp32: value j of a word is
    16-bit float j % 4 of x_low (j < 4) or x_high, as ``x_value`` takes it."""
    j = tl.arange(0, 8)[None, None, :]
    quads = tl.where(j < 4, x_low[:, :, None], x_high[:, :, None])
    bits = ((quads >> (16 * (j % 4))) & 0xFFFF).to(tl.uint16)
    return bits.to(X_DTYPE, bitcast=True).to(tl.float32)


@triton.jit
def _emulated_word_sums(words, code_ptr, x8):
    """The interpreter's ``sum_j code[nibble j] * x[8 w + j]`` for every word of ``words``
    (uint32, ``[BN, G, GW]``) at once, x8 ``[G, GW, 8]``: nibble j is byte j // 2's, the
    high one for even j, as the compiled loop takes it; the 8 products summed in fp32."""
    j = tl.arange(0, 8)[None, None, None, :]
    nibbles = (words[:, :, :, None] >> (8 * (j // 2) + 4 * (1 - j % 2))) & 15
    values = tl.load(code_ptr + nibbles)
    return tl.sum(values * x8[None, :, :, :], axis=3)


@triton.jit
def word_code_sums(words, lane_code, code_ptr, x_low, x_high, X_DTYPE: tl.constexpr, SHUFFLE: tl.constexpr):
    """Per int32 word: ``sum_j code[nibble j] * x[8 w + j]`` in fp32 (absmax not applied).

    Column ``8 w + j`` is nibble j: byte j // 2 of the little-endian word, its high nibble
    for even j. x_low / x_high hold x[8w : 8w + 4] / x[8w + 4 : 8w + 8] as 16-bit floats.
    SHUFFLE: ``shuffle_code`` from ``lane_code`` (``lane_code_table``), with ``word >> shift``
    unmasked as the lane. Otherwise (the interpreter, ROCm) the value is loaded from
    ``code_ptr``.
    """
    words = words.to(tl.uint32, bitcast=True)
    sums = tl.zeros(words.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        shifted = words >> (8 * (j // 2) + 4 * (1 - j % 2))
        if SHUFFLE:
            value = shuffle_code(lane_code, shifted)
        else:
            value = tl.load(code_ptr + (shifted & 15))
        sums += value * x_value(x_low if j < 4 else x_high, j % 4, X_DTYPE)
    return sums


@triton.jit
def _rows_step_words(words_ptr, rows, words_per_row, at, w):
    """Words (or word pairs) ``at + w`` of each of the 4 weight rows ``rows`` (int64)."""
    return (
        tl.load(words_ptr + rows[0] * words_per_row + at + w),
        tl.load(words_ptr + rows[1] * words_per_row + at + w),
        tl.load(words_ptr + rows[2] * words_per_row + at + w),
        tl.load(words_ptr + rows[3] * words_per_row + at + w),
    )


@triton.jit
def _rows_step_x(x_row, x_first):
    """x for the word pairs of one step, from ``x_row`` (int64 quads, at the step's first
    quad): the low and high quads of each pair's first word (a), then of its second (b).
    Each [PAIRS, 2] load is split in registers (Triton 3.6 loads it with two threads per
    row and moves halves across lanes; four 1-D loads instead were slower, notes v8c)."""
    a_low, a_high = tl.split(tl.load(x_row + x_first))
    b_low, b_high = tl.split(tl.load(x_row + x_first + 2))
    return a_low, a_high, b_low, b_high


@triton.jit
def pair_code_sums(pairs, lane_code, code_ptr, x, X_DTYPE: tl.constexpr, SHUFFLE: tl.constexpr):
    """Per int64 pair of words: the sum of its 16 ``code * x`` products in fp32 (absmax not
    applied). Little-endian: the low 32 bits are the pair's first word; ``x`` is what
    ``_rows_step_x`` returns."""
    a_low, a_high, b_low, b_high = x
    return word_code_sums(pairs.to(tl.int32), lane_code, code_ptr, a_low, a_high, X_DTYPE, SHUFFLE) + word_code_sums(
        (pairs >> 32).to(tl.int32), lane_code, code_ptr, b_low, b_high, X_DTYPE, SHUFFLE
    )


@triton.jit
def _rows_of_item(item, M, N):
    """Row of x and the 4 weight rows (clamped to N - 1, int64) of work item ``item``:
    items ``group * M + m`` put the M programs that read one row group next to each other."""
    group = item // M
    last = N - 1
    return (
        item % M,
        (
            tl.minimum(4 * group, last).to(tl.int64),
            tl.minimum(4 * group + 1, last).to(tl.int64),
            tl.minimum(4 * group + 2, last).to(tl.int64),
            tl.minimum(4 * group + 3, last).to(tl.int64),
        ),
        4 * group,
    )


@triton.jit(do_not_specialize=["word_step"])
def _gemv_4bit_rows_kernel(
    x_ptr,
    pairs_ptr,
    absmax_ptr,
    code_ptr,
    bias_ptr,
    out_ptr,
    nested_absmax_ptr,
    nested_code_ptr,
    offset,
    M,
    N,
    K,
    stride_xm,
    word_step,
    BLOCKSIZE: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    WORDS: tl.constexpr,
    SHUFFLE: tl.constexpr,
):
    """The gemv for bf16/fp16 x (rows on 16-byte boundaries) and K a multiple of 8 * WORDS
    and of BLOCKSIZE (bench/notes.md v8, v8c).

    A work item is 4 weight rows and one row of x; each program walks items pid, pid +
    grid, ... (a persistent grid) in one flat loop of WORDS-word steps. The 4 rows are 4
    separate 1-D tensors, so x is loaded and converted once per step for all of them, with
    no broadcast. The weight is read as int64 pairs of adjacent words (``pairs_ptr``): a
    pair is one 8-byte load and lies in one quantization block (blocks hold >= 4 words), so
    its 16 products share one absmax: half the word and absmax loads of single words (v8c).
    Pair indices are ``arange * word_step`` with word_step = 1 not specialized: Triton
    cannot prove them contiguous, so thread t holds pairs t, t + 32 * num_warps, ...: a
    warp's pair load reads 256 contiguous bytes. The next step's pairs and x are loaded
    before the current step is decoded, unconditionally (the last step re-reads itself): a
    conditional load made ptxas copy the loaded registers at the end of the step, which
    waits for DRAM. (ptxas still issues these loads at the end of the step body, after the
    decode; loading earlier by L2 prefetch or two steps ahead was slower, notes v8d.) Rows
    past N (the last group) are clamped to N - 1 and not stored.
    """
    X_DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    PAIRS: tl.constexpr = WORDS // 2
    p = tl.arange(0, PAIRS) * word_step
    x_first = 4 * p[:, None] + tl.arange(0, 2)[None, :]  # int64 quads of x: word 2p's low and high
    pairs_per_row = K // 16
    steps = pairs_per_row // PAIRS
    items = tl.cdiv(N, 4) * M
    grid = tl.num_programs(0)
    total = (items - tl.program_id(0) + grid - 1) // grid * steps
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    quads_per_x_row = stride_xm // 4
    blocks_per_row = K // BLOCKSIZE
    WORDS_PER_BLOCK: tl.constexpr = BLOCKSIZE // 8

    m, rows, _ = _rows_of_item(tl.program_id(0), M, N)
    next0, next1, next2, next3 = _rows_step_words(pairs_ptr, rows, pairs_per_row, 0, p)
    next_x = _rows_step_x(x_quads + m.to(tl.int64) * quads_per_x_row, x_first)
    if SHUFFLE:
        lane_code = lane_code_table(next0, code_ptr)
    else:
        lane_code = next0.to(tl.int32)  # not read: the table loads need no lane table
    acc0 = tl.zeros((PAIRS,), dtype=tl.float32)
    acc1 = tl.zeros((PAIRS,), dtype=tl.float32)
    acc2 = tl.zeros((PAIRS,), dtype=tl.float32)
    acc3 = tl.zeros((PAIRS,), dtype=tl.float32)
    for i in range(0, total):
        step = i % steps
        m, rows, first_row = _rows_of_item(tl.program_id(0) + (i // steps) * grid, M, N)
        pairs0, pairs1, pairs2, pairs3 = next0, next1, next2, next3
        x = next_x
        i_next = tl.minimum(i + 1, total - 1)
        m_next, rows_next, _ = _rows_of_item(tl.program_id(0) + (i_next // steps) * grid, M, N)
        at_next = (i_next % steps) * PAIRS
        next0, next1, next2, next3 = _rows_step_words(pairs_ptr, rows_next, pairs_per_row, at_next, p)
        next_x = _rows_step_x(x_quads + m_next.to(tl.int64) * quads_per_x_row + 4 * at_next, x_first)
        block = (step * WORDS + 2 * p) // WORDS_PER_BLOCK
        acc0 += pair_code_sums(pairs0, lane_code, code_ptr, x, X_DTYPE, SHUFFLE) * load_block_absmax(
            absmax_ptr,
            rows[0] * blocks_per_row + block,
            None,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            MASKED=False,
        )
        acc1 += pair_code_sums(pairs1, lane_code, code_ptr, x, X_DTYPE, SHUFFLE) * load_block_absmax(
            absmax_ptr,
            rows[1] * blocks_per_row + block,
            None,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            MASKED=False,
        )
        acc2 += pair_code_sums(pairs2, lane_code, code_ptr, x, X_DTYPE, SHUFFLE) * load_block_absmax(
            absmax_ptr,
            rows[2] * blocks_per_row + block,
            None,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            MASKED=False,
        )
        acc3 += pair_code_sums(pairs3, lane_code, code_ptr, x, X_DTYPE, SHUFFLE) * load_block_absmax(
            absmax_ptr,
            rows[3] * blocks_per_row + block,
            None,
            nested_absmax_ptr,
            nested_code_ptr,
            offset,
            NESTED_BLOCKSIZE,
            DOUBLE_QUANT,
            MASKED=False,
        )
        if step == steps - 1:
            out_row = out_ptr + m.to(tl.int64) * N + first_row
            _store_row(out_row, acc0, bias_ptr, first_row, N, HAS_BIAS, BF16_BITS)
            _store_row(out_row + 1, acc1, bias_ptr, first_row + 1, N, HAS_BIAS, BF16_BITS)
            _store_row(out_row + 2, acc2, bias_ptr, first_row + 2, N, HAS_BIAS, BF16_BITS)
            _store_row(out_row + 3, acc3, bias_ptr, first_row + 3, N, HAS_BIAS, BF16_BITS)
            acc0 = tl.zeros((PAIRS,), dtype=tl.float32)
            acc1 = tl.zeros((PAIRS,), dtype=tl.float32)
            acc2 = tl.zeros((PAIRS,), dtype=tl.float32)
            acc3 = tl.zeros((PAIRS,), dtype=tl.float32)


@triton.jit
def _store_row(out, acc, bias_ptr, row, N, HAS_BIAS: tl.constexpr, BF16_BITS: tl.constexpr):
    """Store one output: the sum of a row's accumulator (+ its bias), if ``row < N``."""
    y = tl.sum(acc, axis=0)
    if HAS_BIAS:
        y += tl.load(bias_ptr + tl.minimum(row, N - 1)).to(tl.float32)
    store_as(out, y, row < N, BF16_BITS)


def _rows_words(K: int, items: int, multiprocessors: int) -> tuple[int, int] | None:
    """(words per step, num_warps) of the rows kernel for ``items`` work items of rows of K
    values on a device of ``multiprocessors``, or None when no step size in the table divides
    the K / 8 words of a row."""
    many = items >= _ROWS_MANY_ITEMS_PER_SM * multiprocessors
    for words, num_warps in _ROWS_WORDS_MANY_ITEMS if many else _ROWS_WORDS:
        if K % (8 * words) == 0:
            return words, num_warps
    return None


def _rows_x_ok(x2: torch.Tensor) -> bool:
    """Whether the rows kernel can read x: bf16/fp16 (4 values per 8-byte quad), contiguous
    rows that start on 16-byte boundaries (a word's two quads are one [., 2] load, which
    the compiler may issue as one 16-byte load)."""
    return (
        x2.dtype in (torch.bfloat16, torch.float16)
        and x2.stride(1) == 1
        and (x2.shape[0] == 1 or x2.stride(0) % 8 == 0)
        and x2.data_ptr() % 16 == 0
    )


def _balanced_grid(items: int, max_programs: int) -> int:
    """Programs for a persistent grid of at most ``max_programs`` over ``items`` equal work
    items, such that every program walks the same number of items, give or take one: the
    kernel takes as long as its busiest program (8192 x 8192 on the H100: 2048 items over
    1584 programs, some walking two, 29.9 us; over 2048 programs, 23.5 us; notes v8)."""
    per_program = math.ceil(items / max_programs)
    return math.ceil(items / per_program)


def ptx_shuffle_ok(device: torch.device) -> bool:
    """Whether the kernels may look code values up with ``shfl.sync`` (inline PTX): only when
    compiled for an NVIDIA GPU. Triton's interpreter has no lanes, and a ROCm build of
    PyTorch (``torch.version.hip`` set; its devices are still called "cuda") compiles for
    AMD, where PTX does not exist; both load the value from the code table instead."""
    return device.type == "cuda" and torch.version.hip is None and not interpreter_active()


@functools.cache
def _multiprocessor_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _multiprocessors(device: torch.device) -> int:
    """Multiprocessors of a CUDA/ROCm device (the persistent grid's size unit)."""
    return _multiprocessor_count(device.index if device.index is not None else torch.cuda.current_device())


def _mma_available(x2: torch.Tensor, packed_flat: torch.Tensor, K: int) -> bool:
    """Whether the tensor-core kernel can read [M, K] ``x2`` and the weight here: on an
    NVIDIA GPU that runs its PTX, or in the interpreter (which runs the same kernel without
    PTX, so the CPU tests check this route)."""
    return (
        (nf4_mma.mma_ptx_ok(x2.device) or interpreter_active())
        and nf4_mma.x_readable(x2)
        and nf4_mma.weight_readable(packed_flat, K)
    )


def mma_route(x2: torch.Tensor, packed_flat: torch.Tensor, K: int) -> bool:
    """Whether ``gemv_4bit`` sends [M, K] ``x2`` to the tensor-core kernel."""
    low, high = mma_rows()
    return low <= x2.shape[0] <= high and _mma_available(x2, packed_flat, K)


def mma_rows() -> tuple[int, int]:
    """The row counts the tensor-core kernel serves where it can read x and W: compiled,
    ``MMA_MIN_ROWS``-``MAX_ROWS``; in the interpreter, ``INTERPRETED_MMA_ROWS``."""
    return INTERPRETED_MMA_ROWS if interpreter_active() else (MMA_MIN_ROWS, nf4_mma.MAX_ROWS)


def fused_rows_limit(x: torch.Tensor, packed: torch.Tensor, K: int) -> int:
    """The most rows of ``x`` (leading dims flattened) for which ``gemv_4bit`` beats
    dequantize + GEMM on this device: MAX_ROWS where the tensor-core kernel can read them,
    else PER_ROW_MAX_ROWS (the per-row kernels decode the weight once per row)."""
    return mma_rows()[1] if _mma_available(x.reshape(-1, K), packed.reshape(-1), K) else PER_ROW_MAX_ROWS


def _largest_dividing_tile(K: int, block_k: int) -> int:
    """The largest power of two <= block_k that divides K and holds whole words (>= 8), or 0."""
    while block_k >= 8:
        if K % block_k == 0:
            return block_k
        block_k //= 2
    return 0


def check_linear_call(
    x: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    blocksize: int,
    shape: tuple[int, ...],
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    nested_blocksize: int,
    bias: torch.Tensor | None,
    where: str,
) -> tuple[int, int]:
    """The checks of every fused matmul entry point (``gemv_4bit``, ``nf4_tc_gemm.tc_gemm_4bit``)
    on x, the state and the bias: a ValueError naming the first problem, else (N, K)."""
    if len(shape) != 2:
        raise ValueError(f"{where}: shape must be (N, K) of the weight, got {shape}")
    N, K = (int(s) for s in shape)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{where}: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != K:
        raise ValueError(f"{where}: x must be [..., K={K}] for a weight of shape {shape}, got {tuple(x.shape)}")
    check_packed_state(
        packed,
        absmax,
        blocksize=blocksize,
        numel=N * K,
        code=code,
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=nested_blocksize,
        where=where,
    )
    if x.device != packed.device:
        raise ValueError(f"{where}: x is on {x.device} but the packed weight is on {packed.device}")
    if bias is not None and (bias.numel() != N or bias.device != x.device):
        raise ValueError(f"{where}: bias must have N={N} entries on {x.device}, got {bias.numel()} on {bias.device}")
    return N, K


def empty_linear_plan(
    x: torch.Tensor, N: int, K: int
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor] | None:
    """The plan of a matmul with nothing to multiply (no rows, no outputs: an empty result;
    K = 0: the bias, or zeros), or None where there is something to multiply."""
    out_shape = (*x.shape[:-1], N)
    dtype, device = x.dtype, x.device
    if math.prod(x.shape[:-1]) == 0 or N == 0:
        return lambda x, bias: torch.empty(out_shape, dtype=dtype, device=device)
    if K == 0:

        def bias_only(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
            if bias is None:
                return torch.zeros(out_shape, dtype=dtype, device=device)
            return bias.reshape(N).to(dtype).expand(out_shape).contiguous()

        return bias_only
    return None


def gemv_4bit(
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
) -> torch.Tensor:
    """``x @ W.T + bias`` with W (N, K) read from bitsandbytes-packed 4-bit bytes.

    x: [..., K] bf16/fp16/fp32, any strides, at most 32 rows once the leading dims are
    flattened (larger batches should dequantize once and call a GEMM; ``fused_rows_limit``
    says up to how many rows this is faster). Returns [..., N] in x.dtype; accumulation is
    fp32. The tensor-core route (``mma_route``) rounds each fp32 weight to x's dtype before
    its products, as dequantize-then-GEMM does; the per-row kernels keep it in fp32.
    ``gemv_4bit_plan(...)(x, bias)``: validated and planned on every call.
    """
    return gemv_4bit_plan(
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
    )(x, bias)


def gemv_4bit_plan(
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
) -> Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]:
    """``gemv_4bit``'s arguments validated, its kernels chosen and their launches bound:
    ``plan(x, bias)`` is ``gemv_4bit(x, ..., bias=bias)`` for every x and bias laid out as
    these (dtype, shape, strides, data-pointer alignment, device: what the kernel choice and
    Triton's specialization read). The plan checks nothing: a caller that keeps it (the
    Triton adapter's ``plans``) keys it on those properties."""
    where = "kernels.gemv_4bit"
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
    x2 = x.reshape(-1, K)  # a view whenever the strides allow: the kernel takes strides
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(
            f"{where}: x has {M} rows after flattening its leading dims {tuple(x.shape[:-1])}; the fused "
            f"gemv handles at most {MAX_ROWS}: dequantize_4bit the weight and use a matmul instead"
        )
    out_shape = (*x.shape[:-1], N)
    empty = empty_linear_plan(x, N, K)
    if empty is not None:
        return empty
    check_launchable(x.device, where)
    if N * K >= 2**31 * min(blocksize, 64):
        raise ValueError(f"{where}: a weight of {N} x {K} exceeds the kernel's int32 block index")
    run = plan_gemv(
        x2,
        packed,
        absmax,
        bias is not None,
        {
            "blocksize": blocksize,
            "shape": (N, K),
            "code": code,
            "nested_absmax": nested_absmax,
            "nested_code": nested_code,
            "nested_blocksize": nested_blocksize,
            "offset": offset,
        },
    )
    flat = x.dim() == 2  # x is its own [M, K] view: no reshape per call
    bias_flat = bias is not None and bias.dim() == 1 and bias.stride(0) == 1

    def planned(x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        out = x.new_empty(out_shape)  # x's dtype and device: ~1 us less host time than torch.empty(...)
        if bias is not None and not bias_flat:
            bias = bias.reshape(-1).contiguous()
        run(x if flat else x.reshape(-1, K), out, bias)
        return out

    def native(x: torch.Tensor, bias: torch.Tensor | None) -> Any:
        """The plan as one native call (``native_launch``), made after a first call with
        ``x`` and ``bias``; None where x's rows are not a view of x or bias is not flat (the
        plan copies them), or no native launch is had here."""
        run_native = getattr(run, "native", None)
        if run_native is None or (bias is not None and not bias_flat) or x.reshape(-1, K).data_ptr() != x.data_ptr():
            return None
        return run_native(x, bias, out_shape)

    planned.native = native  # type: ignore[attr-defined]
    return planned


# Argument positions of the per-call tensors in every gemv launch (x, bias, out).
NATIVE_ROLES = {"x": 0, "bias": 4, "out": 5}


def plan_gemv(
    x2: torch.Tensor, packed: torch.Tensor, absmax: torch.Tensor, has_bias: bool, kernel_args: Mapping[str, Any]
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]:
    """The launches of ``gemv_4bit`` for [M, K] activations like ``x2`` (dtype, shape,
    strides, data-pointer alignment: what the kernel choice and Triton's specialization
    read), decided and bound once: ``plan(x2, out, bias)`` writes ``out`` [M, N] (fresh,
    x2's dtype) from ``x2`` and the flat ``bias`` (or None, as ``has_bias`` said).
    ``gemv_4bit_plan``'s step after its checks: it validates nothing (0 < M <= MAX_ROWS,
    N, K > 0). ``kernel_args``: ``gemv_4bit``'s keyword arguments from ``blocksize`` to
    ``offset`` (``Nf4State.kernel_args()``)."""
    N, K = (int(s) for s in kernel_args["shape"])
    blocksize, nested_blocksize, code = kernel_args["blocksize"], kernel_args["nested_blocksize"], kernel_args["code"]
    M = x2.shape[0]
    device = x2.device
    absmax_flat = absmax.reshape(-1).contiguous()
    nested_absmax_arg, nested_code_arg, offset_value, double_quant = nested_args(
        absmax_flat, kernel_args["nested_absmax"], kernel_args["nested_code"], kernel_args["offset"]
    )
    on_gpu = device.type != "cpu"
    packed_flat = packed.reshape(-1).contiguous()
    code_arg = code.contiguous()
    multiprocessors = _multiprocessors(device) if on_gpu else 1
    if mma_route(x2, packed_flat, K):
        return nf4_mma.plan_gemm_4bit_mma(
            x2,
            packed_flat,
            absmax_flat,
            N,
            has_bias=has_bias,
            blocksize=blocksize,
            nested_absmax=nested_absmax_arg,
            nested_code=nested_code_arg,
            nested_blocksize=nested_blocksize,
            offset=offset_value,
            double_quant=double_quant,
            code=code_arg,
            multiprocessors=multiprocessors,
        )
    shuffle = ptx_shuffle_ok(device)
    bf16_bits = x2.dtype == torch.bfloat16 and interpreter_active()
    block_n, block_k, num_warps = _GPU_TILE if on_gpu else _INTERPRETER_TILE
    aligned = K % blocksize == 0
    if aligned:
        block_k = max(blocksize, min(block_k, triton.next_power_of_2(K)))
        if N * (K // 2) >= 2**31:  # int32 byte offsets from a tile's first row
            aligned = False
    else:
        block_k = min(block_k, max(32, triton.next_power_of_2(K)))
    masked = not aligned or N % block_n != 0 or K % block_k != 0
    stride_xm, stride_xk = x2.stride(0), x2.stride(1)
    meta = dict(
        BLOCKSIZE=blocksize,
        NESTED_BLOCKSIZE=nested_blocksize,
        DOUBLE_QUANT=double_quant,
        HAS_BIAS=has_bias,
        BF16_BITS=bf16_bits,
        ALIGNED=aligned,
        MASKED=masked,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    words_tile = _GPU_WORDS_TILE if on_gpu else _INTERPRETER_WORDS_TILE
    words_block_k = _largest_dividing_tile(K, words_tile[1]) if aligned else 0
    words_ok = packed_flat.data_ptr() % 4 == 0 and packed_flat.numel() % 4 == 0
    row_groups = math.ceil(N / 4) * M
    pairs_ok = packed_flat.data_ptr() % 8 == 0 and packed_flat.numel() % 8 == 0
    rows_words = _rows_words(K, row_groups, multiprocessors) if aligned and pairs_ok and _rows_x_ok(x2) else None
    if _ROWS_KERNEL and rows_words:
        words_per_step, rows_warps = rows_words
        programs = _ROWS_PROGRAMS_PER_SM * multiprocessors if on_gpu else _INTERPRETER_ROWS_PROGRAMS
        weight = packed_flat.view(torch.int64)
        rows_launch = BoundLaunch(
            _gemv_4bit_rows_kernel,
            (_balanced_grid(row_groups, programs),),
            dict(
                BLOCKSIZE=blocksize,
                NESTED_BLOCKSIZE=nested_blocksize,
                DOUBLE_QUANT=double_quant,
                HAS_BIAS=has_bias,
                BF16_BITS=bf16_bits,
                WORDS=words_per_step,
                SHUFFLE=shuffle,
                num_warps=rows_warps,
            ),
        )
        tail: tuple = (nested_absmax_arg, nested_code_arg, offset_value, M, N, K, stride_xm, 1)
        launch = rows_launch
    elif words_block_k and words_ok:
        block_n, _, words_warps, prefetch = words_tile
        while on_gpu and block_n > 4 and math.ceil(N / block_n) * M < _WORDS_MIN_PROGRAMS:
            block_n //= 2  # small N: more, smaller programs (v5's 4-row tiles won at 4096 x 4096)
        meta.update(BLOCK_N=block_n, BLOCK_K=words_block_k, num_warps=words_warps, MASKED=N % block_n != 0)
        del meta["ALIGNED"]
        weight = packed_flat.view(torch.int32)
        launch = BoundLaunch(
            _gemv_4bit_words_kernel,
            (math.ceil(N / block_n) * M,),
            dict(
                meta,
                GROUP=min(blocksize, words_block_k) // 8,
                PREFETCH=prefetch,
                GATHER=_WORDS_LOOKUP == "gather" or (_WORDS_LOOKUP == "shuffle" and not (shuffle and prefetch)),
                SHUFFLE=_WORDS_LOOKUP == "shuffle" and shuffle and prefetch,
                X_PACKED=_X_PACKED
                and x2.dtype != torch.float32
                and stride_xk == 1
                and stride_xm % 4 == 0
                and x2.data_ptr() % 8 == 0,
                EMULATED=interpreter_active(),
            ),
        )
        tail = (nested_absmax_arg, nested_code_arg, offset_value, M, N, K, stride_xm, stride_xk)
    else:
        weight = packed_flat
        launch = BoundLaunch(_gemv_4bit_kernel, (math.ceil(N / block_n) * M,), meta)
        tail = (nested_absmax_arg, nested_code_arg, offset_value, M, N, K, stride_xm, stride_xk)

    fixed = (weight, absmax_flat, code_arg)
    fixed_pointers, tail_pointers = pointers(fixed), pointers(tail)  # the state's tensors, once bound

    def run(x2: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        if launch.bound:
            w, a, c = fixed_pointers
            launch(x2, w, a, c, bias if bias is not None else a, out, *tail_pointers)
            return
        launch(
            x2,
            weight,
            absmax_flat,
            code_arg,
            bias if bias is not None else absmax_flat,
            out.view(torch.int16) if bf16_bits else out,
            *tail,
        )

    def native(x: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple[int, ...]) -> Any:
        if bf16_bits:
            return None
        w, a, c = fixed_pointers
        return launch.native((None, w, a, c, a, None, *tail_pointers), NATIVE_ROLES, x, bias, out_shape)

    run.native = native  # type: ignore[attr-defined]
    return run
