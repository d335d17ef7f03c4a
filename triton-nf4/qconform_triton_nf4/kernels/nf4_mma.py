"""Fused 4-bit matmul for 2-32 activation rows on tensor cores: ``y = x W^T + b``.

The per-row kernels (``nf4_gemv``) decode every weight once per row of x; from a few rows
on, that decode is the cost (8192 x 8192 on the H100: 22 us for one row, 65 us for four).
Here each weight is decoded once and multiplied with every row of x by ``mma.sync``
(m16n8k16, fp32 accumulators): A is 16 weight rows x 16 columns, B the same 16 columns of
8 rows of x. W is read in bitsandbytes' layout, unchanged (see ``nf4_dequant``).

Arithmetic, the same as dequantize-then-GEMM: each weight is fp32 ``code * absmax`` (the
value ``dequantize_4bit`` computes) rounded once to x's dtype (bf16 or fp16); the tensor
cores multiply it with x exactly and accumulate in fp32; the sum of a K split (and the
bias) is added in fp32 and rounded once to x's dtype. So the suites judge this route with
the dequantize-then-GEMM error model, as they judge dequantize + cuBLAS.

Layout. Every tensor is 1-D with one element per thread (``arange * one``, ``one`` a
runtime 1, so Triton cannot prove contiguity and keeps one element per thread): an
element's value is its lane's register, which is what the mma fragments are (PTX ISA,
"Matrix Fragments for mma.m16n8k16"). Lane ``4 g + t`` holds A rows g and g + 8 and B
column g. The 16 columns of one product are a permutation of K, the same for A and B:
in a 64-column chunk, lane t owns columns ``16 t .. 16 t + 15`` (8 packed bytes of each of
its two weight rows, one 8-byte load each, inside one quantization block, so one absmax),
and product q (0-3) takes its columns ``16 t + 4 q .. + 3``: A's registers a0/a2 are rows
g's columns +0, +1 / +2, +3 (a1/a3 the same of row g + 8), B's b0/b1 the same columns of
row g of x, one 8-byte load of x. Programs are 16 * ROW_TILES weight rows; their warps,
and SPLIT programs along the grid's second axis, take turns over the chunks; the warps'
sums are added in the program, the splits' by the last program of each tile to arrive
(``_sum_tile_splits``), in split order.

Loads (v19; the kernel is bound by L1's data pipe, bench/notes.md v11): a warp's weight
bytes for its next chunk are loaded an iteration ahead, marked ``evict_first`` (read once;
L1 is kept for x, which every program reads); x, where 16-byte aligned, in two 16-byte
loads a row instead of four 8-byte ones; and, at blocks of 64 columns or more, the warps
take runs of 4 consecutive chunks, whose absmax one load brings (lane t of each row loads
chunk t's) and a shuffle hands out, instead of one load per chunk.

NVIDIA only: the products (``mma.sync``), the code lookups (a warp shuffle, as in
``nf4_gemv``) and the bf16/fp16 packing (``cvt.rn``) are inline PTX, and the matmul route
sends only NVIDIA GPUs of compute capability 8.0+ here (``mma_route_ok``; ROCm never runs
this kernel). With ``PTX`` off (Triton's interpreter, the CPU tests) the same loads, K
chunks, warps, splits and stores run, and each chunk's products are emulated at once: the
tile's weights decoded to a [16, 64] matrix per warp (code loaded from the table, rounded
to x's dtype with integer ops), x's 8-byte loads unpacked to [8, 64], their fp32 product
summed and handed back in D's fragment layout (``_emulated_products``). One interpreted
operation costs about the same at any width, so this is about a tenth of emulating the
16 fragment registers and 4 ``mma.sync`` of a chunk one by one (bench/notes.md "The
interpreter's emulation"). The A registers' nibble order (``_a_registers``) is
PTX-only and checked on a GPU, where the kernel tests and suites run it. Versions and
timings: bench/notes.md "v11" and "v13".
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from qconform_triton_nf4.kernels.launch import BoundLaunch, pointers
from qconform_triton_nf4.kernels.nf4_dequant import (
    bf16_bits,
    interpreter_active,
    load_block_absmax,
    store_as,
)
from qconform_triton_nf4.kernels.split_sums import SplitSums

MAX_ROWS = 32  # four groups of 8 rows of x (B is 8 columns wide)
CHUNK = 64  # columns of K per warp step: 4 products of 16 columns
_CHUNK = tl.constexpr(CHUNK)  # the same, readable inside the kernels
RUN = 4  # chunks of a run (ABSMAX_QUADS): one per lane t of a weight row, each loading one absmax
_RUN = tl.constexpr(RUN)
# (ROW_TILES, num_warps, warps per multiprocessor the split aims at) by groups of 8 rows
# of x: the GPU's choice from bench/notes.md v11, v13, v15 and v16 (H100, bf16, device us;
# v16 swept ``bench/mma_configs.py``). One group (2-8 rows): (1, 4, 32), 8192^2 4 rows 35.6.
# Two groups: (1, 4, 16) at 14336 x 4096 (v17: 16 rows 41.7; v16's (2, 4, 32) took 40.5 with
# a separate kernel adding the K splits, 52.6 since the last program of each tile adds them,
# (1, 4, 16) 41.5 then and now); below NARROW_N outputs (1, 8, 16)
# (8192^2 47.2, 4096^2 17.0 against 21.1 with v15's (1, 8, 32)). Three groups: (1, 4, 16)
# (8192^2 24 rows 55.7 against 60.6 with (1, 4, 32)). Four groups: fewer warps per
# multiprocessor, so fewer K splits (at 14336 x 4096 none: one launch): (1, 2, 16) at
# 14336 x 4096 (32 rows 58.0 against 80.1; bitsandbytes 71.9), (1, 4, 16) below NARROW_N
# (8192^2 62.9 against 84.2, 4096^2 25.0 against 32.2). Three and four groups stay in one
# row tile (the kernel holds accumulators for two groups per tile of a pair). The
# interpreter runs two warps, and two row tiles for one or two groups: each interpreted
# operation costs about the same whatever its width, so a 128-wide K in one step instead
# of two and half the programs (a layer check 3.8 -> 2.4 s), and the CPU runs the kernel's
# multi-warp sums as the GPU does.
_GPU_CONFIG = {1: (1, 4, 32), 2: (1, 4, 16), 3: (1, 4, 16), 4: (1, 2, 16)}
NARROW_N = 12288
_GPU_CONFIG_NARROW = {2: (1, 8, 16), 4: (1, 4, 16)}
_INTERPRETER_CONFIG = {1: (2, 2, 1), 2: (2, 2, 1), 3: (1, 2, 1), 4: (1, 2, 1)}


@triton.jit
def _lane_code(lane, code_ptr, PTX: tl.constexpr):
    """code[lane % 16] as int32 bits (the shuffle table), or unused zeros without PTX."""
    if PTX:
        return tl.load(code_ptr + (lane & 15)).to(tl.int32, bitcast=True)
    return lane * 0


@triton.jit
def _code_value(lane_code, shifted):
    """fp32 ``code[shifted & 15]``: a shuffle from the lane holding it (its low 5 bits are
    the lane; lanes n and n + 16 hold the same value, so no mask)."""
    return tl.inline_asm_elementwise(
        "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
        "=r,r,r",
        [lane_code, shifted],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.float32, bitcast=True)


@triton.jit
def _chunk_of(i, first, stride, ABSMAX_QUADS: tl.constexpr):
    """The chunk a warp takes in its iteration ``i`` (``first``: split * NUM_WARPS + warp):
    every ``stride``-th chunk, or runs of 4 chunks every ``stride``-th run."""
    if ABSMAX_QUADS:
        return _RUN * (first + (i // _RUN) * stride) + i % _RUN
    return first + i * stride


@triton.jit
def _lane_value(value, source):
    """fp32 ``value`` of lane ``source`` of this warp (a warp shuffle)."""
    return tl.inline_asm_elementwise(
        "shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;",
        "=r,r,r",
        [value.to(tl.int32, bitcast=True), source],
        dtype=tl.int32,
        is_pure=True,
        pack=1,
    ).to(tl.float32, bitcast=True)


@triton.jit
def _pack2(low, high, X_FP16: tl.constexpr):
    """int32 holding ``low`` (bits 0-15) and ``high`` (16-31) rounded to nearest even to
    bf16 (fp16 with X_FP16): one register of an mma fragment."""
    if X_FP16:
        return tl.inline_asm_elementwise(
            "cvt.rn.f16x2.f32 $0, $1, $2;", "=r,f,f", [high, low], dtype=tl.int32, is_pure=True, pack=1
        )
    return tl.inline_asm_elementwise(
        "cvt.rn.bf16x2.f32 $0, $1, $2;", "=r,f,f", [high, low], dtype=tl.int32, is_pure=True, pack=1
    )


@triton.jit
def _mma(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3, X_FP16: tl.constexpr):
    """D = A B + C of one m16n8k16 product (fp32 accumulators), every operand this lane's
    fragment register (lane 4 g + t of each warp: A rows g and g + 8, B column g)."""
    if X_FP16:
        return tl.inline_asm_elementwise(
            "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, "
            "{$10,$11,$12,$13};",
            "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
            [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
            dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True,
            pack=1,
        )
    return tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f",
        [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _emulated_weights(unit0, unit1, scale0, scale1, code_ptr, NUM_WARPS: tl.constexpr, X_FP16: tl.constexpr):
    """[NUM_WARPS, 16, 64] fp32: each warp's tile of its chunk, ``code * absmax`` rounded
    to x's dtype, row ``8 r + g`` (r 0: ``unit0``, 1: ``unit1``), column ``16 t + j``: the
    lane's byte j // 2, the high nibble first (what A's registers hold over the 4 products)."""
    shift = ((tl.arange(0, 16) ^ 1) * 4).to(tl.int64)
    units = tl.join(unit0, unit1)  # [lanes, r]
    codes = (units[:, :, None] >> shift[None, None, :]) & 15
    w = tl.load(code_ptr + codes) * tl.join(scale0, scale1)[:, :, None]  # [lanes, r, j]
    if X_FP16:
        w = w.to(tl.float16).to(tl.float32)
    else:
        w = (bf16_bits(w) << 16).to(tl.float32, bitcast=True)
    return tl.reshape(tl.permute(tl.reshape(w, (NUM_WARPS, 8, 4, 2, 16)), (0, 3, 1, 2, 4)), (NUM_WARPS, 16, 64))


@triton.jit
def _emulated_x(quads, NUM_WARPS: tl.constexpr, X_FP16: tl.constexpr):
    """[NUM_WARPS, 8, 64] fp32: each warp's 8 rows of x (row g) at the chunk's columns
    ``16 t + 4 q + i``, from ``_x_loads``' 4 quads (B's registers of products q = 0-3)."""
    q = tl.join(tl.join(quads[0], quads[2]), tl.join(quads[1], quads[3]))  # [lanes, q // 2, q % 2]
    bits = ((q[:, :, :, None] >> (tl.arange(0, 4) * 16).to(tl.int64)[None, None, None, :]) & 0xFFFF).to(tl.int32)
    if X_FP16:
        x = bits.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        x = (bits << 16).to(tl.float32, bitcast=True)
    return tl.reshape(x, (NUM_WARPS, 8, 64))


@triton.jit
def _emulated_products(w, quads, c0, c1, c2, c3, NUM_WARPS: tl.constexpr, X_FP16: tl.constexpr):
    """The chunk's 4 products of one group of x without PTX: ``C + W X^T`` summed in fp32,
    handed back in D's fragment layout (lane 4 g + t: rows g, g + 8 and x rows 2t, 2t + 1)."""
    x = _emulated_x(quads, NUM_WARPS, X_FP16)
    d = tl.sum(w[:, :, None, :] * x[:, None, :, :], axis=3)  # [warp, 8 r + g, 2 t + e]
    d = tl.reshape(tl.permute(tl.reshape(d, (NUM_WARPS, 2, 8, 4, 2)), (0, 2, 3, 1, 4)), (32 * NUM_WARPS, 2, 2))
    even, odd = tl.split(d)  # [lanes, r] each
    top_even, bottom_even = tl.split(even)
    top_odd, bottom_odd = tl.split(odd)
    return c0 + top_even, c1 + top_odd, c2 + bottom_even, c3 + bottom_odd


