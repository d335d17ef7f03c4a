"""Blockwise 4-bit quantization into bitsandbytes' packed layout, as a Triton kernel.

Quantizing is what every user of a 4-bit model pays at load time, so our backend does it
on the device with a kernel of its own, not with the reference quantizer it is checked
against. Layout written (the one ``nf4_dequant`` reads): the weight flattened in C order,
block ``b`` of ``blocksize`` consecutive elements stores ``absmax[b] = max |w|`` in fp32,
element ``2j`` in the HIGH nibble of byte ``j``, ``2j + 1`` in the low one (an odd numel
pads the last low nibble with 0).

The code of an element is the reference's (``reference.bnb4.quantize``): the nearest table
value to ``s = w / absmax`` (0 in an all-zero block), a tie on a midpoint going to the
LOWER value, and FP4's sign bit kept on a negative value that rounds to zero. The kernel
decides exactly, never by an fp32 ``w / absmax``: the midpoints ``m`` of the table are
taken in float64 (each the mean of two fp32 values: at most 29 significant bits), so
``m * absmax`` (absmax an fp32 value, 24 bits) is exact in float64, and ``w > m * absmax``
is the exact comparison ``s > m``. That is also what the reference's rounded float64
quotient decides: ``w - m * absmax`` is a nonzero multiple of a grid at most ``2**-49``
of ``|m * absmax|`` apart, more than the half ulp by which the quotient could round onto
``m``. Per block the kernel turns each exact product into the least fp32 value above it,
so each element costs fp32 comparisons only. Subnormal and near-fp32-max weights stay
exact (float64's range holds every such product), so every finite input gets a finite,
faithful state.

The table is data (``CodeBoundaries``): NF4 and FP4 share the kernel, and a test can hand
it wrong boundaries to show that the conformance suite notices (``tests/zoo.py``).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from qconform_triton_nf4.kernels.nf4_dequant import SUPPORTED_BLOCKSIZES, check_launchable, interpreter_active

IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Elements one program quantizes (a power of two >= blocksize) and its warps. GPU: a few
# thousand elements per program; interpreter: few, large programs (each is a NumPy step).
_GPU_TILE = (4096, 4)
_INTERPRETER_TILE = (16384, 1)


@dataclass(frozen=True)
class CodeBoundaries:
    """How a 16-entry code table partitions the scaled line, as the kernel takes it.

    ``midpoints`` (float64, ascending): between each pair of adjacent distinct table values;
    an element's rank is how many of them lie strictly below its scaled value.
    ``rank_codes`` (int32): the code stored for each rank (the lowest code of that value).
    ``zero_rank``: the rank of scaled value 0 (an all-zero block). ``negative_zero_code``:
    the code a negative value of rank ``zero_rank`` takes (FP4's sign bit), or -1 if the
    table has a single zero code.
    """

    midpoints: torch.Tensor
    rank_codes: torch.Tensor
    zero_rank: int
    negative_zero_code: int

    def to(self, device: torch.device) -> CodeBoundaries:
        return CodeBoundaries(
            self.midpoints.to(device), self.rank_codes.to(device), self.zero_rank, self.negative_zero_code
        )


def code_boundaries(code: torch.Tensor) -> CodeBoundaries:
    """The boundaries of a float32[16] code table (NF4's, FP4's or any other).

    Equal values (FP4's +0 at code 0 and -0 at code 8, both stored as 0.0) form one rank
    whose code is the lower one; the higher one is the negative zero.
    """
    values = [float(v) for v in code.detach().cpu().to(torch.float32).reshape(-1).tolist()]
    if len(values) != 16:
        raise ValueError(f"kernels.code_boundaries: a 4-bit code table has 16 entries, got {len(values)}")
    order = sorted(range(16), key=lambda c: (values[c], c))
    distinct: list[float] = []
    rank_codes: list[int] = []
    negative_zero = -1
    for c in order:
        if distinct and values[c] == distinct[-1]:
            if values[c] == 0.0:
                negative_zero = c
            continue
        distinct.append(values[c])
        rank_codes.append(c)
    midpoints = [(a + b) / 2 for a, b in itertools.pairwise(distinct)]  # exact: float64 mean of two float32
    return CodeBoundaries(
        midpoints=torch.tensor(midpoints, dtype=torch.float64),
        rank_codes=torch.tensor(rank_codes, dtype=torch.int32),
        zero_rank=sum(m < 0 for m in midpoints),
        negative_zero_code=negative_zero,
    )


@triton.jit
def _threshold(exact):
    """The least fp32 value above ``exact`` (float64, any shape): rounded to nearest, which
    may lie below it, then one fp32 step up where it does not lie above."""
    rounded = exact.to(tl.float32)
    bits = rounded.to(tl.int32, bitcast=True)
    next_up = (bits + tl.where(rounded < 0, -1, 1)).to(tl.float32, bitcast=True)
    return tl.where(rounded.to(tl.float64) <= exact, next_up, rounded)


@triton.jit
def _emulated_ranks(w, scale, midpoints_ptr, NUM_MIDPOINTS: tl.constexpr):
    """The interpreter's ranks of ``w`` ([R, B] fp32, per-block ``scale`` [R, 1] float64):
    every midpoint's threshold at once ([R, 16], the compiled loop's arithmetic) and one
    comparison of [R, B, 16], summed. Why: in Triton's interpreter every operation costs
    about the same at any width, and the compiled loop's 15 steps of 8 operations were most
    of a launch (a cProfile of the triton-nf4 suites: 998 quantize launches, 115 of 383 s).
    A 4-bit table has at most 15 midpoints; the 16th lane is masked out."""
    k = tl.arange(0, 16)
    used = k < NUM_MIDPOINTS
    threshold = _threshold(tl.load(midpoints_ptr + k, mask=used, other=0.0)[None, :] * scale)  # [R, 16]
    above = (w[:, :, None] >= threshold[:, None, :]) & used[None, None, :]
    return tl.sum(above.to(tl.int32), axis=2)


# Lengths are not specialized (as in nf4_dequant): a conformance run draws many lengths.
@triton.jit(do_not_specialize=["numel", "num_blocks"])
def _quantize_4bit_kernel(
    weight_ptr,
    midpoints_ptr,
    rank_codes_ptr,
    packed_ptr,
    absmax_ptr,
    numel,
    num_blocks,
    zero_rank,
    negative_zero_code,
    NUM_MIDPOINTS: tl.constexpr,
    BLOCKSIZE: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    SIGNED_ZERO: tl.constexpr,
    BF16_BITS: tl.constexpr,
    MASKED: tl.constexpr,
    EMULATED: tl.constexpr,
):
    # A [blocks, blocksize] tile of elements; int64 only for the program's base offset.
    pid = tl.program_id(0)
    ELEMENTS: tl.constexpr = BLOCKS_PER_PROGRAM * BLOCKSIZE
    first = pid.to(tl.int64) * ELEMENTS
    block_in_program = tl.arange(0, BLOCKS_PER_PROGRAM)
    block = pid * BLOCKS_PER_PROGRAM + block_in_program
    element = block_in_program[:, None] * BLOCKSIZE + tl.arange(0, BLOCKSIZE)[None, :]  # [R, B]
    if MASKED:
        remaining = tl.minimum(numel - first, ELEMENTS).to(tl.int32)
        inside = element < remaining
        w = tl.load(weight_ptr + first + element, mask=inside, other=0)
    else:
        w = tl.load(weight_ptr + first + element)
    if BF16_BITS:  # bf16 read as int16: its bits are the high half of the fp32 value
        w = (w.to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        w = w.to(tl.float32)
    # max |w| is exact in fp32 (every input dtype widens exactly). A block holding NaN
    # stores NaN (a plain max may drop it), so that the caller sees and refuses it.
    absmax = tl.max(tl.abs(w), axis=1)  # [R]
    absmax = tl.where(tl.max((w != w).to(tl.int32), axis=1) > 0, float("nan"), absmax)  # noqa: PLR0124 - NaN test
    if MASKED:
        tl.store(absmax_ptr + block, absmax, mask=block < num_blocks)
    else:
        tl.store(absmax_ptr + block, absmax)
    # rank = #{midpoints m : w > m * absmax}. Per block, m * absmax is exact in float64
    # and becomes the least fp32 value above it, so that per element one fp32 comparison
    # decides exactly: w > m * absmax  <=>  w >= threshold (w is an fp32 value).
    scale = absmax.to(tl.float64)[:, None]  # [R, 1]
    if EMULATED:
        rank = _emulated_ranks(w, scale, midpoints_ptr, NUM_MIDPOINTS)
    else:
        rank = tl.zeros((BLOCKS_PER_PROGRAM, BLOCKSIZE), dtype=tl.int32)
        for k in tl.static_range(NUM_MIDPOINTS):
            rank += (w >= _threshold(tl.load(midpoints_ptr + k) * scale)).to(tl.int32)
    rank = tl.where(scale > 0, rank, zero_rank)  # an all-zero block scales to 0
    codes = tl.load(rank_codes_ptr + rank)
    if SIGNED_ZERO:
        codes = tl.where((rank == zero_rank) & (w < 0), negative_zero_code, codes)
    if MASKED:
        codes = tl.where(inside, codes, 0)  # the padding nibble of an odd numel is 0
    # Pair element 2j (high nibble) with 2j + 1 (low nibble): blocksize is even.
    high, low = tl.split(tl.reshape(codes, (BLOCKS_PER_PROGRAM, BLOCKSIZE // 2, 2)))
    packed = ((high << 4) | low).to(tl.uint8)
    byte = block_in_program[:, None] * (BLOCKSIZE // 2) + tl.arange(0, BLOCKSIZE // 2)[None, :]
    if MASKED:
        tl.store(packed_ptr + first // 2 + byte, packed, mask=2 * byte < remaining)
    else:
        tl.store(packed_ptr + first // 2 + byte, packed)


def quantize_4bit(
    weight: torch.Tensor, *, blocksize: int, boundaries: CodeBoundaries
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(packed uint8[ceil(numel / 2)], absmax float32[ceil(numel / blocksize)])`` of
    ``weight`` (bf16, fp16 or fp32, any shape and strides; read in C order) on its device.

    Raises ValueError for a weight with NaN or Inf entries: the 4-bit formats have no code
    for them, and a non-finite absmax would decode every element of its block to NaN.
    """
    where = "kernels.quantize_4bit"
    if blocksize not in SUPPORTED_BLOCKSIZES:
        raise ValueError(f"{where}: blocksize {blocksize} is not one of {SUPPORTED_BLOCKSIZES}")
    if weight.dtype not in IN_DTYPES:
        raise ValueError(f"{where}: weight dtype must be one of {IN_DTYPES}, got {weight.dtype}")
    device = weight.device
    flat = weight.detach().reshape(-1).contiguous()  # C order, whatever the strides
    # bf16 is widened from its bits: Triton's interpreter flushes bf16 subnormals when it
    # converts (3.9), and the shift is as cheap as the conversion when compiled.
    bf16_bits = weight.dtype == torch.bfloat16
    numel = flat.numel()
    num_blocks = math.ceil(numel / blocksize)
    packed = torch.empty((numel + 1) // 2, dtype=torch.uint8, device=device)
    absmax = torch.empty(num_blocks, dtype=torch.float32, device=device)
    if numel == 0:
        return packed, absmax
    check_launchable(device, where)
    elements_per_program, num_warps = _GPU_TILE if device.type != "cpu" else _INTERPRETER_TILE
    blocks_per_program = max(1, elements_per_program // blocksize)
    if num_blocks + blocks_per_program >= 2**31:
        raise ValueError(f"{where}: {num_blocks} blocks exceed the kernel's int32 block index; use a larger blocksize")
    bounds = boundaries.to(device)
    grid = (math.ceil(num_blocks / blocks_per_program),)
    _quantize_4bit_kernel[grid](
        flat.view(torch.int16) if bf16_bits else flat,
        bounds.midpoints,
        bounds.rank_codes,
        packed,
        absmax,
        numel,
        num_blocks,
        boundaries.zero_rank,
        max(boundaries.negative_zero_code, 0),
        NUM_MIDPOINTS=bounds.midpoints.numel(),
        BLOCKSIZE=blocksize,
        BLOCKS_PER_PROGRAM=blocks_per_program,
        SIGNED_ZERO=boundaries.negative_zero_code >= 0,
        BF16_BITS=bf16_bits,
        MASKED=numel % (blocks_per_program * blocksize) != 0,
        EMULATED=interpreter_active(),
        num_warps=num_warps,
    )
    if device.type == "meta":  # the compile check's replay: launches are captured, there are no values
        return packed, absmax
    bad = ~torch.isfinite(absmax)
    if bool(bad.any()):
        first_bad = int(bad.nonzero()[0])
        raise ValueError(
            f"{where}: the weight has NaN or Inf entries (first in block {first_bad}, elements "
            f"{first_bad * blocksize}..{min(numel, (first_bad + 1) * blocksize) - 1} of the flattened "
            "weight); the 4-bit formats have no code for them"
        )
    return packed, absmax
