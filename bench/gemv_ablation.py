"""Where the word kernel's time goes (bench/notes.md v8): time variants of a stripped-down
copy of ``_gemv_4bit_words_kernel`` that leave one stage out, and candidate changes.

The copy keeps only the default GPU path (M=1, bf16 x in 8-byte loads, blocksize 64, no
double quant, no masking, shuffle lookup, next step's words prefetched) and adds knobs:

- LOOKUP: "shfl" as in the package (nibble masked to 4 bits), "shfl5" (no mask: shfl.idx
  reads only the low 5 bits of its lane operand and lanes n and n + 16 hold the same code
  value, so ``word >> shift`` is a valid lane), "none" (the nibble converted to float:
  no shuffle; wrong numbers, timing only).
- XLOAD: "pair" (two 8-byte loads per word, as in the package), "quad" (one 16-byte load
  per word, split in registers), "none" (x loaded once before the loop; wrong numbers).
- WORK: "full", "loads" (every load as in "full", almost no arithmetic; wrong numbers).

Then the v8 candidates (rows, rows2d, rows8, rows9, rows10: 4 weight rows per work item), rows9 with
its decode cut down (DECODE 1: no shuffle, 2: no decode; _row_partial), and "read", which
only sums the packed weight as int32 words: the read floor of this GPU for a Triton kernel.
The v8d probes (bench/notes.md v8d): rows10's x by inline-asm loads (XSPLIT 2), its word
loads' cache modifier (WCACHE) and L2 prefetch of a later step (PF); rows11 (word quads);
rows12 (a step's words, x and absmax loaded AHEAD steps early); rows13 (the weight by TMA
into shared memory STAGES - 1 steps ahead: loads in flight that hold no registers).
The v10 kernels (bench/notes.md v10) put the products on tensor cores (mma.sync
m16n8k16, inline PTX): mma (the codes as bf16 hi + lo pairs, x in column 0 of B), mma2
(more blocks per iteration, loaded further ahead), mma3 (16-byte weight loads, x of lane t
in column t of B so each lane's bytes take one absmax), mma4 (mma3 with x and absmax an
iteration early) and mma5, a timing probe with one lookup per byte.

Variants with wrong numbers are timing probes only; the others are checked against an
fp32 decode before they are timed. Run on the CUDA machine from the repo root:
``PYTHONPATH=. python bench/gemv_ablation.py sweep [NAME_PREFIX ...]`` (JSON lines to stdout and
``$OUT/gemv_ablation.jsonl``) or ``... profile VARIANT`` (three launches, for ncu).
"""
import json
import os
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from bench.gemv_sweep_v6 import CODE, DEVICE, GEN, decode, queued_us, weight
from pytest_qconform.kernels.nf4_gemv import lane_code_table, shuffle_code, word_code_sums, x_value

LOOKUPS = {"shfl": 0, "shfl5": 1, "none": 2}
XLOADS = {"pair": 0, "quad": 1, "none": 2, "pair-next": 3}

WORKS = {"full": 0, "loads": 1}