@triton.jit
def _tile_units(pairs_ptr, row0, row1, c, t, valid, K):
    """Chunk ``c`` of a lane's two weight rows (int64 rows, clamped): its 8 packed bytes of
    each (8 * t .. 8 * t + 7 of the chunk's 32), zeros where not ``valid``. Read once and
    never again: ``evict_first`` keeps L1 for x, which every program reads (bench/notes.md
    v19)."""
    at = 4 * c + t
    unit0 = tl.load(pairs_ptr + row0 * (K // 16) + at, mask=valid, other=0, eviction_policy="evict_first")
    unit1 = tl.load(pairs_ptr + row1 * (K // 16) + at, mask=valid, other=0, eviction_policy="evict_first")
    return unit0, unit1


@triton.jit
def _row_scales(
    absmax_ptr,
    nested_absmax_ptr,
    nested_code_ptr,
    offset,
    row0,
    row1,
    column,
    valid,
    K,
    BLOCKSIZE: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
):
    """The absmax of the blocks holding ``column`` in a lane's two weight rows, 0 where not
    ``valid``."""
    scale0 = load_block_absmax(
        absmax_ptr,
        (row0 * K + column) // BLOCKSIZE,
        valid,
        nested_absmax_ptr,
        nested_code_ptr,
        offset,
        NESTED_BLOCKSIZE,
        DOUBLE_QUANT,
    )
    scale1 = load_block_absmax(
        absmax_ptr,
        (row1 * K + column) // BLOCKSIZE,
        valid,
        nested_absmax_ptr,
        nested_code_ptr,
        offset,
        NESTED_BLOCKSIZE,
        DOUBLE_QUANT,
    )
    return scale0, scale1


@triton.jit
def _load_pair(ptr, ok):
    """The two int64 at ``ptr`` (16-byte aligned) in one 16-byte load, zeros where not ``ok``."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.b32 p, $3, 0; mov.b64 $0, 0; mov.b64 $1, 0; @p ld.global.v2.b64 {$0, $1}, [$2]; }",
        "=l,=l,l,r",
        [ptr.to(tl.int64), ok.to(tl.int32)],
        dtype=(tl.int64, tl.int64),
        is_pure=True,
        pack=1,
    )


@triton.jit
def _x_loads(x_quads, x_row, x_ok, c, t, X_16B: tl.constexpr):
    """B's registers for the chunk's 4 products from one row of x (``x_row``, in int64
    quads): columns 16 t + 4 q .. + 3 for q = 0..3, zeros where not ``x_ok``. X_16B: in
    two 16-byte loads (x 16-byte aligned, PTX), which halve the L1 wavefronts of x's loads
    (each touches one line per row of x either way); else four 8-byte loads."""
    at = x_row + 16 * c + 4 * t
    if X_16B:
        q0, q1 = _load_pair(x_quads + at, x_ok)
        q2, q3 = _load_pair(x_quads + at + 2, x_ok)
        return q0, q1, q2, q3
    return (
        tl.load(x_quads + at, mask=x_ok, other=0),
        tl.load(x_quads + at + 1, mask=x_ok, other=0),
        tl.load(x_quads + at + 2, mask=x_ok, other=0),
        tl.load(x_quads + at + 3, mask=x_ok, other=0),
    )


@triton.jit
def _a_registers(unit0, unit1, scale0, scale1, q: tl.constexpr, lane_code, X_FP16: tl.constexpr):
    """A's 4 registers of product q: columns +0, +1 (a0, a1) and +2, +3 (a2, a3) of rows g
    (``unit0``) and g + 8 (``unit1``): bytes 2q and 2q + 1 of each unit, the high nibble
    first (even flat index), each ``code * absmax`` in fp32 rounded to x's dtype."""
    SHIFT: tl.constexpr = 16 * (q % 2)  # byte 2q of the unit is byte (2q) % 4 of word q // 2
    w0 = (unit0 >> (32 * (q // 2))).to(tl.int32)
    w1 = (unit1 >> (32 * (q // 2))).to(tl.int32)
    a0 = _pack2(
        _code_value(lane_code, w0 >> (SHIFT + 4)) * scale0, _code_value(lane_code, w0 >> SHIFT) * scale0, X_FP16
    )
    a2 = _pack2(
        _code_value(lane_code, w0 >> (SHIFT + 12)) * scale0,
        _code_value(lane_code, w0 >> (SHIFT + 8)) * scale0,
        X_FP16,
    )
    a1 = _pack2(
        _code_value(lane_code, w1 >> (SHIFT + 4)) * scale1, _code_value(lane_code, w1 >> SHIFT) * scale1, X_FP16
    )
    a3 = _pack2(
        _code_value(lane_code, w1 >> (SHIFT + 12)) * scale1,
        _code_value(lane_code, w1 >> (SHIFT + 8)) * scale1,
        X_FP16,
    )
    return a0, a1, a2, a3


@triton.jit
def _tile_products(
    unit0,
    unit1,
    scale0,
    scale1,
    xa,
    xb,
    xc,
    xd,
    d0,
    d1,
    d2,
    d3,
    e0,
    e1,
    e2,
    e3,
    p0,
    p1,
    p2,
    p3,
    r0,
    r1,
    r2,
    r3,
    lane_code,
    code_ptr,
    NUM_WARPS: tl.constexpr,
    X_GROUPS: tl.constexpr,
    X_FP16: tl.constexpr,
    PTX: tl.constexpr,
):
    """One chunk of one 16-row tile against x rows 0-7 (``xa``, into d), 8-15 (``xb``, into
    e, when X_GROUPS >= 2), 16-23 (``xc``, into p, X_GROUPS >= 3) and 24-31 (``xd``, into
    r, X_GROUPS 4): 4 products each, A decoded once for all (without PTX: emulated at once)."""
    if PTX:
        for q in tl.static_range(4):
            a0, a1, a2, a3 = _a_registers(unit0, unit1, scale0, scale1, q, lane_code, X_FP16)
            d0, d1, d2, d3 = _mma(
                a0, a1, a2, a3, xa[q].to(tl.int32), (xa[q] >> 32).to(tl.int32), d0, d1, d2, d3, X_FP16
            )
            if X_GROUPS >= 2:
                e0, e1, e2, e3 = _mma(
                    a0, a1, a2, a3, xb[q].to(tl.int32), (xb[q] >> 32).to(tl.int32), e0, e1, e2, e3, X_FP16
                )
            if X_GROUPS >= 3:
                p0, p1, p2, p3 = _mma(
                    a0, a1, a2, a3, xc[q].to(tl.int32), (xc[q] >> 32).to(tl.int32), p0, p1, p2, p3, X_FP16
                )
            if X_GROUPS >= 4:
                r0, r1, r2, r3 = _mma(
                    a0, a1, a2, a3, xd[q].to(tl.int32), (xd[q] >> 32).to(tl.int32), r0, r1, r2, r3, X_FP16
                )
    else:
        w = _emulated_weights(unit0, unit1, scale0, scale1, code_ptr, NUM_WARPS, X_FP16)
        d0, d1, d2, d3 = _emulated_products(w, xa, d0, d1, d2, d3, NUM_WARPS, X_FP16)
        if X_GROUPS >= 2:
            e0, e1, e2, e3 = _emulated_products(w, xb, e0, e1, e2, e3, NUM_WARPS, X_FP16)
        if X_GROUPS >= 3:
            p0, p1, p2, p3 = _emulated_products(w, xc, p0, p1, p2, p3, NUM_WARPS, X_FP16)
        if X_GROUPS >= 4:
            r0, r1, r2, r3 = _emulated_products(w, xd, r0, r1, r2, r3, NUM_WARPS, X_FP16)
    return d0, d1, d2, d3, e0, e1, e2, e3, p0, p1, p2, p3, r0, r1, r2, r3


@triton.jit
def _warp_sum(acc, NUM_WARPS: tl.constexpr):
    """One accumulator ([32 * NUM_WARPS], by lane) added over the warps: [32]."""
    return tl.sum(tl.reshape(acc, (NUM_WARPS, 32)), axis=0)


@triton.jit
def _store_sums(
    out_ptr,
    bias_ptr,
    y,
    n,
    m,
    M,
    N,
    HAS_BIAS: tl.constexpr,
    SPLIT_SUMS: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """Store sums ``y`` (added over the warps) at rows ``m`` of x, weight rows ``n`` (all
    three of one shape): the fp32 sum (SPLIT_SUMS: ``out_ptr`` is this split's [M, N] slab)
    or, plus the bias, rounded to the output dtype."""
    ok = (n < N) & (m < M)
    if SPLIT_SUMS:
        tl.store(out_ptr + m.to(tl.int64) * N + n, y, mask=ok)
    else:
        if HAS_BIAS:
            y += tl.load(bias_ptr + tl.minimum(n, N - 1)).to(tl.float32)
        store_as(out_ptr + m.to(tl.int64) * N + n, y, ok, BF16_BITS)


@triton.jit
def _store_tile(
    out_ptr,
    bias_ptr,
    d0,
    d1,
    d2,
    d3,
    first_row,
    first_m,
    M,
    N,
    NUM_WARPS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    SPLIT_SUMS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    PTX: tl.constexpr,
):
    """One (16 weight rows, 8 rows of x) tile: lane (g, t) holds D rows g, g + 8 (weight rows
    ``first_row + g``, + 8) and columns 2t, 2t + 1 (rows ``first_m + 2 t``, + 1 of x). Each
    accumulator is summed over the warps and stored; without PTX (the interpreter) the four
    at once, one sum, bias load and store instead of four (the same sums: each adds the
    warps' values of one element, in warp order)."""
    lane = tl.arange(0, 32)
    n = first_row + lane // 4
    m = first_m + 2 * (lane % 4)
    if PTX:
        _store_sums(out_ptr, bias_ptr, _warp_sum(d0, NUM_WARPS), n, m, M, N, HAS_BIAS, SPLIT_SUMS, BF16_BITS)
        _store_sums(out_ptr, bias_ptr, _warp_sum(d1, NUM_WARPS), n, m + 1, M, N, HAS_BIAS, SPLIT_SUMS, BF16_BITS)
        _store_sums(out_ptr, bias_ptr, _warp_sum(d2, NUM_WARPS), n + 8, m, M, N, HAS_BIAS, SPLIT_SUMS, BF16_BITS)
        _store_sums(out_ptr, bias_ptr, _warp_sum(d3, NUM_WARPS), n + 8, m + 1, M, N, HAS_BIAS, SPLIT_SUMS, BF16_BITS)
    else:
        tile = tl.join(tl.join(d0, d1), tl.join(d2, d3))  # [lanes, x row + e, weight row + 8 r]
        y = tl.sum(tl.reshape(tile, (NUM_WARPS, 32, 2, 2)), axis=0)
        step = tl.arange(0, 2)
        rows = n[:, None, None] + 8 * step[None, None, :]
        x_rows = m[:, None, None] + step[None, :, None]
        _store_sums(out_ptr, bias_ptr, y, rows, x_rows, M, N, HAS_BIAS, SPLIT_SUMS, BF16_BITS)


@triton.jit(do_not_specialize=["M", "N", "one"])
def _gemm_4bit_mma_kernel(
    x_ptr,
    pairs_ptr,
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
    one,
    BLOCKSIZE: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BITS: tl.constexpr,
    X_FP16: tl.constexpr,
    X_GROUPS: tl.constexpr,
    ROW_TILES: tl.constexpr,
    NUM_WARPS: tl.constexpr,
    SPLIT_SUMS: tl.constexpr,
    PTX: tl.constexpr,
    X_16B: tl.constexpr,
    ABSMAX_QUADS: tl.constexpr,
):
    """Weight rows ``16 * ROW_TILES * pid0 ..`` against every row of x (at most 8 *
    X_GROUPS; two row tiles take at most two groups), over the chunks of split pid1 (chunks
    pid1 * NUM_WARPS + warp, then every NUM_WARPS * splits; ABSMAX_QUADS: runs of 4
    consecutive chunks so counted, and each run's absmax loaded once: lane t of a row loads
    its run's chunk t's, and a shuffle hands each chunk's to the row's 4 lanes, a quarter of
    the absmax loads; blocks of 64 columns or more, one row tile). One split: bias and
    rounding here; several: fp32 sums into ``work_ptr`` [splits, M, N], and the last split
    of a tile to arrive (a ticket from ``ticket_ptr``, one int32 per tile, zero before the
    launch and left zero) adds the tile's splits in split order, the bias, and rounds
    (``_sum_tile_splits``)."""
    tl.static_assert(ROW_TILES == 1 or X_GROUPS <= 2, "two row tiles hold accumulators for two groups of x")
    tl.static_assert(not ABSMAX_QUADS or (ROW_TILES == 1 and BLOCKSIZE >= _CHUNK), "a run's absmax: one per chunk")
    lane = tl.arange(0, 32 * NUM_WARPS) * one
    warp = lane // 32
    g = (lane % 32) // 4
    t = lane % 4
    lane_code = _lane_code(lane, code_ptr, PTX)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    first_row = tl.program_id(0) * (16 * ROW_TILES)
    last = N - 1
    row0 = tl.minimum(first_row + g, last).to(tl.int64)
    row1 = tl.minimum(first_row + g + 8, last).to(tl.int64)
    row2 = tl.minimum(first_row + g + 16, last).to(tl.int64)
    row3 = tl.minimum(first_row + g + 24, last).to(tl.int64)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    quads_per_x_row = stride_xm // 4
    xa_row = g.to(tl.int64) * quads_per_x_row
    xb_row = (g + 8).to(tl.int64) * quads_per_x_row
    xc_row = (g + 16).to(tl.int64) * quads_per_x_row
    xd_row = (g + 24).to(tl.int64) * quads_per_x_row
    chunks = K // _CHUNK
    stride = NUM_WARPS * splits
    if ABSMAX_QUADS:
        iterations = tl.cdiv(tl.cdiv(chunks, _RUN), stride) * _RUN
    else:
        iterations = tl.cdiv(chunks, stride)
    zero = tl.zeros(lane.shape, dtype=tl.float32)
    d0, d1, d2, d3, e0, e1, e2, e3 = zero, zero, zero, zero, zero, zero, zero, zero
    f0, f1, f2, f3, h0, h1, h2, h3 = zero, zero, zero, zero, zero, zero, zero, zero
    p0, p1, p2, p3, r0, r1, r2, r3 = zero, zero, zero, zero, zero, zero, zero, zero
    run_scale0, run_scale1 = zero, zero
    first = split * NUM_WARPS + warp
    c_next = _chunk_of(0, first, stride, ABSMAX_QUADS)
    next0, next1 = _tile_units(pairs_ptr, row0, row1, tl.minimum(c_next, chunks - 1), t, c_next < chunks, K)
    for i in range(0, iterations):
        c = _chunk_of(i, first, stride, ABSMAX_QUADS)
        if ABSMAX_QUADS:
            run = c - i % _RUN  # the run's first chunk
            if i % _RUN == 0:
                run_scale0, run_scale1 = _row_scales(
                    absmax_ptr,
                    nested_absmax_ptr,
                    nested_code_ptr,
                    offset,
                    row0,
                    row1,
                    _CHUNK * tl.minimum(run + t, chunks - 1),
                    run + t < chunks,
                    K,
                    BLOCKSIZE,
                    NESTED_BLOCKSIZE,
                    DOUBLE_QUANT,
                )
        valid = c < chunks
        c = tl.minimum(c, chunks - 1)
        xa = _x_loads(x_quads, xa_row, valid & (g < M), c, t, X_16B)
        xb = xa
        xc = xa
        xd = xa
        if X_GROUPS >= 2:
            xb = _x_loads(x_quads, xb_row, valid & (g + 8 < M), c, t, X_16B)
        if X_GROUPS >= 3:
            xc = _x_loads(x_quads, xc_row, valid & (g + 16 < M), c, t, X_16B)
        if X_GROUPS >= 4:
            xd = _x_loads(x_quads, xd_row, valid & (g + 24 < M), c, t, X_16B)
        unit0, unit1 = next0, next1  # loaded an iteration ahead, zeros where not valid
        c_next = _chunk_of(i + 1, first, stride, ABSMAX_QUADS)
        next0, next1 = _tile_units(pairs_ptr, row0, row1, tl.minimum(c_next, chunks - 1), t, c_next < chunks, K)
        if ABSMAX_QUADS:
            holder = lane % 32 - t + i % _RUN  # the lane of this row that loaded chunk c's absmax
            scale0 = _lane_value(run_scale0, holder)
            scale1 = _lane_value(run_scale1, holder)
        else:
            scale0, scale1 = _row_scales(
                absmax_ptr,
                nested_absmax_ptr,
                nested_code_ptr,
                offset,
                row0,
                row1,
                _CHUNK * c + 16 * t,
                valid,
                K,
                BLOCKSIZE,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
            )
        d0, d1, d2, d3, e0, e1, e2, e3, p0, p1, p2, p3, r0, r1, r2, r3 = _tile_products(
            unit0,
            unit1,
            scale0,
            scale1,
            xa,
            xb,
            xc,
            xd,
            d0,
            d1,
            d2,
            d3,
            e0,
            e1,
            e2,
            e3,
            p0,
            p1,
            p2,
            p3,
            r0,
            r1,
            r2,
            r3,
            lane_code,
            code_ptr,
            NUM_WARPS,
            X_GROUPS,
            X_FP16,
            PTX,
        )
        if ROW_TILES == 2:
            unit2, unit3 = _tile_units(pairs_ptr, row2, row3, c, t, valid, K)
            scale2, scale3 = _row_scales(
                absmax_ptr,
                nested_absmax_ptr,
                nested_code_ptr,
                offset,
                row2,
                row3,
                _CHUNK * c + 16 * t,
                valid,
                K,
                BLOCKSIZE,
                NESTED_BLOCKSIZE,
                DOUBLE_QUANT,
            )
            f0, f1, f2, f3, h0, h1, h2, h3, _, _, _, _, _, _, _, _ = _tile_products(
                unit2,
                unit3,
                scale2,
                scale3,
                xa,
                xb,
                xa,
                xa,
                f0,
                f1,
                f2,
                f3,
                h0,
                h1,
                h2,
                h3,
                zero,
                zero,
                zero,
                zero,
                zero,
                zero,
                zero,
                zero,
                lane_code,
                code_ptr,
                NUM_WARPS,
                X_GROUPS,
                X_FP16,
                PTX,
            )
    if SPLIT_SUMS:
        out = work_ptr + split.to(tl.int64) * M * N
    else:
        out = out_ptr
    _store_tile(out, bias_ptr, d0, d1, d2, d3, first_row, 0, M, N, NUM_WARPS, HAS_BIAS, SPLIT_SUMS, BF16_BITS, PTX)
    if X_GROUPS >= 2:
        _store_tile(out, bias_ptr, e0, e1, e2, e3, first_row, 8, M, N, NUM_WARPS, HAS_BIAS, SPLIT_SUMS, BF16_BITS, PTX)
    if X_GROUPS >= 3:
        _store_tile(out, bias_ptr, p0, p1, p2, p3, first_row, 16, M, N, NUM_WARPS, HAS_BIAS, SPLIT_SUMS, BF16_BITS, PTX)
    if X_GROUPS >= 4:
        _store_tile(out, bias_ptr, r0, r1, r2, r3, first_row, 24, M, N, NUM_WARPS, HAS_BIAS, SPLIT_SUMS, BF16_BITS, PTX)
    if ROW_TILES == 2:
        _store_tile(
            out, bias_ptr, f0, f1, f2, f3, first_row + 16, 0, M, N, NUM_WARPS, HAS_BIAS, SPLIT_SUMS, BF16_BITS, PTX
        )
        if X_GROUPS >= 2:
            _store_tile(
                out, bias_ptr, h0, h1, h2, h3, first_row + 16, 8, M, N, NUM_WARPS, HAS_BIAS, SPLIT_SUMS, BF16_BITS, PTX
            )
    if SPLIT_SUMS:
        # Every warp's partial sums stored before one thread takes the tile's ticket (release,
        # GPU scope); the program that draws the last one reads the others' after its acquire.
        tl.debug_barrier()
        ticket = tl.atomic_add(ticket_ptr + tl.program_id(0), 1, sem="acq_rel")
        if ticket == splits - 1:
            _sum_tile_splits(work_ptr, bias_ptr, out_ptr, first_row, M, N, splits, 16 * ROW_TILES, HAS_BIAS, BF16_BITS)
            tl.store(ticket_ptr + tl.program_id(0), 0)  # zero again for the next launch on this stream


@triton.jit
def _sum_tile_splits(
    work_ptr,
    bias_ptr,
    out_ptr,
    first_row,
    M,
    N,
    splits,
    ROWS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BF16_BITS: tl.constexpr,
):
    """``out = sum over splits of work[split] (+ bias)`` for weight rows ``first_row ..
    + ROWS`` and every row of x (at most 32), in split order from zero, rounded once: the
    order, and so the bits, of the separate sum kernel this replaced (bench/notes.md,
    "Issue 38"). The loads bypass L1 (``.cg``): the other programs' sums were written
    from other multiprocessors."""
    n = first_row + tl.arange(0, ROWS)[:, None]
    m = tl.arange(0, 32)[None, :]
    ok = (n < N) & (m < M)
    at = m.to(tl.int64) * N + n
    y = tl.zeros((ROWS, 32), dtype=tl.float32)
    partial = work_ptr + at
    for _ in range(0, splits):
        y += tl.load(partial, mask=ok, other=0.0, cache_modifier=".cg")
        partial += M * N
    if HAS_BIAS:
        y += tl.load(bias_ptr + tl.minimum(n, N - 1)).to(tl.float32)
    store_as(out_ptr + at, y, ok, BF16_BITS)


MMA_CAPABILITY = (8, 0)  # mma.sync m16n8k16 with bf16/fp16 operands: sm_80 and newer


def mma_ptx_ok(device: torch.device) -> bool:
    """Whether the kernel may use its PTX (mma.sync m16n8k16 with bf16/fp16 needs compute
    capability 8.0): compiled for an NVIDIA GPU of sm_80 or newer."""
    if device.type != "cuda" or torch.version.hip is not None or interpreter_active():
        return False
    return torch.cuda.get_device_capability(device) >= MMA_CAPABILITY


def x_readable(x2: torch.Tensor) -> bool:
    """Whether the kernel can read x: bf16/fp16 (B's 8-byte loads of 4 values), contiguous
    columns, rows starting on 8-byte boundaries."""
    return (
        x2.dtype in (torch.bfloat16, torch.float16)
        and x2.stride(1) == 1
        and (x2.shape[0] == 1 or x2.stride(0) % 4 == 0)
        and x2.data_ptr() % 8 == 0
    )


def weight_readable(packed: torch.Tensor, K: int) -> bool:
    """Whether the kernel can read the weight: rows of whole 64-column chunks, the packed
    bytes 8-byte aligned (read as int64)."""
    return K % CHUNK == 0 and packed.data_ptr() % 8 == 0 and packed.numel() % 8 == 0


def splits_for(tiles: int, num_warps: int, warps_per_sm: int, units: int, multiprocessors: int) -> int:
    """K splits so that the grid's ``tiles * splits`` programs of ``num_warps`` warps give
    about ``warps_per_sm`` warps to each multiprocessor, each warp still taking at least
    one of K's ``units`` (chunks, or runs of 4 chunks with ABSMAX_QUADS)."""
    wanted = max(1, round(warps_per_sm * multiprocessors / (tiles * num_warps)))
    return max(1, min(wanted, units // num_warps, 64))


def gemm_4bit_mma(
    x2: torch.Tensor,
    packed: torch.Tensor,
    absmax: torch.Tensor,
    out: torch.Tensor,
    *,
    bias: torch.Tensor | None,
    blocksize: int,
    nested_absmax: torch.Tensor,
    nested_code: torch.Tensor,
    nested_blocksize: int,
    offset: float,
    double_quant: bool,
    code: torch.Tensor,
    multiprocessors: int,
) -> torch.Tensor:
    """``out = x2 @ W^T + bias`` for x2 [M <= 32, K] (``x_readable``), W (N, K)
    (``weight_readable``), ``out`` [M, N] in x2's dtype."""
    plan_gemm_4bit_mma(
        x2,
        packed,
        absmax,
        out.shape[1],
        has_bias=bias is not None,
        blocksize=blocksize,
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=nested_blocksize,
        offset=offset,
        double_quant=double_quant,
        code=code,
        multiprocessors=multiprocessors,
    )(x2, out, bias)
    return out


def plan_gemm_4bit_mma(
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
) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]:
    """The launches of ``gemm_4bit_mma`` for x like ``x2`` (dtype, shape, row stride,
    alignment), decided and bound once: ``plan(x2, out, bias)``."""
    M, K = x2.shape
    ptx = mma_ptx_ok(x2.device)
    x_groups = math.ceil(M / 8)
    if x2.device.type == "cpu":
        row_tiles, num_warps, warps_per_sm = _INTERPRETER_CONFIG[x_groups]
    elif N < NARROW_N and x_groups in _GPU_CONFIG_NARROW:
        row_tiles, num_warps, warps_per_sm = _GPU_CONFIG_NARROW[x_groups]
    else:
        row_tiles, num_warps, warps_per_sm = _GPU_CONFIG[x_groups]
    tiles = math.ceil(N / (16 * row_tiles))
    absmax_quads = ptx and blocksize >= CHUNK and row_tiles == 1
    splits = splits_for(tiles, num_warps, warps_per_sm, K // CHUNK // (RUN if absmax_quads else 1), multiprocessors)
    bf16_bits = x2.dtype == torch.bfloat16 and interpreter_active()
    stride_xm = x2.stride(0) if M > 1 else K
    pairs = packed.view(torch.int64)
    device = x2.device
    gemm = BoundLaunch(
        _gemm_4bit_mma_kernel,
        (tiles, splits),
        dict(
            BLOCKSIZE=blocksize,
            NESTED_BLOCKSIZE=nested_blocksize,
            DOUBLE_QUANT=double_quant,
            HAS_BIAS=has_bias,
            BF16_BITS=bf16_bits,
            X_FP16=x2.dtype == torch.float16,
            X_GROUPS=x_groups,
            ROW_TILES=row_tiles,
            NUM_WARPS=num_warps,
            SPLIT_SUMS=splits > 1,
            PTX=ptx,
            X_16B=ptx and x2.data_ptr() % 16 == 0 and stride_xm % 8 == 0,
            ABSMAX_QUADS=absmax_quads,
            num_warps=num_warps,
        ),
    )
    fixed, nested = (pairs, absmax, code), (nested_absmax, nested_code)
    fixed_pointers, nested_pointers = pointers(fixed), pointers(nested)  # for the bound launches
    split_sums = SplitSums(splits, tiles, M, N, device)

    def run(x2: torch.Tensor, out: torch.Tensor, bias: torch.Tensor | None) -> None:
        bound = gemm.bound
        p, a, c = fixed_pointers if bound else fixed
        nested_args = nested_pointers if bound else nested
        out_arg = out.view(torch.int16) if bf16_bits else out
        work, ticket = split_sums.buffers(out_arg, a)
        gemm(
            x2,
            p,
            a,
            c,
            bias if bias is not None else a,
            out_arg,
            work,
            ticket,
            *nested_args,
            offset,
            M,
            N,
            K,
            stride_xm,
            1,
        )

    def native(x: torch.Tensor, bias: torch.Tensor | None, out_shape: tuple[int, ...]) -> object:
        if bf16_bits:
            return None
        p, a, c = fixed_pointers
        args = (
            None,
            p,
            a,
            c,
            a,
            None,
            None,
            None if splits > 1 else a,
            *nested_pointers,
            offset,
            M,
            N,
            K,
            stride_xm,
            1,
        )
        roles = {"x": 0, "bias": 4, "out": 5}
        if splits == 1:
            return gemm.native(args, roles, x, bias, out_shape)
        roles.update(work=6, counters=7)
        return gemm.native(args, roles, x, bias, out_shape, work_numel=splits * M * N, counter_numel=tiles)

    run.native = native  # type: ignore[attr-defined]
    return run