@triton.jit
def _nibble_code(lane_code, bits, j: tl.constexpr):
    """code[nibble j of the uint32 words ``bits``] (byte j // 2, its high nibble for even j)
    by the package's warp shuffle."""
    return shuffle_code(lane_code, bits >> (8 * (j // 2) + 4 * (1 - j % 2)))


@triton.jit
def _lane_code_and_accumulators(words, code_ptr, WORDS: tl.constexpr):
    """Each lane's code[lane % 16] as int32 bits (the shuffle's table; the lane id is taken
    with ``words``' layout) and 4 zeroed [WORDS] row accumulators."""
    lane_code = lane_code_table(words, code_ptr)
    zeros = tl.zeros((WORDS,), dtype=tl.float32)
    return lane_code, zeros, zeros, zeros, zeros


@triton.jit
def _absmax_at(absmax_row, k0, GROUPS: tl.constexpr, GROUP: tl.constexpr, SHAPE: tl.constexpr):
    """absmax of the step at column k0: [BN, G] (SHAPE "2d", "sum") or [BN, G, GROUP] with
    each value repeated over its group's words (SHAPE "3d")."""
    block = k0 // 64 + tl.arange(0, GROUPS)
    if SHAPE == "3d":
        values = tl.load(absmax_row[:, :, None] + block[None, :, None] + 0 * tl.arange(0, GROUP)[None, None, :])
    else:
        values = tl.load(absmax_row + block[None, :])
    return values


@triton.jit
def _x_at(x_quads, k0, group_word, XLOAD: tl.constexpr):
    """x of the step at column k0 as two int64 per word (four 16-bit floats each)."""
    if XLOAD == 1:
        pair = (k0 // 4 + 2 * group_word)[:, :, None] + tl.arange(0, 2)[None, None, :]
        low, high = tl.split(tl.load(x_quads + pair))
    else:
        low = tl.load(x_quads + (k0 // 4 + 2 * group_word))
        high = tl.load(x_quads + (k0 // 4 + 2 * group_word + 1))
    return low, high


@triton.jit
def _ablation_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K,
                     BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, LOOKUP: tl.constexpr,
                     XLOAD: tl.constexpr, WORK: tl.constexpr, SHAPE: tl.constexpr,
                     ABSMAX_NEXT: tl.constexpr):
    GROUP: tl.constexpr = 8  # words per 64-value block
    GROUPS: tl.constexpr = BLOCK_K // 64
    n0 = tl.program_id(0) * BLOCK_N
    words_per_row = K // 8
    rows = tl.arange(0, BLOCK_N)
    group_word = tl.arange(0, GROUPS)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    word_rel = rows[:, None, None] * words_per_row + group_word[None, :, :]
    first_word = words_ptr + n0.to(tl.int64) * words_per_row
    absmax_row = absmax_ptr + n0.to(tl.int64) * (K // 64) + rows[:, None] * (K // 64)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    acc = tl.zeros((BLOCK_N, GROUPS, GROUP), dtype=tl.float32)
    words = tl.load(first_word + word_rel)
    lane_code = lane_code_table(words, code_ptr)
    next_absmax = _absmax_at(absmax_row, 0, GROUPS, GROUP, SHAPE)
    next_x_low, next_x_high = _x_at(x_quads, 0, group_word, XLOAD)
    for k0 in range(0, K, BLOCK_K):
        w0 = k0 // 8
        current = words
        absmax = next_absmax
        x_low, x_high = next_x_low, next_x_high
        if k0 + BLOCK_K < K:
            words = tl.load(first_word + (w0 + BLOCK_K // 8) + word_rel)
            if ABSMAX_NEXT:
                next_absmax = _absmax_at(absmax_row, k0 + BLOCK_K, GROUPS, GROUP, SHAPE)
            if XLOAD == 3:
                next_x_low, next_x_high = _x_at(x_quads, k0 + BLOCK_K, group_word, XLOAD)
        if not ABSMAX_NEXT:
            absmax = _absmax_at(absmax_row, k0, GROUPS, GROUP, SHAPE)
        if XLOAD == 0 or XLOAD == 1:
            x_low, x_high = _x_at(x_quads, k0, group_word, XLOAD)
        current = current.to(tl.uint32, bitcast=True)
        if WORK == 1:
            partial = (current ^ (x_low ^ x_high).to(tl.uint32)[None, :, :]).to(tl.float32, bitcast=True)
        else:
            partial = tl.zeros((BLOCK_N, GROUPS, GROUP), dtype=tl.float32)
            for j in tl.static_range(8):
                if LOOKUP == 1:
                    lane_src = current >> (8 * (j // 2) + 4 * (1 - j % 2))
                else:
                    lane_src = (current >> (8 * (j // 2) + 4 * (1 - j % 2))) & 15
                if LOOKUP == 2:
                    value = lane_src.to(tl.float32)
                else:
                    value = shuffle_code(lane_code, lane_src)
                quad = x_low if j < 4 else x_high
                xj = x_value(quad, j % 4, tl.bfloat16)
                partial += value * xj[None, :, :]
        if SHAPE == "3d":
            acc += partial * absmax
        elif SHAPE == "sum":
            acc += (tl.sum(partial, axis=2) * absmax)[:, :, None]
        else:
            acc += partial * absmax[:, :, None]
    y = tl.sum(tl.sum(acc, axis=2), axis=1)
    tl.store(out_ptr + n0 + rows, y.to(tl.bfloat16))


@triton.jit
def _rows_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K,
                 ROWS: tl.constexpr, WORDS: tl.constexpr, XSPLIT: tl.constexpr):
    """v8 candidate: ROWS rows per program as separate 1-D tensors of WORDS words each per
    step, so x is loaded and converted once per step and used by every row, with no
    broadcast and no layout conversion. XSPLIT: x read as 2*WORDS contiguous int64 and
    split into each word's low and high quad (else two strided loads)."""
    n0 = tl.program_id(0) * ROWS
    words_per_row = K // 8
    w = tl.arange(0, WORDS)
    first_word = words_ptr + n0.to(tl.int64) * words_per_row
    first_block = absmax_ptr + n0.to(tl.int64) * (K // 64)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    words = tl.load(first_word + w)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(words, code_ptr, WORDS)
    nxt0 = tl.load(first_word + w)
    nxt1 = tl.load(first_word + words_per_row + w)
    nxt2 = tl.load(first_word + 2 * words_per_row + w)
    nxt3 = tl.load(first_word + 3 * words_per_row + w)
    for k0 in range(0, K, 8 * WORDS):
        w0 = k0 // 8
        cur0, cur1, cur2, cur3 = nxt0, nxt1, nxt2, nxt3
        if k0 + 8 * WORDS < K:
            nxt0 = tl.load(first_word + (w0 + WORDS) + w)
            nxt1 = tl.load(first_word + words_per_row + (w0 + WORDS) + w)
            nxt2 = tl.load(first_word + 2 * words_per_row + (w0 + WORDS) + w)
            nxt3 = tl.load(first_word + 3 * words_per_row + (w0 + WORDS) + w)
        if XSPLIT:
            quads = tl.load(x_quads + k0 // 4 + tl.arange(0, 2 * WORDS))
            x_low, x_high = tl.split(tl.reshape(quads, (WORDS, 2)))
        else:
            x_low = tl.load(x_quads + k0 // 4 + 2 * w)
            x_high = tl.load(x_quads + k0 // 4 + 2 * w + 1)
        block = (w0 + w) // 8
        a0 = tl.load(first_block + block)
        a1 = tl.load(first_block + K // 64 + block)
        a2 = tl.load(first_block + 2 * (K // 64) + block)
        a3 = tl.load(first_block + 3 * (K // 64) + block)
        p0 = tl.zeros((WORDS,), dtype=tl.float32)
        p1 = tl.zeros((WORDS,), dtype=tl.float32)
        p2 = tl.zeros((WORDS,), dtype=tl.float32)
        p3 = tl.zeros((WORDS,), dtype=tl.float32)
        u0 = cur0.to(tl.uint32, bitcast=True)
        u1 = cur1.to(tl.uint32, bitcast=True)
        u2 = cur2.to(tl.uint32, bitcast=True)
        u3 = cur3.to(tl.uint32, bitcast=True)
        for j in tl.static_range(8):
            quad = x_low if j < 4 else x_high
            xj = x_value(quad, j % 4, tl.bfloat16)
            v0 = _nibble_code(lane_code, u0, j)
            v1 = _nibble_code(lane_code, u1, j)
            v2 = _nibble_code(lane_code, u2, j)
            v3 = _nibble_code(lane_code, u3, j)
            p0 += v0 * xj
            p1 += v1 * xj
            p2 += v2 * xj
            p3 += v3 * xj
        acc0 += p0 * a0
        acc1 += p1 * a1
        acc2 += p2 * a2
        acc3 += p3 * a3
    tl.store(out_ptr + n0, tl.sum(acc0).to(tl.bfloat16))
    tl.store(out_ptr + n0 + 1, tl.sum(acc1).to(tl.bfloat16))
    tl.store(out_ptr + n0 + 2, tl.sum(acc2).to(tl.bfloat16))
    tl.store(out_ptr + n0 + 3, tl.sum(acc3).to(tl.bfloat16))


@triton.jit
def _rows2d_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K,
                   ROWS: tl.constexpr, WORDS: tl.constexpr, XSPLIT: tl.constexpr):
    """v8 candidate as a [ROWS, WORDS] tile (no manual unrolling)."""
    n0 = tl.program_id(0) * ROWS
    words_per_row = K // 8
    w = tl.arange(0, WORDS)
    r = tl.arange(0, ROWS)
    first_word = words_ptr + n0.to(tl.int64) * words_per_row
    rel = r[:, None] * words_per_row + w[None, :]
    first_block = absmax_ptr + n0.to(tl.int64) * (K // 64) + r[:, None] * (K // 64)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    words = tl.load(first_word + rel)
    lane_code = lane_code_table(words, code_ptr)
    acc = tl.zeros((ROWS, WORDS), dtype=tl.float32)
    for k0 in range(0, K, 8 * WORDS):
        w0 = k0 // 8
        cur = words.to(tl.uint32, bitcast=True)
        if k0 + 8 * WORDS < K:
            words = tl.load(first_word + (w0 + WORDS) + rel)
        x_low = tl.load(x_quads + k0 // 4 + 2 * w)
        x_high = tl.load(x_quads + k0 // 4 + 2 * w + 1)
        a = tl.load(first_block + ((w0 + w) // 8)[None, :])
        p = tl.zeros((ROWS, WORDS), dtype=tl.float32)
        for j in tl.static_range(8):
            quad = x_low if j < 4 else x_high
            xj = x_value(quad, j % 4, tl.bfloat16)
            v = _nibble_code(lane_code, cur, j)
            p += v * xj[None, :]
        acc += p * a
    tl.store(out_ptr + n0 + r, tl.sum(acc, axis=1).to(tl.bfloat16))


@triton.jit
def _row_partial(cur, lane_code, x_low, x_high, DECODE: tl.constexpr):
    """sum_j code[nibble j of each word] * x[8 w + j] for one row's words (no absmax):
    DECODE 0, the package's ``word_code_sums`` with the shuffle. Timing probes with wrong numbers:
    DECODE 1 replaces the shuffle by one full-rate logic op (``nibble | 0x4B000000`` read as
    a float); DECODE 2 decodes nothing (the word's bits as a float times x's first value);
    3 also loads no absmax (_group_accumulate), 4 also no x (_group_step)."""
    if DECODE == 0:
        return word_code_sums(cur, lane_code, None, x_low, x_high, tl.bfloat16, True)
    cur = cur.to(tl.uint32, bitcast=True)
    if DECODE >= 2:
        return cur.to(tl.float32, bitcast=True) * x_value(x_low, 0, tl.bfloat16)
    partial = tl.zeros(cur.shape, dtype=tl.float32)
    for j in tl.static_range(8):
        shifted = cur >> (8 * (j // 2) + 4 * (1 - j % 2))
        partial += ((shifted & 15) | 0x4B000000).to(tl.float32, bitcast=True) * x_value(
            x_low if j < 4 else x_high, j % 4, tl.bfloat16)
    return partial


@triton.jit
def _read_kernel(words_ptr, out_ptr, chunk, BLOCK: tl.constexpr):
    """The read floor of this GPU for Triton: each program sums ``chunk`` contiguous int32
    words, BLOCK at a time (no decode, no x), and stores the sum."""
    start = tl.program_id(0).to(tl.int64) * chunk
    acc = tl.zeros((BLOCK,), dtype=tl.int32)
    for at in range(0, chunk, BLOCK):
        acc += tl.load(words_ptr + start + at + tl.arange(0, BLOCK))
    tl.store(out_ptr + tl.program_id(0), tl.sum(acc).to(tl.float32).to(tl.bfloat16))


@triton.jit(do_not_specialize=["word_step"])
def _rows8_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, words_per_row, word_step,
                  WORDS: tl.constexpr, XPAIR: tl.constexpr, PERSISTENT: tl.constexpr, COALESCE: tl.constexpr,
                  XNEXT: tl.constexpr):
    """v8 candidate: 4 rows per program as separate [WORDS] tensors. COALESCE: word indices
    are multiplied by ``word_step`` (1, not specialized), so Triton cannot prove them
    contiguous and gives thread t the words t, t + 32 * num_warps, ...: each warp-wide word
    load is 128 contiguous bytes and each x load (XPAIR: a word's 16 bytes of x in one
    load) 512 contiguous bytes. PERSISTENT: each program walks row groups pid, pid + grid,
    ... in one flat loop, so the next group's words are in flight while the last step of
    this one is computed. XNEXT (with XPAIR): the next step's x is loaded with its words."""
    if COALESCE:
        w = tl.arange(0, WORDS) * word_step
    else:
        w = tl.arange(0, WORDS)
    steps = words_per_row // WORDS
    groups = N // 4
    if PERSISTENT:
        my_groups = (groups - tl.program_id(0) + tl.num_programs(0) - 1) // tl.num_programs(0)
    else:
        my_groups = 1
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    blocks_per_row = K // 64
    g = tl.program_id(0)
    first = words_ptr + g.to(tl.int64) * 4 * words_per_row
    nxt0 = tl.load(first + w)
    nxt1 = tl.load(first + words_per_row + w)
    nxt2 = tl.load(first + 2 * words_per_row + w)
    nxt3 = tl.load(first + 3 * words_per_row + w)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(nxt0, code_ptr, WORDS)
    x_pair = 2 * w[:, None] + tl.arange(0, 2)[None, :]
    x_next_low, x_next_high = tl.split(tl.load(x_quads + x_pair))
    for i in range(0, my_groups * steps):
        step = i % steps
        w0 = step * WORDS
        cur0, cur1, cur2, cur3 = nxt0, nxt1, nxt2, nxt3
        x_low, x_high = x_next_low, x_next_high
        # the last step re-reads itself: an unconditional load writes straight into the
        # loop-carried registers (a conditional one made ptxas copy them, waiting on DRAM)
        i_next = tl.minimum(i + 1, my_groups * steps - 1)
        g_next = tl.program_id(0) + (i_next // steps) * tl.num_programs(0)
        nxt = words_ptr + g_next.to(tl.int64) * 4 * words_per_row + (i_next % steps) * WORDS + w
        nxt0 = tl.load(nxt)
        nxt1 = tl.load(nxt + words_per_row)
        nxt2 = tl.load(nxt + 2 * words_per_row)
        nxt3 = tl.load(nxt + 3 * words_per_row)
        if XNEXT:
            x_next_low, x_next_high = tl.split(tl.load(x_quads + 2 * (i_next % steps) * WORDS + x_pair))
        elif XPAIR:
            x_low, x_high = tl.split(tl.load(x_quads + 2 * (w0 + w)[:, None] + tl.arange(0, 2)[None, :]))
        else:
            x_low = tl.load(x_quads + 2 * (w0 + w))
            x_high = tl.load(x_quads + 2 * (w0 + w) + 1)
        acc0, acc1, acc2, acc3 = _group_accumulate(acc0, acc1, acc2, acc3, cur0, cur1, cur2, cur3, x_low, x_high,
                                                   lane_code, absmax_ptr, out_ptr, w, i, steps, blocks_per_row, WORDS,
                                                   0)


@triton.jit
def _group_step(words_ptr, x_quads, w, x_pair, i, steps, words_per_row, WORDS: tl.constexpr, DECODE: tl.constexpr):
    """Words of the 4 rows and x of flat step ``i`` (row group pid + (i // steps) * grid);
    DECODE 4 (a timing probe) loads no x: the word indices stand in for it."""
    g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
    at = words_ptr + g.to(tl.int64) * 4 * words_per_row + (i % steps) * WORDS + w
    if DECODE == 4:
        x_low, x_high = w.to(tl.int64), w.to(tl.int64)
    else:
        x_low, x_high = tl.split(tl.load(x_quads + 2 * (i % steps) * WORDS + x_pair))
    return (tl.load(at), tl.load(at + words_per_row), tl.load(at + 2 * words_per_row),
            tl.load(at + 3 * words_per_row), x_low, x_high)


@triton.jit
def _group_accumulate(acc0, acc1, acc2, acc3, w0, w1, w2, w3, x_low, x_high, lane_code, absmax_ptr, out_ptr,
                      w, i, steps, blocks_per_row, WORDS: tl.constexpr, DECODE: tl.constexpr):
    """Add step ``i``'s products to the 4 rows' accumulators; after a group's last step,
    store its 4 outputs and return zeroed accumulators."""
    g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
    blocks = absmax_ptr + g.to(tl.int64) * 4 * blocks_per_row + ((i % steps) * WORDS + w) // 8
    if DECODE >= 3:  # timing probes: no absmax loads
        acc0 += _row_partial(w0, lane_code, x_low, x_high, DECODE)
        acc1 += _row_partial(w1, lane_code, x_low, x_high, DECODE)
        acc2 += _row_partial(w2, lane_code, x_low, x_high, DECODE)
        acc3 += _row_partial(w3, lane_code, x_low, x_high, DECODE)
    else:
        acc0 += _row_partial(w0, lane_code, x_low, x_high, DECODE) * tl.load(blocks)
        acc1 += _row_partial(w1, lane_code, x_low, x_high, DECODE) * tl.load(blocks + blocks_per_row)
        acc2 += _row_partial(w2, lane_code, x_low, x_high, DECODE) * tl.load(blocks + 2 * blocks_per_row)
        acc3 += _row_partial(w3, lane_code, x_low, x_high, DECODE) * tl.load(blocks + 3 * blocks_per_row)
    return _flush_group(acc0, acc1, acc2, acc3, out_ptr, g, i % steps == steps - 1, WORDS)


@triton.jit
def _flush_group(acc0, acc1, acc2, acc3, out_ptr, g, last, SIZE: tl.constexpr):
    """After row group ``g``'s last step (``last``): store its 4 outputs and return zeroed
    [SIZE] accumulators; otherwise return them as they are."""
    if last:
        out = out_ptr + 4 * g
        tl.store(out, tl.sum(acc0).to(tl.bfloat16))
        tl.store(out + 1, tl.sum(acc1).to(tl.bfloat16))
        tl.store(out + 2, tl.sum(acc2).to(tl.bfloat16))
        tl.store(out + 3, tl.sum(acc3).to(tl.bfloat16))
        acc0 = tl.zeros((SIZE,), dtype=tl.float32)
        acc1 = tl.zeros((SIZE,), dtype=tl.float32)
        acc2 = tl.zeros((SIZE,), dtype=tl.float32)
        acc3 = tl.zeros((SIZE,), dtype=tl.float32)
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["word_step"])
def _rows9_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, words_per_row, word_step,
                  WORDS: tl.constexpr, PIPE: tl.constexpr, NUM_STAGES: tl.constexpr, DECODE: tl.constexpr):
    """rows8 (coalesced, x in 16-byte loads, persistent) with the prefetch done without
    register copies. A loop-carried prefetch (``cur = nxt; nxt = load(...)``) needs the new
    load in other registers than the value still in use, so ptxas copies them back at the
    end of the step, and the copy waits for DRAM (v8 profile: 20 % of stalls).
    PIPE 0: two steps per iteration, buffers A and B; A is reloaded once its step is done,
    into its own registers, and has the whole of B's step to arrive. PIPE 1: Triton's
    software pipeliner (tl.range num_stages) stages the loads through shared memory.
    DECODE: see _row_partial (0: the real lookup)."""
    w = tl.arange(0, WORDS) * word_step
    x_pair = 2 * w[:, None] + tl.arange(0, 2)[None, :]
    steps = words_per_row // WORDS
    groups = N // 4
    total = (groups - tl.program_id(0) + tl.num_programs(0) - 1) // tl.num_programs(0) * steps
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    blocks_per_row = K // 64
    a0, a1, a2, a3, ax_low, ax_high = _group_step(words_ptr, x_quads, w, x_pair, 0, steps, words_per_row, WORDS, DECODE)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(a0, code_ptr, WORDS)
    if PIPE == 0:
        b0, b1, b2, b3, bx_low, bx_high = _group_step(words_ptr, x_quads, w, x_pair, 1, steps, words_per_row, WORDS, DECODE)
        for i in range(0, total, 2):
            acc0, acc1, acc2, acc3 = _group_accumulate(acc0, acc1, acc2, acc3, a0, a1, a2, a3, ax_low, ax_high,
                                                       lane_code, absmax_ptr, out_ptr, w, i, steps,
                                                       blocks_per_row, WORDS, DECODE)
            a0, a1, a2, a3, ax_low, ax_high = _group_step(words_ptr, x_quads, w, x_pair, tl.minimum(i + 2, total - 2),
                                                          steps, words_per_row, WORDS, DECODE)
            acc0, acc1, acc2, acc3 = _group_accumulate(acc0, acc1, acc2, acc3, b0, b1, b2, b3, bx_low, bx_high,
                                                       lane_code, absmax_ptr, out_ptr, w, i + 1, steps,
                                                       blocks_per_row, WORDS, DECODE)
            b0, b1, b2, b3, bx_low, bx_high = _group_step(words_ptr, x_quads, w, x_pair, tl.minimum(i + 3, total - 1),
                                                          steps, words_per_row, WORDS, DECODE)
    else:
        for i in tl.range(0, total, num_stages=NUM_STAGES):
            c0, c1, c2, c3, cx_low, cx_high = _group_step(words_ptr, x_quads, w, x_pair, i, steps, words_per_row, WORDS, DECODE)
            acc0, acc1, acc2, acc3 = _group_accumulate(acc0, acc1, acc2, acc3, c0, c1, c2, c3, cx_low, cx_high,
                                                       lane_code, absmax_ptr, out_ptr, w, i, steps,
                                                       blocks_per_row, WORDS, DECODE)


X_ASM = tl.constexpr("ld.global.nc.v2.u64 {$0, $1}, [$2];")
# quad word loads for rows11, by WLOAD: plain, L2 only, no L1 allocation, streaming
WORD_ASM = ["ld.global.v2.u64 {$0, $1}, [$2];", "ld.global.cg.v2.u64 {$0, $1}, [$2];",
            "ld.global.nc.L1::no_allocate.v2.u64 {$0, $1}, [$2];", "ld.global.cs.v2.u64 {$0, $1}, [$2];"]
WCACHES = ["", ".cg"]


@triton.jit
def _load_16_bytes(address, ASM: tl.constexpr):
    """The two int64 at each 16-byte aligned byte ``address`` in one load, in the layout of
    ``address`` (an inline-asm load: Triton's own [n, 2] loads put the halves on two threads)."""
    return tl.inline_asm_elementwise(ASM, "=l,=l,l", [address], dtype=(tl.int64, tl.int64), is_pure=True, pack=1)



@triton.jit
def _prefetch_l2(address):
    """prefetch.global.L2 of each byte ``address``: the line comes into L2 and no register
    waits for it. ptxas places the rows kernels' next-step loads at the end of the loop
    body (after the decode they were meant to overlap; Triton 3.6 SASS), so the loads'
    DRAM latency is exposed every step; a prefetch has no result to sink. Returns a dummy
    tensor (inline asm needs an output)."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [address], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _prefetch_rows_step(words_at, absmax_at, i, steps, row_bytes, blocks_per_row, WORDS: tl.constexpr):
    """Prefetch into L2 every 128-byte line of flat step ``i``'s words of the 4 rows (one
    line per lane) and its absmax lines."""
    LINES: tl.constexpr = WORDS * 4 // 128
    g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
    lane = tl.arange(0, 4 * LINES)
    row = g.to(tl.int64) * 4 + lane // LINES
    _prefetch_l2(words_at + row * row_bytes + (i % steps) * (WORDS * 4) + (lane % LINES) * 128)
    r4 = tl.arange(0, 4)
    _prefetch_l2(absmax_at + ((g.to(tl.int64) * 4 + r4) * blocks_per_row + (i % steps) * (WORDS // 8)) * 4)


@triton.jit
def _pairs_step(pairs_ptr, x_quads, p, x_first, i, steps, pairs_per_row, HALF: tl.constexpr, XSPLIT: tl.constexpr,
                WCACHE: tl.constexpr):
    """rows10: the int64 word pairs ``p`` of the 4 rows at flat step ``i`` and their x, as
    the low and high quads of the pair's first word (a) and second word (b). XSPLIT 0: x
    as two [HALF, 2] loads split in registers (Triton 3.6 loads them with two threads per
    row and converts the layout, as in the package's rows kernel); 1: four 1-D 8-byte
    loads, no conversion; 2: two inline-asm 16-byte loads per pair, in the pairs' layout.
    WCACHE: the word loads' cache modifier ("" or ".cg": L2 only, the weight is read once)."""
    g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
    at = pairs_ptr + g.to(tl.int64) * 4 * pairs_per_row + (i % steps) * HALF + p
    xa_low, xa_high, xb_low, xb_high = _pairs_x(x_quads, p, x_first, i % steps, HALF, XSPLIT)
    return (tl.load(at, cache_modifier=WCACHE), tl.load(at + pairs_per_row, cache_modifier=WCACHE),
            tl.load(at + 2 * pairs_per_row, cache_modifier=WCACHE),
            tl.load(at + 3 * pairs_per_row, cache_modifier=WCACHE), xa_low, xa_high, xb_low, xb_high)


@triton.jit
def _pairs_x(x_quads, p, x_first, step, HALF: tl.constexpr, XSPLIT: tl.constexpr):
    """x of the pairs ``p`` at column step ``step`` (of HALF pairs), as ``_pairs_step``
    returns it: the low and high quads of each pair's first word, then of its second."""
    if XSPLIT == 2:
        x = x_quads.to(tl.int64) + 32 * (step * HALF + p)
        xa_low, xa_high = _load_16_bytes(x, X_ASM)
        xb_low, xb_high = _load_16_bytes(x + 16, X_ASM)
    elif XSPLIT == 0:
        x = x_quads + 4 * step * HALF + x_first
        xa_low, xa_high = tl.split(tl.load(x))
        xb_low, xb_high = tl.split(tl.load(x + 2))
    else:
        x = x_quads + 4 * step * HALF + 4 * p
        xa_low = tl.load(x)
        xa_high = tl.load(x + 1)
        xb_low = tl.load(x + 2)
        xb_high = tl.load(x + 3)
    return xa_low, xa_high, xb_low, xb_high


@triton.jit
def _pair_partial(pair, lane_code, xa_low, xa_high, xb_low, xb_high):
    """sum over the 16 nibbles of an int64 word pair of code * x (little-endian: the low
    32 bits are the first word)."""
    return (_row_partial(pair.to(tl.int32), lane_code, xa_low, xa_high, 0)
            + _row_partial((pair >> 32).to(tl.int32), lane_code, xb_low, xb_high, 0))


@triton.jit
def _pairs_layout(x_ptr, N, K, words_per_row, word_step, WORDS: tl.constexpr):
    """What rows10, rows12 and rows13 derive from their arguments: each thread's pair
    indices and their x quads, steps per row group, this program's flat step count (row
    groups pid, pid + grid, ...), x as int64 quads and absmax blocks per row."""
    p = tl.arange(0, WORDS // 2) * word_step
    x_first = 4 * p[:, None] + tl.arange(0, 2)[None, :]
    steps = words_per_row // WORDS
    groups = N // 4
    total = (groups - tl.program_id(0) + tl.num_programs(0) - 1) // tl.num_programs(0) * steps
    return p, x_first, steps, total, x_ptr.to(tl.pointer_type(tl.int64), bitcast=True), K // 64


@triton.jit(do_not_specialize=["word_step"])
def _rows10_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, words_per_row, word_step,
                   WORDS: tl.constexpr, XSPLIT: tl.constexpr, WCACHE: tl.constexpr, PF: tl.constexpr):
    """rows8 (persistent, coalesced, the next step's words and x loaded ahead) with each
    thread holding pairs of adjacent words as int64: a pair comes in one 8-byte load and
    lies in one quantization block, so it takes one absmax: half the word loads and half
    the absmax loads of rows8/rows9 (v8's ablation: absmax loads cost ~2.2 us). All
    tensors are 1-D [WORDS // 2] in one layout (a 2-D [pairs, 2] tile put the two words of
    a pair on two threads and converted layouts every step, Triton 3.9)."""
    HALF: tl.constexpr = WORDS // 2
    p, x_first, steps, total, x_quads, blocks_per_row = _pairs_layout(x_ptr, N, K, words_per_row, word_step, WORDS)
    pairs_ptr, pairs_per_row = words_ptr.to(tl.pointer_type(tl.int64), bitcast=True), words_per_row // 2
    n0, n1, n2, n3, na_low, na_high, nb_low, nb_high = _pairs_step(pairs_ptr, x_quads, p, x_first, 0, steps,
                                                                   pairs_per_row, HALF, XSPLIT, WCACHE)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(n0.to(tl.int32), code_ptr, HALF)
    for d in tl.static_range(1, PF):
        _prefetch_rows_step(words_ptr.to(tl.int64), absmax_ptr.to(tl.int64), tl.minimum(d, total - 1), steps,
                            words_per_row * 4, blocks_per_row, WORDS)
    for i in range(0, total):
        c0, c1, c2, c3, xa_low, xa_high, xb_low, xb_high = n0, n1, n2, n3, na_low, na_high, nb_low, nb_high
        n0, n1, n2, n3, na_low, na_high, nb_low, nb_high = _pairs_step(
            pairs_ptr, x_quads, p, x_first, tl.minimum(i + 1, total - 1), steps, pairs_per_row, HALF, XSPLIT, WCACHE)
        if PF > 0:
            _prefetch_rows_step(words_ptr.to(tl.int64), absmax_ptr.to(tl.int64), tl.minimum(i + PF, total - 1), steps,
                                words_per_row * 4, blocks_per_row, WORDS)
        g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
        blocks = absmax_ptr + g.to(tl.int64) * 4 * blocks_per_row + (i % steps) * (WORDS // 8) + p // 4
        acc0 += _pair_partial(c0, lane_code, xa_low, xa_high, xb_low, xb_high) * tl.load(blocks)
        acc1 += _pair_partial(c1, lane_code, xa_low, xa_high, xb_low, xb_high) * tl.load(blocks + blocks_per_row)
        acc2 += _pair_partial(c2, lane_code, xa_low, xa_high, xb_low, xb_high) * tl.load(blocks + 2 * blocks_per_row)
        acc3 += _pair_partial(c3, lane_code, xa_low, xa_high, xb_low, xb_high) * tl.load(blocks + 3 * blocks_per_row)
        acc0, acc1, acc2, acc3 = _flush_group(acc0, acc1, acc2, acc3, out_ptr, g, i % steps == steps - 1, HALF)


@triton.jit
def _rows12_step(pairs_ptr, x_quads, absmax_ptr, p, x_first, i, steps, pairs_per_row, blocks_per_row,
                 WORDS: tl.constexpr, XSPLIT: tl.constexpr):
    """rows12: what flat step ``i`` reads, in one tuple: the word pairs of the 4 rows, their
    x (as ``_pairs_step``) and the pairs' absmax of the 4 rows."""
    w0, w1, w2, w3, xa_low, xa_high, xb_low, xb_high = _pairs_step(pairs_ptr, x_quads, p, x_first, i, steps,
                                                                   pairs_per_row, WORDS // 2, XSPLIT, "")
    g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
    blocks = absmax_ptr + g.to(tl.int64) * 4 * blocks_per_row + (i % steps) * (WORDS // 8) + p // 4
    return (w0, w1, w2, w3, xa_low, xa_high, xb_low, xb_high, tl.load(blocks), tl.load(blocks + blocks_per_row),
            tl.load(blocks + 2 * blocks_per_row), tl.load(blocks + 3 * blocks_per_row))


@triton.jit(do_not_specialize=["word_step"])
def _rows12_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, words_per_row, word_step,
                   WORDS: tl.constexpr, XSPLIT: tl.constexpr, AHEAD: tl.constexpr):
    """rows10 with everything a step reads (words, x and absmax) loaded AHEAD steps early.
    ptxas puts the loads of a loop-carried step at the end of the loop body (Triton 3.6
    SASS), so rows10's "next step" loads are issued after the decode they were meant to
    overlap and every step waits on them; loaded two steps ahead, a whole step's decode
    lies between issue and use."""
    HALF: tl.constexpr = WORDS // 2
    p, x_first, steps, total, x_quads, blocks_per_row = _pairs_layout(x_ptr, N, K, words_per_row, word_step, WORDS)
    pairs_ptr, pairs_per_row = words_ptr.to(tl.pointer_type(tl.int64), bitcast=True), words_per_row // 2
    s1 = _rows12_step(pairs_ptr, x_quads, absmax_ptr, p, x_first, 0, steps, pairs_per_row, blocks_per_row, WORDS,
                      XSPLIT)
    if AHEAD == 2:
        s2 = _rows12_step(pairs_ptr, x_quads, absmax_ptr, p, x_first, tl.minimum(1, total - 1), steps, pairs_per_row,
                          blocks_per_row, WORDS, XSPLIT)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(s1[0].to(tl.int32), code_ptr, HALF)
    for i in range(0, total):
        cur = s1
        if AHEAD == 2:
            s1 = s2
            s2 = _rows12_step(pairs_ptr, x_quads, absmax_ptr, p, x_first, tl.minimum(i + 2, total - 1), steps,
                              pairs_per_row, blocks_per_row, WORDS, XSPLIT)
        else:
            s1 = _rows12_step(pairs_ptr, x_quads, absmax_ptr, p, x_first, tl.minimum(i + 1, total - 1), steps,
                              pairs_per_row, blocks_per_row, WORDS, XSPLIT)
        w0, w1, w2, w3, xa_low, xa_high, xb_low, xb_high, a0, a1, a2, a3 = cur
        acc0 += _pair_partial(w0, lane_code, xa_low, xa_high, xb_low, xb_high) * a0
        acc1 += _pair_partial(w1, lane_code, xa_low, xa_high, xb_low, xb_high) * a1
        acc2 += _pair_partial(w2, lane_code, xa_low, xa_high, xb_low, xb_high) * a2
        acc3 += _pair_partial(w3, lane_code, xa_low, xa_high, xb_low, xb_high) * a3
        g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
        acc0, acc1, acc2, acc3 = _flush_group(acc0, acc1, acc2, acc3, out_ptr, g, i % steps == steps - 1, HALF)


@triton.jit
def _quads_step(words_at, x_at, q, i, steps, row_bytes, QUARTER: tl.constexpr, WASM: tl.constexpr):
    """rows11: the quads ``q`` (4 adjacent words, 16 bytes) of the 4 rows at flat step ``i``
    as (first pair, second pair) each, and their 64 bytes of x as 4 (low, high) quads."""
    g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
    at = words_at + g.to(tl.int64) * 4 * row_bytes + (i % steps) * QUARTER * 16 + 16 * q
    x = x_at + (i % steps) * QUARTER * 64 + 64 * q
    return (_load_16_bytes(at, WASM), _load_16_bytes(at + row_bytes, WASM),
            _load_16_bytes(at + 2 * row_bytes, WASM), _load_16_bytes(at + 3 * row_bytes, WASM),
            (_load_16_bytes(x, X_ASM), _load_16_bytes(x + 16, X_ASM),
             _load_16_bytes(x + 32, X_ASM), _load_16_bytes(x + 48, X_ASM)))


@triton.jit
def _quad_partial(quad, lane_code, x):
    """sum over the 32 nibbles of a quad (two int64 pairs) of code * x."""
    first, second = quad
    x0, x1, x2, x3 = x
    return (_pair_partial(first, lane_code, x0[0], x0[1], x1[0], x1[1])
            + _pair_partial(second, lane_code, x2[0], x2[1], x3[0], x3[1]))


@triton.jit(do_not_specialize=["word_step"])
def _rows11_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, words_per_row, word_step,
                   WORDS: tl.constexpr, WASM: tl.constexpr):
    """rows10 with quads: each thread reads 4 adjacent words in one 16-byte load (half a
    quantization block: one absmax per quad) and the quad's 64 bytes of x in four 16-byte
    loads, all by inline asm so every tensor keeps the quads' 1-D layout. Half of rows10's
    word and absmax loads again."""
    QUARTER: tl.constexpr = WORDS // 4
    q = tl.arange(0, QUARTER) * word_step
    words_at = words_ptr.to(tl.int64)
    x_at = x_ptr.to(tl.int64)
    row_bytes = words_per_row * 4
    steps = words_per_row // WORDS
    groups = N // 4
    total = (groups - tl.program_id(0) + tl.num_programs(0) - 1) // tl.num_programs(0) * steps
    blocks_per_row = K // 64
    n0, n1, n2, n3, nx = _quads_step(words_at, x_at, q, 0, steps, row_bytes, QUARTER, WASM)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(n0[0].to(tl.int32), code_ptr, QUARTER)
    for i in range(0, total):
        c0, c1, c2, c3, cx = n0, n1, n2, n3, nx
        n0, n1, n2, n3, nx = _quads_step(words_at, x_at, q, tl.minimum(i + 1, total - 1), steps, row_bytes,
                                         QUARTER, WASM)
        g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
        blocks = absmax_ptr + g.to(tl.int64) * 4 * blocks_per_row + (i % steps) * (WORDS // 8) + q // 2
        acc0 += _quad_partial(c0, lane_code, cx) * tl.load(blocks)
        acc1 += _quad_partial(c1, lane_code, cx) * tl.load(blocks + blocks_per_row)
        acc2 += _quad_partial(c2, lane_code, cx) * tl.load(blocks + 2 * blocks_per_row)
        acc3 += _quad_partial(c3, lane_code, cx) * tl.load(blocks + 3 * blocks_per_row)
        acc0, acc1, acc2, acc3 = _flush_group(acc0, acc1, acc2, acc3, out_ptr, g, i % steps == steps - 1, QUARTER)


@triton.jit
def _absmax_load(blocks, AASM: tl.constexpr):
    """absmax at the fp32 pointers ``blocks``: Triton's load (AASM 0) or an inline-asm
    load, which Triton's pipeliner does not stage through shared memory (AASM 1)."""
    if AASM:
        return tl.inline_asm_elementwise("ld.global.nc.f32 $0, [$1];", "=r,l", [blocks], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.load(blocks)


@triton.jit
def _tma_rows(w_desc, g, step, HALF: tl.constexpr, ROWLOADS: tl.constexpr):
    """rows13: the HALF word pairs at column step ``step`` of the 4 weight rows of group
    ``g``, from the descriptor over the weight as int64 [N, K // 16], as 4 1-D tensors.
    ROWLOADS 1: one [4, HALF] load, its rows taken apart by permute, reshape and two
    splits; 4: four [1, HALF] loads (4 TMA copies), each reshaped to [HALF]."""
    if ROWLOADS == 1:
        tile = w_desc.load([4 * g, step * HALF])
        even, odd = tl.split(tl.reshape(tl.permute(tile, (1, 0)), (HALF, 2, 2)))
        r0, r2 = tl.split(even)
        r1, r3 = tl.split(odd)
    else:
        r0 = tl.reshape(w_desc.load([4 * g, step * HALF]), (HALF,))
        r1 = tl.reshape(w_desc.load([4 * g + 1, step * HALF]), (HALF,))
        r2 = tl.reshape(w_desc.load([4 * g + 2, step * HALF]), (HALF,))
        r3 = tl.reshape(w_desc.load([4 * g + 3, step * HALF]), (HALF,))
    return r0, r1, r2, r3


@triton.jit(do_not_specialize=["word_step"])
def _rows13_kernel(x_ptr, w_desc, absmax_ptr, code_ptr, out_ptr, N, K, words_per_row, word_step,
                   WORDS: tl.constexpr, XSPLIT: tl.constexpr, STAGES: tl.constexpr, ROWLOADS: tl.constexpr,
                   AASM: tl.constexpr):
    """rows10 with the packed weight streamed through shared memory by Hopper TMA. In
    rows10 ptxas issues the "next step" word loads at the end of the loop body, so every
    step waits one DRAM latency, and holding more steps in registers costs warps (v8d).
    Here ``tl.range(num_stages=STAGES)`` makes Triton's pipeliner turn the descriptor
    loads into TMA copies issued STAGES - 1 steps ahead into STAGES - 1 shared-memory
    buffers (one mbarrier per buffer, the 4 rows' copies on one barrier): loads in flight
    hold no registers (one warp, 256 words: 96-127 registers, rows10 128; Triton 3.6).
    A buffer's next copy is issued at the end of the step that reads it, so STAGES 2 (one
    buffer) waits as rows10 does; 3 leaves a whole step between issue and use.
    The pipeliner also stages Triton's own loads through shared memory by cp.async (4-byte
    copies for absmax, like rows9's pipelined variants, which were slow): absmax unless
    AASM 1 (inline-asm loads, which it leaves alone, issued in the step as in rows10), and
    x with XSPLIT 0 (XSPLIT 2's inline-asm x loads are issued in the step). x is not loaded
    a step ahead in registers as in rows10: that compiled to 128-168 registers."""
    HALF: tl.constexpr = WORDS // 2
    p, x_first, steps, total, x_quads, blocks_per_row = _pairs_layout(x_ptr, N, K, words_per_row, word_step, WORDS)
    lane_code, acc0, acc1, acc2, acc3 = _lane_code_and_accumulators(p, code_ptr, HALF)
    for i in tl.range(0, total, num_stages=STAGES):
        g = tl.program_id(0) + (i // steps) * tl.num_programs(0)
        c0, c1, c2, c3 = _tma_rows(w_desc, g, i % steps, HALF, ROWLOADS)
        xa_low, xa_high, xb_low, xb_high = _pairs_x(x_quads, p, x_first, i % steps, HALF, XSPLIT)
        blocks = absmax_ptr + g.to(tl.int64) * 4 * blocks_per_row + (i % steps) * (WORDS // 8) + p // 4
        acc0 += _pair_partial(c0, lane_code, xa_low, xa_high, xb_low, xb_high) * _absmax_load(blocks, AASM)
        acc1 += _pair_partial(c1, lane_code, xa_low, xa_high, xb_low, xb_high) * _absmax_load(
            blocks + blocks_per_row, AASM)
        acc2 += _pair_partial(c2, lane_code, xa_low, xa_high, xb_low, xb_high) * _absmax_load(
            blocks + 2 * blocks_per_row, AASM)
        acc3 += _pair_partial(c3, lane_code, xa_low, xa_high, xb_low, xb_high) * _absmax_load(
            blocks + 3 * blocks_per_row, AASM)
        acc0, acc1, acc2, acc3 = _flush_group(acc0, acc1, acc2, acc3, out_ptr, g, i % steps == steps - 1, HALF)


@triton.jit
def _shfl_bits(lane_table, lane):
    """The int32 ``lane_table`` entry of lane ``lane`` (low 5 bits) by a warp shuffle."""
    return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r",
                                     [lane_table, lane], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dup_halves(pair):
    """(low, low) and (high, high): each 16-bit half of ``pair`` in both halves (PRMT)."""
    low = tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0x1010;", "=r,r", [pair], dtype=tl.int32,
                                    is_pure=True, pack=1)
    high = tl.inline_asm_elementwise("prmt.b32 $0, $1, $1, 0x3232;", "=r,r", [pair], dtype=tl.int32,
                                     is_pure=True, pack=1)
    return low, high


@triton.jit
def _mma16816(a0, a1, a2, a3, b0, b1, c0, c1, c2, c3):
    """D = A B + C of one m16n8k16 bf16 tensor-core product, fp32 accumulators; every
    operand is this lane's fragment register (PTX ISA, mma.m16n8k16 fragment layouts)."""
    return tl.inline_asm_elementwise(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {$0,$1,$2,$3}, {$4,$5,$6,$7}, {$8,$9}, {$10,$11,$12,$13};",
        "=f,=f,=f,=f,r,r,r,r,r,r,f,f,f,f", [a0, a1, a2, a3, b0, b1, c0, c1, c2, c3],
        dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=1)


@triton.jit
def _mma_lanes(code_ptr, one, NW: tl.constexpr, HI_LO: tl.constexpr):
    """Each thread's warp, mma group g (lane // 4) and thread-in-group t (lane % 4), and its
    shuffle table entry: code[lane % 16] as a (bf16 hi, bf16 lo) pair (HI_LO) or as fp32
    bits. Tensors are [32 * NW], one element per thread (arange times a runtime 1, so
    Triton sees no contiguity to vectorize): the mma fragments are the lanes' registers."""
    idx = tl.arange(0, 32 * NW) * one
    lane = idx % 32
    code = tl.load(code_ptr + (lane % 16))
    if HI_LO:
        hi = code.to(tl.bfloat16)
        lo = (code - hi.to(tl.float32)).to(tl.bfloat16)
        table = (hi.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) | (lo.to(tl.int16, bitcast=True).to(tl.int32) << 16)
    else:
        table = code.to(tl.int32, bitcast=True)
    return idx // 32, lane // 4, lane % 4, table


@triton.jit
def _mma_lane_addresses(words_ptr, x_ptr, N, K, g, t):
    """mma3-5: the program's first row r0, the lane's rows (g and g + 8, clamped), the byte
    addresses of its 16-byte pieces of them and of its x, and whether it holds x (g == t)."""
    r0 = tl.program_id(0) * 16
    row0 = tl.minimum(r0 + g, N - 1).to(tl.int64)
    row1 = tl.minimum(r0 + 8 + g, N - 1).to(tl.int64)
    w_at0 = words_ptr.to(tl.int64) + row0 * (K // 2) + 16 * t
    w_at1 = words_ptr.to(tl.int64) + row1 * (K // 2) + 16 * t
    return r0, row0, row1, w_at0, w_at1, x_ptr.to(tl.int64) + 64 * t, (g == t).to(tl.int32)


@triton.jit
def _mma_store_lanes(acc, out_ptr, row0, N, NW: tl.constexpr):
    """mma3-5: rows row0 .. row0 + 7 are the sums of ``acc`` over the warps and the 4
    threads of each group g (2 and 3 hold zeros: D's columns 4-7 are empty)."""
    rows = row0 + tl.arange(0, 8)
    total = tl.sum(tl.sum(tl.reshape(acc, (NW, 8, 4)), axis=2), axis=0)
    tl.store(out_ptr + rows, total.to(tl.bfloat16), mask=rows < N)


@triton.jit
def _mma_block(low, high, xq, d0, d1, d2, d3, lane_table):
    """The 8 tensor-core products of one 64-column block of 16 rows: lane (g, t) holds the
    int64 pair t of rows g (``low``) and g + 8 (``high``); lanes (0, t) hold x of those 16
    columns as 4 int64 quads (``xq``), other lanes zeros. A's register of one nibble is
    its code's (bf16 hi, bf16 lo) from the shuffle table; B's is its x in both halves."""
    for q in tl.static_range(8):
        wl = (low >> (32 * (q // 4))).to(tl.int32)
        wh = (high >> (32 * (q // 4))).to(tl.int32)
        a0 = _shfl_bits(lane_table, wl >> (8 * (q % 4) + 4))
        a1 = _shfl_bits(lane_table, wh >> (8 * (q % 4) + 4))
        a2 = _shfl_bits(lane_table, wl >> (8 * (q % 4)))
        a3 = _shfl_bits(lane_table, wh >> (8 * (q % 4)))
        xpair = (xq[q // 2] >> (32 * (q % 2))).to(tl.int32)
        b0, b1 = _dup_halves(xpair)
        d0, d1, d2, d3 = _mma16816(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3)
    return d0, d1, d2, d3


@triton.jit
def _mma_x(x_quads, pg, t, g):
    """x of block ``pg``'s 16 columns of lane (g, t) as 4 int64 quads, zeros but in lanes 0-3."""
    xo = 16 * pg + 4 * t
    return (tl.load(x_quads + xo, mask=g == 0, other=0), tl.load(x_quads + xo + 1, mask=g == 0, other=0),
            tl.load(x_quads + xo + 2, mask=g == 0, other=0), tl.load(x_quads + xo + 3, mask=g == 0, other=0))


@triton.jit
def _mma_loads(pairs_ptr, x_quads, row0, row1, row2, row3, pg, t, g, pairs_per_row, RG: tl.constexpr):
    """Pairs of block ``pg`` for the lane's 2 * RG rows (row2, row3 repeat row0, row1 when
    RG is 1), and x of the lane's 16 columns as 4 int64 quads (zeros but in lanes 0-3)."""
    at = 4 * pg + t
    w0 = tl.load(pairs_ptr + row0 * pairs_per_row + at)
    w1 = tl.load(pairs_ptr + row1 * pairs_per_row + at)
    if RG == 2:
        w2 = tl.load(pairs_ptr + row2 * pairs_per_row + at)
        w3 = tl.load(pairs_ptr + row3 * pairs_per_row + at)
    else:
        w2 = w0
        w3 = w1
    return w0, w1, w2, w3, _mma_x(x_quads, pg, t, g)


@triton.jit
def _mma_store(acc, out_ptr, row0, N, NW: tl.constexpr):
    """Sum the warps' partial sums of one row octet; lane (g, 0) holds row row0 + g."""
    total = tl.sum(tl.reshape(acc, (NW, 32)), axis=0)
    l32 = tl.arange(0, 32)
    row = row0 + l32 // 4
    tl.store(out_ptr + row, total.to(tl.bfloat16), mask=(l32 % 4 == 0) & (row < N))


@triton.jit(do_not_specialize=["one"])
def _mma_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, one, RG: tl.constexpr,
                NW: tl.constexpr):
    """The gemv on tensor cores (bench/notes.md v10): a program is 16 * RG weight rows, its
    NW warps take the 64-column blocks w, w + NW, ...; per block 8 m16n8k16 products per 16
    rows (A: the codes as bf16 hi + lo pairs, B: x duplicated, in column 0 only), then the
    block's D column 0 times absmax into fp32. One element per thread in every tensor."""
    warp, g, t, lane_table = _mma_lanes(code_ptr, one, NW, True)
    pairs_ptr = words_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    pairs_per_row = K // 16
    blocks = K // 64
    r0 = tl.program_id(0) * 16 * RG
    row0 = tl.minimum(r0 + g, N - 1).to(tl.int64)
    row1 = tl.minimum(r0 + 8 + g, N - 1).to(tl.int64)
    row2 = tl.minimum(r0 + 16 + g, N - 1).to(tl.int64)
    row3 = tl.minimum(r0 + 24 + g, N - 1).to(tl.int64)
    iters = blocks // NW
    n0, n1, n2, n3, nx = _mma_loads(pairs_ptr, x_quads, row0, row1, row2, row3, warp, t, g, pairs_per_row, RG)
    zero = tl.zeros((32 * NW,), dtype=tl.float32)
    acc0 = zero
    acc1 = zero
    acc2 = zero
    acc3 = zero
    for i in range(0, iters):
        pg = warp + NW * i
        c0, c1, c2, c3, cx = n0, n1, n2, n3, nx
        n0, n1, n2, n3, nx = _mma_loads(pairs_ptr, x_quads, row0, row1, row2, row3,
                                        warp + NW * tl.minimum(i + 1, iters - 1), t, g, pairs_per_row, RG)
        d0, d1, d2, d3 = _mma_block(c0, c1, cx, zero, zero, zero, zero, lane_table)
        acc0 += d0 * tl.load(absmax_ptr + row0 * blocks + pg)
        acc1 += d2 * tl.load(absmax_ptr + row1 * blocks + pg)
        if RG == 2:
            e0, e1, e2, e3 = _mma_block(c2, c3, cx, zero, zero, zero, zero, lane_table)
            acc2 += e0 * tl.load(absmax_ptr + row2 * blocks + pg)
            acc3 += e2 * tl.load(absmax_ptr + row3 * blocks + pg)
    _mma_store(acc0, out_ptr, r0, N, NW)
    _mma_store(acc1, out_ptr, r0 + 8, N, NW)
    if RG == 2:
        _mma_store(acc2, out_ptr, r0 + 16, N, NW)
        _mma_store(acc3, out_ptr, r0 + 24, N, NW)


@triton.jit
def _mma_stage(pairs_ptr, x_quads, row0, row1, pg, t, g, pairs_per_row, U: tl.constexpr, XLATE: tl.constexpr):
    """What one iteration reads for blocks pg .. pg + U - 1 (U 1 or 2): each block's pairs of
    the lane's two rows, and x unless XLATE (then loaded where it is used)."""
    at = 4 * pg + t
    a_low = tl.load(pairs_ptr + row0 * pairs_per_row + at)
    a_high = tl.load(pairs_ptr + row1 * pairs_per_row + at)
    if U == 2:
        b_low = tl.load(pairs_ptr + row0 * pairs_per_row + at + 4)
        b_high = tl.load(pairs_ptr + row1 * pairs_per_row + at + 4)
    else:
        b_low = a_low
        b_high = a_high
    if XLATE:
        xa = (a_low, a_low, a_low, a_low)
        xb = xa
    else:
        xa = _mma_x(x_quads, pg, t, g)
        if U == 2:
            xb = _mma_x(x_quads, pg + 1, t, g)
        else:
            xb = xa
    return a_low, a_high, b_low, b_high, xa, xb


@triton.jit
def _mma_stage_sum(stage, acc0, acc1, x_quads, absmax_ptr, row0, row1, blocks, pg, t, g, lane_table, zero,
                   U: tl.constexpr, XLATE: tl.constexpr):
    """Accumulate one iteration's U blocks (``_mma_stage``) into the two rows' fp32 sums."""
    a_low, a_high, b_low, b_high, xa, xb = stage
    if XLATE:
        xa = _mma_x(x_quads, pg, t, g)
    d0, d1, d2, d3 = _mma_block(a_low, a_high, xa, zero, zero, zero, zero, lane_table)
    acc0 += d0 * tl.load(absmax_ptr + row0 * blocks + pg)
    acc1 += d2 * tl.load(absmax_ptr + row1 * blocks + pg)
    if U == 2:
        if XLATE:
            xb = _mma_x(x_quads, pg + 1, t, g)
        e0, e1, e2, e3 = _mma_block(b_low, b_high, xb, zero, zero, zero, zero, lane_table)
        acc0 += e0 * tl.load(absmax_ptr + row0 * blocks + pg + 1)
        acc1 += e2 * tl.load(absmax_ptr + row1 * blocks + pg + 1)
    return acc0, acc1


@triton.jit(do_not_specialize=["one"])
def _mma2_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, one, NW: tl.constexpr,
                 U: tl.constexpr, AHEAD: tl.constexpr, XLATE: tl.constexpr):
    """mma/1 (16 rows per program, NW warps splitting K) with more in flight per warp: U
    adjacent blocks per iteration (warp w takes blocks U (w + NW i) ..), loaded AHEAD
    iterations early (ptxas issues a loop's loads at the end of its body, so AHEAD 1 leaves
    the whole DRAM latency exposed every iteration); x prefetched with the weight or, with
    XLATE, loaded where it is used (16 KB, cached)."""
    warp, g, t, lane_table = _mma_lanes(code_ptr, one, NW, True)
    pairs_ptr = words_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    x_quads = x_ptr.to(tl.pointer_type(tl.int64), bitcast=True)
    pairs_per_row = K // 16
    blocks = K // 64
    r0 = tl.program_id(0) * 16
    row0 = tl.minimum(r0 + g, N - 1).to(tl.int64)
    row1 = tl.minimum(r0 + 8 + g, N - 1).to(tl.int64)
    iters = blocks // (NW * U)
    s1 = _mma_stage(pairs_ptr, x_quads, row0, row1, U * warp, t, g, pairs_per_row, U, XLATE)
    if AHEAD == 2:
        s2 = _mma_stage(pairs_ptr, x_quads, row0, row1, U * (warp + NW * tl.minimum(1, iters - 1)), t, g,
                        pairs_per_row, U, XLATE)
    else:
        s2 = s1
    zero = tl.zeros((32 * NW,), dtype=tl.float32)
    acc0 = zero
    acc1 = zero
    for i in range(0, iters):
        pg = U * (warp + NW * i)
        cur = s1
        if AHEAD == 2:
            s1 = s2
            s2 = _mma_stage(pairs_ptr, x_quads, row0, row1, U * (warp + NW * tl.minimum(i + 2, iters - 1)), t, g,
                            pairs_per_row, U, XLATE)
        else:
            s1 = _mma_stage(pairs_ptr, x_quads, row0, row1, U * (warp + NW * tl.minimum(i + 1, iters - 1)), t, g,
                            pairs_per_row, U, XLATE)
        acc0, acc1 = _mma_stage_sum(cur, acc0, acc1, x_quads, absmax_ptr, row0, row1, blocks, pg, t, g, lane_table,
                                    zero, U, XLATE)
    _mma_store(acc0, out_ptr, r0, N, NW)
    _mma_store(acc1, out_ptr, r0 + 8, N, NW)


@triton.jit
def _v4_load(address):
    """The 16 bytes at each byte ``address`` (16-byte aligned) as two int64, one load per thread."""
    return tl.inline_asm_elementwise("ld.global.v2.u64 {$0, $1}, [$2];", "=l,=l,l", [address],
                                     dtype=(tl.int64, tl.int64), is_pure=True, pack=1)


@triton.jit
def _v4_load_if(address, keep):
    """``_v4_load`` where ``keep`` is nonzero, zeros elsewhere (no load issued there)."""
    return tl.inline_asm_elementwise(
        "{ .reg .pred p; setp.ne.s32 p, $3, 0; mov.b64 $0, 0; mov.b64 $1, 0; @p ld.global.v2.u64 {$0, $1}, [$2]; }",
        "=l,=l,l,r", [address, keep], dtype=(tl.int64, tl.int64), is_pure=True, pack=1)


@triton.jit
def _mma_lane_x(x_at, c, has_x):
    """mma3-5: x of the lane's two 8-byte pieces of chunk ``c`` (4 int64 quads each), zeros
    but in lanes (t, t)."""
    xa0, xa1 = _v4_load_if(x_at + 256 * c, has_x)
    xa2, xa3 = _v4_load_if(x_at + 256 * c + 16, has_x)
    xb0, xb1 = _v4_load_if(x_at + 256 * c + 32, has_x)
    xb2, xb3 = _v4_load_if(x_at + 256 * c + 48, has_x)
    return (xa0, xa1, xa2, xa3), (xb0, xb1, xb2, xb3)


@triton.jit
def _mma_lane_absmax(absmax_ptr, row0, row1, blocks, c, t):
    """mma3-5: absmax of the lane's bytes of chunk ``c`` in its two rows (threads 0-1 of a
    group hold the chunk's first 64-column block, 2-3 its second)."""
    block = 2 * c + (t & 1)
    return tl.load(absmax_ptr + row0 * blocks + block), tl.load(absmax_ptr + row1 * blocks + block)


@triton.jit
def _mma3_products(w, v, xq, d0, d1, d2, d3, e0, e1, e2, e3, lane_table, CHAINS: tl.constexpr):
    """The 4 products of one 8-byte piece (16 nibbles) of rows g (``w``) and g + 8 (``v``)
    whose x is the int64 quads ``xq`` (4 quads, zeros where the lane holds no x); products
    with odd index go to (e0..e3) when CHAINS is 2."""
    for q in tl.static_range(8):
        wl = (w >> (32 * (q // 4))).to(tl.int32)
        wh = (v >> (32 * (q // 4))).to(tl.int32)
        a0 = _shfl_bits(lane_table, wl >> (8 * (q % 4) + 4))
        a1 = _shfl_bits(lane_table, wh >> (8 * (q % 4) + 4))
        a2 = _shfl_bits(lane_table, wl >> (8 * (q % 4)))
        a3 = _shfl_bits(lane_table, wh >> (8 * (q % 4)))
        b0, b1 = _dup_halves((xq[q // 2] >> (32 * (q % 2))).to(tl.int32))
        if CHAINS == 2 and q % 2 == 1:
            e0, e1, e2, e3 = _mma16816(a0, a1, a2, a3, b0, b1, e0, e1, e2, e3)
        else:
            d0, d1, d2, d3 = _mma16816(a0, a1, a2, a3, b0, b1, d0, d1, d2, d3)
    return d0, d1, d2, d3, e0, e1, e2, e3


@triton.jit(do_not_specialize=["one"])
def _mma3_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, one, NW: tl.constexpr,
                 CHAINS: tl.constexpr, AHEAD: tl.constexpr):
    """mma/1 with fewer L1 wavefronts (its profile: L1 data pipe 81 % busy, the loads as
    many wavefronts as the shuffles): each lane reads 16 contiguous bytes of each of its two
    rows (one 128-column chunk per warp and iteration, 64 bytes of a row per request), and
    B holds lane t's x in column t only, so D's column t sums lane t's nibbles alone and
    each lane's bytes need one absmax (lanes 0-1: the chunk's first block, 2-3 its second
    at blocksize 64). x is loaded where it is used, by lanes (t, t) only; the weight
    AHEAD (1 or 2) iterations early. Warp w takes chunks w, w + NW, ..."""
    warp, g, t, lane_table = _mma_lanes(code_ptr, one, NW, True)
    blocks = K // 64
    r0, row0, row1, w_at0, w_at1, x_at, has_x = _mma_lane_addresses(words_ptr, x_ptr, N, K, g, t)
    iters = K // 128 // NW
    n0a, n0b = _v4_load(w_at0 + 64 * warp)
    n1a, n1b = _v4_load(w_at1 + 64 * warp)
    if AHEAD == 2:
        m0a, m0b = _v4_load(w_at0 + 64 * (warp + NW * tl.minimum(1, iters - 1)))
        m1a, m1b = _v4_load(w_at1 + 64 * (warp + NW * tl.minimum(1, iters - 1)))
    zero = tl.zeros((32 * NW,), dtype=tl.float32)
    acc0 = zero
    acc1 = zero
    for i in range(0, iters):
        c = warp + NW * i
        w0a, w0b, w1a, w1b = n0a, n0b, n1a, n1b
        if AHEAD == 2:
            n0a, n0b, n1a, n1b = m0a, m0b, m1a, m1b
            m0a, m0b = _v4_load(w_at0 + 64 * (warp + NW * tl.minimum(i + 2, iters - 1)))
            m1a, m1b = _v4_load(w_at1 + 64 * (warp + NW * tl.minimum(i + 2, iters - 1)))
        else:
            n0a, n0b = _v4_load(w_at0 + 64 * (warp + NW * tl.minimum(i + 1, iters - 1)))
            n1a, n1b = _v4_load(w_at1 + 64 * (warp + NW * tl.minimum(i + 1, iters - 1)))
        xa, xb = _mma_lane_x(x_at, c, has_x)
        d0, d1, d2, d3, e0, e1, e2, e3 = _mma3_products(w0a, w1a, xa, zero, zero, zero, zero,
                                                        zero, zero, zero, zero, lane_table, CHAINS)
        d0, d1, d2, d3, e0, e1, e2, e3 = _mma3_products(w0b, w1b, xb, d0, d1, d2, d3,
                                                        e0, e1, e2, e3, lane_table, CHAINS)
        if CHAINS == 2:
            d0, d2 = (d0 + d1) + (e0 + e1), (d2 + d3) + (e2 + e3)
        else:
            d0, d2 = d0 + d1, d2 + d3
        s0, s1 = _mma_lane_absmax(absmax_ptr, row0, row1, blocks, c, t)  # after the products, as measured
        acc0 += d0 * s0
        acc1 += d2 * s1
    _mma_store_lanes(acc0, out_ptr, r0, N, NW)
    _mma_store_lanes(acc1, out_ptr, r0 + 8, N, NW)


@triton.jit
def _mma4_loads(w_at0, w_at1, x_at, absmax_ptr, row0, row1, blocks, c, t, has_x):
    """Everything one mma4 iteration (chunk ``c``) reads: the lane's 16 bytes of rows g and
    g + 8, its x (4 x 16 bytes, zeros but in lanes (t, t)) and the two rows' absmax."""
    w0a, w0b = _v4_load(w_at0 + 64 * c)
    w1a, w1b = _v4_load(w_at1 + 64 * c)
    xa, xb = _mma_lane_x(x_at, c, has_x)
    s0, s1 = _mma_lane_absmax(absmax_ptr, row0, row1, blocks, c, t)
    return w0a, w0b, w1a, w1b, xa, xb, s0, s1


@triton.jit
def _mma5_products(w, v, xq, d0, d1, d2, d3, lane_table):
    """Timing probe (wrong numbers): mma3's products with one lookup per byte instead of
    one per nibble, as a bf16 code pair per byte would take (a 256-entry table, which a
    32-lane shuffle cannot hold: the shuffle here reads the byte's low 5 bits). A's
    register is the two nibbles' codes, B's the two x values as loaded (no duplication),
    so one m16n8k16 product takes 4 bytes per row and lane."""
    for q in tl.static_range(4):
        wl = (w >> (32 * (q // 2))).to(tl.int32)
        wh = (v >> (32 * (q // 2))).to(tl.int32)
        a0 = _shfl_bits(lane_table, wl >> (16 * (q % 2)))
        a1 = _shfl_bits(lane_table, wh >> (16 * (q % 2)))
        a2 = _shfl_bits(lane_table, wl >> (16 * (q % 2) + 8))
        a3 = _shfl_bits(lane_table, wh >> (16 * (q % 2) + 8))
        xpair = xq[q]
        d0, d1, d2, d3 = _mma16816(a0, a1, a2, a3, xpair.to(tl.int32), (xpair >> 32).to(tl.int32), d0, d1, d2, d3)
    return d0, d1, d2, d3


@triton.jit(do_not_specialize=["one"])
def _mma4_kernel(x_ptr, words_ptr, absmax_ptr, code_ptr, out_ptr, N, K, one, NW: tl.constexpr,
                 CHAINS: tl.constexpr, BYTE_PROBE: tl.constexpr):
    """mma3 with x and absmax loaded an iteration early as well (mma3's profile: long
    scoreboard stalls, the x and absmax loads issued right before their use). BYTE_PROBE:
    the mma5 timing probe, ``_mma5_products`` instead of mma3's (half the lookups, half the
    products, no x duplication), bounding what a byte-indexed bf16 code-pair table could
    give; wrong numbers."""
    warp, g, t, lane_table = _mma_lanes(code_ptr, one, NW, not BYTE_PROBE)
    blocks = K // 64
    r0, row0, row1, w_at0, w_at1, x_at, has_x = _mma_lane_addresses(words_ptr, x_ptr, N, K, g, t)
    iters = K // 128 // NW
    n = _mma4_loads(w_at0, w_at1, x_at, absmax_ptr, row0, row1, blocks, warp, t, has_x)
    zero = tl.zeros((32 * NW,), dtype=tl.float32)
    acc0 = zero
    acc1 = zero
    for i in range(0, iters):
        w0a, w0b, w1a, w1b, xa, xb, s0, s1 = n
        n = _mma4_loads(w_at0, w_at1, x_at, absmax_ptr, row0, row1, blocks, warp + NW * tl.minimum(i + 1, iters - 1),
                        t, has_x)
        if BYTE_PROBE:
            d0, d1, d2, d3 = _mma5_products(w0a, w1a, xa, zero, zero, zero, zero, lane_table)
            d0, d1, d2, d3 = _mma5_products(w0b, w1b, xb, d0, d1, d2, d3, lane_table)
            e0, e1, e2, e3 = zero, zero, zero, zero
        else:
            d0, d1, d2, d3, e0, e1, e2, e3 = _mma3_products(w0a, w1a, xa, zero, zero, zero, zero,
                                                            zero, zero, zero, zero, lane_table, CHAINS)
            d0, d1, d2, d3, e0, e1, e2, e3 = _mma3_products(w0b, w1b, xb, d0, d1, d2, d3,
                                                            e0, e1, e2, e3, lane_table, CHAINS)
        if CHAINS == 2:
            acc0 += ((d0 + d1) + (e0 + e1)) * s0
            acc1 += ((d2 + d3) + (e2 + e3)) * s1
        else:
            acc0 += (d0 + d1) * s0
            acc1 += (d2 + d3) * s1
    _mma_store_lanes(acc0, out_ptr, r0, N, NW)
    _mma_store_lanes(acc1, out_ptr, r0 + 8, N, NW)


def launch(x, words, absmax, out, variant, block_n=16, block_k=512, num_warps=4):
    """One launch of a variant: "lookup/xload/work/absmax" of the stripped-down v7 kernel,
    or "rows/WORDS/XSPLIT" of the v8 candidates (4 rows per program)."""
    N, K = out.numel(), x.numel()
    if variant[0] == "read":  # read/BLOCK; block_n: programs per SM
        programs = block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count
        chunk = words.numel() // programs // int(variant[1]) * int(variant[1])
        _read_kernel[(programs,)](words, out, chunk, BLOCK=int(variant[1]), num_warps=num_warps)
        return out
    if variant[0] == "mma5":  # mma5 (timing probe); num_warps: warps per program (the K split)
        _mma4_kernel[(triton.cdiv(N, 16),)](x, words, absmax, CODE, out, N, K, 1, NW=num_warps, CHAINS=1,
                                            BYTE_PROBE=True, num_warps=num_warps)
        return out
    if variant[0] == "mma4":  # mma4/CHAINS; num_warps: warps per program (the K split)
        _mma4_kernel[(triton.cdiv(N, 16),)](x, words, absmax, CODE, out, N, K, 1, NW=num_warps,
                                            CHAINS=int(variant[1]), BYTE_PROBE=False, num_warps=num_warps)
        return out
    if variant[0] == "mma3":  # mma3/CHAINS/AHEAD; num_warps: warps per program (the K split)
        _mma3_kernel[(triton.cdiv(N, 16),)](x, words, absmax, CODE, out, N, K, 1, NW=num_warps,
                                            CHAINS=int(variant[1]), AHEAD=int(variant[2]), num_warps=num_warps)
        return out
    if variant[0] == "mma2":  # mma2/U/AHEAD/XLATE; num_warps: warps per program (the K split)
        _mma2_kernel[(triton.cdiv(N, 16),)](x, words, absmax, CODE, out, N, K, 1, NW=num_warps, U=int(variant[1]),
                                            AHEAD=int(variant[2]), XLATE=int(variant[3]), num_warps=num_warps)
        return out
    if variant[0] == "mma":  # mma/RG; num_warps: warps per program (the K split)
        _mma_kernel[(triton.cdiv(N, 16 * int(variant[1])),)](x, words, absmax, CODE, out, N, K, 1, RG=int(variant[1]),
                                                             NW=num_warps, num_warps=num_warps)
        return out
    if variant[0] == "rows10":  # rows10/WORDS/XSPLIT[/WCACHE[/PF]]; block_n: programs per SM, or -programs
        grid = -block_n if block_n < 0 else min(N // 4, block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count)
        _rows10_kernel[(grid,)](x, words, absmax, CODE, out, N, K, K // 8, 1, WORDS=int(variant[1]),
                                XSPLIT=int(variant[2]), WCACHE=WCACHES[int(variant[3]) if len(variant) > 3 else 0],
                                PF=int(variant[4]) if len(variant) > 4 else 0, num_warps=num_warps)
        return out
    if variant[0] == "rows13":  # rows13/WORDS/XSPLIT/STAGES[/AASM[/ROWLOADS]]; block_n: programs per SM, or -programs
        grid = -block_n if block_n < 0 else min(N // 4, block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count)
        words_per_step, rowloads = int(variant[1]), int(variant[5]) if len(variant) > 5 else 4
        # the weight as int64 pairs [N, K // 16]; a TMA copy is [4 or 1, WORDS // 2] pairs
        pairs = words.view(torch.int64).view(N, K // 16)
        desc = TensorDescriptor.from_tensor(pairs, [4 if rowloads == 1 else 1, words_per_step // 2])
        _rows13_kernel[(grid,)](x, desc, absmax, CODE, out, N, K, K // 8, 1, WORDS=words_per_step,
                                XSPLIT=int(variant[2]), STAGES=int(variant[3]),
                                AASM=int(variant[4]) if len(variant) > 4 else 0, ROWLOADS=rowloads,
                                num_warps=num_warps)
        return out
    if variant[0] == "rows12":  # rows12/WORDS/XSPLIT/AHEAD[/MAXNREG]; block_n: programs per SM
        grid = min(N // 4, block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count)
        extra = dict(maxnreg=int(variant[4])) if len(variant) > 4 else {}
        _rows12_kernel[(grid,)](x, words, absmax, CODE, out, N, K, K // 8, 1, WORDS=int(variant[1]),
                                XSPLIT=int(variant[2]), AHEAD=int(variant[3]), num_warps=num_warps, **extra)
        return out
    if variant[0] == "rows11":  # rows11/WORDS/WLOAD; block_n: programs per SM
        grid = min(N // 4, block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count)
        _rows11_kernel[(grid,)](x, words, absmax, CODE, out, N, K, K // 8, 1, WORDS=int(variant[1]),
                                WASM=WORD_ASM[int(variant[2])], num_warps=num_warps)
        return out
    if variant[0] == "rows9":  # rows9/WORDS/PIPE/NUM_STAGES[/DECODE]; block_n: programs per SM
        grid = min(N // 4, block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count)
        _rows9_kernel[(grid,)](x, words, absmax, CODE, out, N, K, K // 8, 1, WORDS=int(variant[1]),
                               PIPE=int(variant[2]), NUM_STAGES=int(variant[3]),
                               DECODE=int(variant[4]) if len(variant) > 4 else 0, num_warps=num_warps)
        return out
    if variant[0] == "rows8":  # rows8/WORDS/XPAIR/PERSISTENT/COALESCE[/XNEXT]; block_n: programs per SM
        persistent = variant[3] == "1"
        grid = min(N // 4, block_n * torch.cuda.get_device_properties(DEVICE).multi_processor_count) if persistent else N // 4
        _rows8_kernel[(grid,)](x, words, absmax, CODE, out, N, K, K // 8, 1, WORDS=int(variant[1]),
                               XPAIR=variant[2] == "1", PERSISTENT=persistent, COALESCE=variant[4] == "1",
                               XNEXT=len(variant) > 5 and variant[5] == "1",
                               num_warps=num_warps)
        return out
    if variant[0] in ("rows", "rows2d"):
        kernel = _rows_kernel if variant[0] == "rows" else _rows2d_kernel
        kernel[(N // 4,)](x, words, absmax, CODE, out, N, K, ROWS=4, WORDS=int(variant[1]),
                          XSPLIT=variant[2] == "1", num_warps=num_warps)
        return out
    lookup, xload, work, absmax_mode = variant
    _ablation_kernel[(N // block_n,)](
        x, words, absmax, CODE, out, N, K, BLOCK_N=block_n, BLOCK_K=block_k, LOOKUP=LOOKUPS[lookup],
        XLOAD=XLOADS[xload], WORK=WORKS[work], SHAPE=absmax_mode.split("-")[0],
        ABSMAX_NEXT=absmax_mode.endswith("-next"), num_warps=num_warps,
    )
    return out


V7_TILES = [(16, 512, 4), (16, 512, 8), (32, 512, 8)]
# (variant, tiles (block_n, block_k, num_warps)); the rows kernels take only num_warps.
VARIANTS = [
    ("shfl/pair/full/2d", V7_TILES[:1]),  # the package kernel (v7)
    ("rows8/256/1/1/1/1", [(8, 0, 2)]),  # v8 best: coalesced, persistent, x a step ahead
    ("rows9/256/0/1", [(8, 0, 2), (10, 0, 2)]),  # two buffers, no register copies
    ("rows9/128/0/1", [(16, 0, 1)]),
    ("rows9/256/1/3", [(8, 0, 2), (10, 0, 2), (12, 0, 2)]),  # Triton's pipeliner
    ("rows9/256/1/4", [(8, 0, 2)]),
    ("rows9/512/1/3", [(4, 0, 4), (5, 0, 4)]),
    ("rows9/128/1/3", [(16, 0, 1), (20, 0, 1)]),
    # pairs of adjacent words per thread: half the word and absmax loads
    ("rows8/128/1/1/1/1", [(16, 0, 1)]),  # as the package's kernel: x split from [W, 2] loads
    ("rows8/128/0/1/1/0", [(16, 0, 1)]),  # x in two 1-D 8-byte loads per word
    ("rows10/128/0", [(16, 0, 1)]),
    ("rows10/128/1", [(16, 0, 1)]),
    ("rows10/256/0", [(16, 0, 1), (12, 0, 1), (20, 0, 1), (24, 0, 1), (8, 0, 2), (16, 0, 2)]),
    ("rows10/512/0", [(16, 0, 1), (8, 0, 1), (8, 0, 2)]),
    ("rows10/256/1", [(16, 0, 1), (8, 0, 2)]),
    ("rows10/64/0", [(16, 0, 1)]),
    ("rows10/64/1", [(16, 0, 1)]),
    # x by inline-asm 16-byte loads in the pairs' layout (no layout conversion); weight
    # loads cached in L2 only; quads (4 words, one 16-byte load, one absmax) with each
    # word-load modifier of WORD_ASM
    ("rows10/256/2", [(16, 0, 1), (12, 0, 1), (20, 0, 1), (24, 0, 1)]),
    ("rows10/128/2", [(16, 0, 1)]),
    ("rows10/256/0/0/1", [(16, 0, 1)]),  # flat step i + PF prefetched into L2 (lines, absmax too)
    ("rows10/256/0/0/2", [(16, 0, 1)]),
    ("rows10/256/0/0/3", [(16, 0, 1)]),
    ("rows10/256/2/0/1", [(16, 0, 1)]),
    ("rows10/256/2/0/2", [(16, 0, 1), (20, 0, 1)]),
    ("rows10/256/2/0/3", [(16, 0, 1)]),
    ("rows10/128/2/0/2", [(16, 0, 1), (20, 0, 1)]),
    ("rows10/128/2/0/3", [(16, 0, 1), (20, 0, 1)]),
    ("rows10/128/2/0/4", [(16, 0, 1)]),
    ("rows10/128/0/0/3", [(16, 0, 1)]),
    # more warps in flight: steps split over 2 or 4 warps (56-72 registers instead of
    # 96-128); a negative block_n is the exact program count (1024 divides 2048 groups)
    ("rows10/128/2", [(16, 0, 2), (-1024, 0, 2)]),
    ("rows10/128/0", [(16, 0, 2)]),
    ("rows10/256/2", [(-1024, 0, 4), (-2048, 0, 4)]),
    ("rows10/64/2", [(16, 0, 1)]),
    ("rows12/256/2/1", [(16, 0, 1)]),  # absmax loaded with the words; AHEAD steps ahead
    ("rows12/256/0/1", [(16, 0, 1)]),
    ("rows12/256/2/2", [(16, 0, 1), (12, 0, 1)]),
    ("rows12/128/2/2", [(16, 0, 1), (12, 0, 1), (20, 0, 1)]),
    ("rows12/128/0/2", [(16, 0, 1), (12, 0, 1)]),
    ("rows12/128/2/2/128", [(16, 0, 1)]),
    ("rows12/128/2/1", [(16, 0, 1)]),
    ("rows12/64/2/2", [(16, 0, 1)]),
    ("rows10/256/0/1", [(16, 0, 1)]),
    ("rows10/256/2/1", [(16, 0, 1)]),
    ("rows11/256/0", [(16, 0, 1), (12, 0, 1), (20, 0, 1), (24, 0, 1), (8, 0, 2)]),
    ("rows11/512/0", [(16, 0, 1), (8, 0, 1), (8, 0, 2)]),
    ("rows11/128/0", [(16, 0, 1)]),
    ("rows11/256/1", [(16, 0, 1)]),
    ("rows11/256/2", [(16, 0, 1)]),
    ("rows11/256/3", [(16, 0, 1)]),
    # the weight by TMA into shared memory, STAGES - 1 steps ahead (Triton's pipeliner;
    # STAGES 2 is one buffer, refilled at the end of the step it feeds, as rows10's loads);
    # absmax staged by cp.async (AASM 0) or loaded in the step (1); x staged (XSPLIT 0) or
    # loaded in the step (2). Each tile keeps all its programs resident: programs per SM x
    # (shared memory + 1 KB) <= 228 KB, 64 K registers (Triton 3.6 sizes in the comments)
    ("rows13/256/2/3", [(16, 0, 1), (12, 0, 1), (8, 0, 1), (-1024, 0, 1)]),  # 12 KB, 106 registers
    ("rows13/256/2/2", [(16, 0, 1)]),  # 6 KB, 128 registers
    ("rows13/256/2/4", [(8, 0, 1), (-1024, 0, 1)]),  # 18 KB (12 per SM: 24 bytes too many)
    ("rows13/256/2/5", [(8, 0, 1)]),  # 24 KB
    ("rows13/256/0/2", [(16, 0, 1)]),  # 10 KB, 96 registers
    ("rows13/256/0/3", [(8, 0, 1), (-1024, 0, 1)]),  # 20 KB
    ("rows13/256/2/3/1", [(16, 0, 1), (12, 0, 1), (-1024, 0, 1)]),  # 8 KB, 127 registers
    ("rows13/256/2/4/1", [(16, 0, 1), (12, 0, 1)]),  # 12 KB
    ("rows13/256/2/5/1", [(12, 0, 1), (8, 0, 1)]),  # 16 KB
    ("rows13/256/0/3/1", [(12, 0, 1), (-1024, 0, 1)]),  # 16 KB, 96 registers
    ("rows13/128/2/3", [(16, 0, 1)]),  # 6 KB, 80 registers
    ("rows13/128/2/4", [(16, 0, 1)]),  # 9 KB, 64 registers
    ("rows13/128/2/5", [(16, 0, 1)]),  # 12 KB
    ("rows13/128/0/3", [(16, 0, 1)]),  # 10 KB, 80 registers
    ("rows13/128/2/4/1", [(16, 0, 1)]),  # 6 KB, 64 registers
    ("rows13/128/2/5/1", [(16, 0, 1)]),  # 8 KB
    ("rows13/256/2/3", [(8, 0, 2), (-1024, 0, 2)]),  # two warps: 80 registers
    ("rows13/256/2/4", [(8, 0, 2)]),
    ("rows13/256/2/3/1", [(8, 0, 2)]),
    ("rows13/128/2/4", [(16, 0, 2)]),  # 56 registers
    ("rows13/256/2/3/0/1", [(16, 0, 1)]),  # one [4, pairs] copy per step: 256 layout conversions
    # where the rows kernel's time goes (timing probes, wrong numbers): no shuffle, no
    # decode, no decode and no absmax, none of these and no x
    ("rows9/128/0/1/1", [(16, 0, 1)]),
    ("rows9/128/0/1/2", [(16, 0, 1)]),
    ("rows9/256/0/1/1", [(8, 0, 2)]),
    ("rows9/256/0/1/2", [(8, 0, 2)]),
    ("rows9/128/0/1/3", [(16, 0, 1)]),
    ("rows9/128/0/1/4", [(16, 0, 1)]),
    # v10: tensor cores (mma.sync m16n8k16): the codes as bf16 hi + lo pairs, x in B's
    # column 0; 16 * RG rows per program, its warps (the tile's num_warps) split K
    ("mma/1", [(0, 0, 2), (0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma/2", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    # mma/1 with U blocks per iteration, loaded AHEAD iterations early, x with them or late
    # mma3: 16-byte weight loads per lane, x in column t of B (one absmax per lane), CHAINS
    # independent accumulator chains, the weight AHEAD iterations early
    ("mma3/1/1", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma4/1", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),  # mma3 with x and absmax an iteration early
    ("mma4/2", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma5", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),  # timing probe: one lookup per byte
    ("mma3/2/1", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma3/1/2", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma3/2/2", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma2/1/2/0", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma2/1/2/1", [(0, 0, 4), (0, 0, 8), (0, 0, 16)]),
    ("mma2/2/1/0", [(0, 0, 4), (0, 0, 8)]),
    ("mma2/2/1/1", [(0, 0, 4), (0, 0, 8)]),
    ("mma2/2/2/0", [(0, 0, 4), (0, 0, 8)]),
    ("mma2/2/2/1", [(0, 0, 2), (0, 0, 4), (0, 0, 8)]),
    # the read floor: the packed weight summed as int32 words, nothing else
    ("read/2048", [(4, 0, 4), (8, 0, 4), (2, 0, 8)]),
    ("read/1024", [(8, 0, 4), (16, 0, 2)]),
]


def sweep(only=()):
    """Time every variant (or those whose name starts with one of ``only``)."""
    N = K = 8192
    copies = [weight(N, K) for _ in range(3)]
    ref = decode(N, K, *copies[0], False)
    x = torch.randn(1, K, device=DEVICE, generator=GEN).bfloat16()
    want = (x.float() @ ref.T).reshape(-1)
    scale = (x.float().abs() @ ref.abs().T).reshape(-1)
    log = open(os.path.join(os.environ.get("OUT", "."), "gemv_ablation.jsonl"), "w")
    for name, tiles in VARIANTS:
        if only and not name.startswith(tuple(only)):
            continue
        variant = tuple(name.split("/"))
        for block_n, block_k, num_warps in tiles:
            row = dict(variant=name, tile=[block_n, block_k, num_warps])
            try:
                outs = [torch.empty(N, dtype=torch.bfloat16, device=DEVICE) for _ in copies]
                calls = [(lambda c=c, o=o: launch(x, c[0].view(torch.int32), c[1], o, variant, block_n, block_k,
                                                  num_warps)) for c, o in zip(copies, outs)]
                y = calls[0]()
                row["err"] = ((y.float() - want).abs() / scale).max().item()
                exact = not ("none" in variant or "loads" in variant or variant[0] == "read"
                             or (variant[0] == "rows9" and len(variant) > 4 and variant[4] != "0")
                             or variant[0] == "mma5")
                row["checked"] = exact
                if exact and not row["err"] < 2**-8:
                    row["status"] = "WRONG"
                else:
                    t = queued_us(calls)
                    row.update(status="ok", us=round(t, 2), pct_floor=round(N * K / 2 / 2.9e12 * 1e6 / t * 100, 1))
            except Exception as e:
                row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")


def profile(name, num_warps=4, block_n=16):
    """Three launches of one variant (ncu picks one with --launch-skip)."""
    variant = tuple(name.split("/"))
    N = K = 8192
    packed, absmax, _, _ = weight(N, K)
    x = torch.randn(1, K, device=DEVICE, generator=GEN).bfloat16()
    out = torch.empty(N, dtype=torch.bfloat16, device=DEVICE)
    for _ in range(3):
        launch(x, packed.view(torch.int32), absmax, out, variant, block_n=block_n, num_warps=num_warps)
    torch.cuda.synchronize()


if __name__ == "__main__":
    if sys.argv[1] == "sweep":
        sweep(sys.argv[2:])
    else:
        profile(sys.argv[2], *(int(a) for a in sys.argv[3:]))
