"""Blockwise 4-bit dequantization of bitsandbytes' packed bytes, as a Triton kernel.

Layout read (bitsandbytes ``quantize_4bit``, verified against 0.50.2 on CPU): the weight is
flattened; flat element ``e`` lives in byte ``e // 2``, even ``e`` in the HIGH nibble; block
``e // blocksize`` scales it by ``absmax[e // blocksize]``; the last block may be partial and
numel may be odd (the last low nibble is then padding). Double quantization stores absmax as
uint8 codes: ``absmax[b] = nested_code[c[b]] * nested_absmax[b // nested_blocksize] + offset``
(fp32 product, then fp32 add, as bitsandbytes does it in two steps).

value = fp32(code[nibble] * absmax[block]) rounded once (to nearest even) to the output
dtype, which is what bitsandbytes computes, so the result is bit-identical to it; the kernel is launched with fp-fusion off so that the double-quant
``* + offset`` is not contracted into an FMA and stays bit-identical on GPU too.

Blocksize is even (>= 32), so both nibbles of a byte share one block: the kernel works on a
2-D tile of ``[blocks, blocksize // 2]`` bytes, loads absmax once per block row and emits both
nibbles of every byte with one interleave.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch
import triton
import triton.language as tl

from qconform_triton_nf4.kernels.launch import BoundLaunch

SUPPORTED_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

# Bytes of packed weight one program handles (a power of two >= blocksize // 2).
# GPU: enough work per program to hide latency; interpreter: few, large programs
# (it loops over the grid in Python, and each program is a vectorized NumPy step).
_GPU_TILE = (2048, 4)  # (bytes per program, num_warps)
_INTERPRETER_TILE = (8192, 1)


@triton.jit
def lookup(table, index):
    """``table[index]`` for a 1-D register tensor ``table`` and an int32 ``index`` of any shape.

    Compiled, this is a shared-memory gather (``tl.gather``): 32-bit addresses and no
    global load, so a loop that Triton software-pipelines does not stage it like the
    weight bytes (a ``tl.load`` from a global table would be copied to shared memory per
    element, measured in bench/notes.md v3).
    """
    flat = tl.reshape(index, (index.numel,))
    return tl.reshape(tl.gather(table, flat, 0), index.shape)


@triton.jit
def load_block_absmax(
    absmax_ptr,
    block,
    mask,
    nested_absmax_ptr,
    nested_code,
    offset,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
    MASKED: tl.constexpr = True,
    NESTED_TABLE: tl.constexpr = False,
):
    """fp32 absmax of quantization block ``block`` (any shape), decoding double quantization.

    ``block`` indexes from ``absmax_ptr``; with double quantization the nested group is
    ``block // NESTED_BLOCKSIZE`` from ``nested_absmax_ptr``, so a caller that advanced
    ``absmax_ptr`` must pass block indices counted from the start. ``mask`` is ignored
    unless MASKED. ``nested_code``: a pointer to the 256 nested code values, or (NESTED_TABLE)
    those values as a register tensor, looked up with ``lookup``.
    """
    if DOUBLE_QUANT:
        if MASKED:
            absmax_code = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
            nested_scale = tl.load(nested_absmax_ptr + block // NESTED_BLOCKSIZE, mask=mask, other=0.0)
        else:
            absmax_code = tl.load(absmax_ptr + block).to(tl.int32)
            nested_scale = tl.load(nested_absmax_ptr + block // NESTED_BLOCKSIZE)
        if NESTED_TABLE:
            nested_value = lookup(nested_code, absmax_code)
        else:
            nested_value = tl.load(nested_code + absmax_code)  # code < 256: always in bounds
        absmax = nested_value * nested_scale + offset
    else:
        if MASKED:
            absmax = tl.load(absmax_ptr + block, mask=mask, other=0.0).to(tl.float32)
        else:
            absmax = tl.load(absmax_ptr + block).to(tl.float32)
    return absmax


@triton.jit
def bf16_bits(values):
    """bf16 bits (0..0xFFFF, in an int32) of fp32 ``values`` rounded to nearest even, with
    integer ops: Triton's interpreter truncates fp32 -> bf16 casts (3.9). A NaN is 0x7FC0."""
    bits = values.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
    return tl.where(values != values, 0x7FC0, rounded).to(tl.int32)


@triton.jit
def store_as(out_ptr, values, mask, BF16_BITS: tl.constexpr, MASKED: tl.constexpr = True):
    """Store fp32 ``values`` rounded to nearest-even in ``out_ptr``'s dtype.

    BF16_BITS (interpreter only): ``out_ptr`` is a bfloat16 buffer viewed as int16 and the
    rounding is done with integer ops, because Triton's interpreter truncates fp32 -> bf16
    casts (3.9). Compiled, the cast itself rounds to nearest even (one cvt.rn per pair of
    values instead of eight integer ops per value, measured in bench/notes.md v3); the two
    differ only in the payload of a NaN (0x7FC0 here, the hardware's 0x7FFF compiled).
    """
    if BF16_BITS:
        stored = bf16_bits(values).to(tl.int16)
    else:
        stored = values.to(out_ptr.dtype.element_ty)
    if MASKED:
        tl.store(out_ptr, stored, mask=mask)
    else:
        tl.store(out_ptr, stored)


# Lengths are not specialized: Triton would otherwise compile a variant per class of
# numel and num_blocks (equal to 1, multiple of 16, other), and a conformance run draws
# many lengths (a default run on the H100: 50 dequantize variants, 31 without; notes
# "Compile census"). The unmasked path, which large weights take, never reads them.
@triton.jit(do_not_specialize=["numel", "num_blocks"])
def _dequantize_4bit_kernel(
    packed_ptr,
    absmax_ptr,
    code_ptr,
    out_ptr,
    nested_absmax_ptr,
    nested_code_ptr,
    offset,
    numel,
    num_blocks,
    HALF_BLOCKSIZE: tl.constexpr,
    BLOCKS_PER_PROGRAM: tl.constexpr,
    NESTED_BLOCKSIZE: tl.constexpr,
    DOUBLE_QUANT: tl.constexpr,
    BF16_BITS: tl.constexpr,
    MASKED: tl.constexpr,
):
    # Index math in int32 relative to the program's first byte (the caller checks that the
    # block count fits); only the program's base offset is int64. MASKED is False when every
    # program is full (numel a multiple of the program's elements): no masks at all.
    pid = tl.program_id(0)
    BYTES: tl.constexpr = BLOCKS_PER_PROGRAM * HALF_BLOCKSIZE
    first_byte = pid.to(tl.int64) * BYTES
    block_in_program = tl.arange(0, BLOCKS_PER_PROGRAM)  # [R]
    block = pid * BLOCKS_PER_PROGRAM + block_in_program
    byte = block_in_program[:, None] * HALF_BLOCKSIZE + tl.arange(0, HALF_BLOCKSIZE)[None, :]  # [R, H]
    element = block_in_program[:, None] * (2 * HALF_BLOCKSIZE) + tl.arange(0, 2 * HALF_BLOCKSIZE)[None, :]
    if MASKED:
        remaining = tl.minimum(numel - 2 * first_byte, 2 * BYTES).to(tl.int32)  # elements left
        packed = tl.load(packed_ptr + first_byte + byte, mask=byte * 2 < remaining, other=0).to(tl.int32)
    else:
        remaining = 2 * BYTES
        packed = tl.load(packed_ptr + first_byte + byte).to(tl.int32)
    absmax = load_block_absmax(
        absmax_ptr,
        block,
        block < num_blocks,
        nested_absmax_ptr,
        nested_code_ptr,
        offset,
        NESTED_BLOCKSIZE,
        DOUBLE_QUANT,
        MASKED,
    )
    # Global-load lookups (L1 hits); a shared-memory gather (``lookup``) measured the same
    # here (bench/notes.md v4): this kernel is bound by its stores.
    high = tl.load(code_ptr + (packed >> 4))  # element 2*byte
    low = tl.load(code_ptr + (packed & 15))  # element 2*byte + 1
    scale = absmax[:, None]
    # Both nibbles of each byte, interleaved: element 2*byte then 2*byte + 1. (Indexing by
    # output element instead, byte = element // 2, measured 30 % slower on H100: bench/notes.md.)
    values = tl.reshape(tl.join(high * scale, low * scale), (BLOCKS_PER_PROGRAM, 2 * HALF_BLOCKSIZE))
    store_as(out_ptr + 2 * first_byte + element, values, element < remaining, BF16_BITS, MASKED)


# Read off the kernel object once, when it is defined: a tool that later wraps the module's
# kernels (bench/compile_census.py does) must not turn a GPU process into an "interpreted"
# one. Until 2026-11-23 this was read at every call, and the census's wrappers made the H100
# runs it measured take the interpreter's paths (no shuffle, bf16 rounded with integer ops).
_BUILT_FOR_INTERPRETER = not isinstance(_dequantize_4bit_kernel, triton.runtime.JITFunction)


def interpreter_active() -> bool:
    """Whether this module's kernels were built for Triton's CPU interpreter.

    Triton (3.6 and 3.9 alike) reads ``TRITON_INTERPRET`` when ``@triton.jit`` *decorates*
    a function, i.e. when this module is first imported: setting the variable later has
    no effect on these kernels. So the answer is read off the kernel object itself.
    """
    return _BUILT_FOR_INTERPRETER


def check_launchable(device: torch.device, where: str) -> None:
    """Raise if the kernels cannot run on ``device`` in this process's Triton mode."""
    if device.type == "cpu" and not interpreter_active():
        raise RuntimeError(
            f"{where}: tensors are on the CPU but the Triton kernels were compiled for a GPU; "
            "set TRITON_INTERPRET=1 in the environment before qconform_triton_nf4.kernels is first "
            "imported to run them in Triton's interpreter, or move the tensors to a GPU"
        )


def check_packed_state(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    blocksize: int,
    numel: int,
    code: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    nested_blocksize: int,
    where: str,
) -> None:
    """Raise ValueError naming the first inconsistency between the state and the shape."""
    if blocksize not in SUPPORTED_BLOCKSIZES:
        raise ValueError(f"{where}: blocksize {blocksize} is not one of {SUPPORTED_BLOCKSIZES}")
    if packed.dtype != torch.uint8:
        raise ValueError(f"{where}: packed must be uint8 (two 4-bit codes per byte), got {packed.dtype}")
    if packed.numel() < (numel + 1) // 2:
        raise ValueError(
            f"{where}: packed has {packed.numel()} bytes but shape needs ceil({numel} / 2) = {(numel + 1) // 2}"
        )
    num_blocks = math.ceil(numel / blocksize)
    if absmax.numel() < num_blocks:
        raise ValueError(
            f"{where}: absmax has {absmax.numel()} entries but {numel} elements in blocks of "
            f"{blocksize} need {num_blocks}"
        )
    if code.numel() != 16 or code.dtype != torch.float32:
        raise ValueError(f"{where}: code must be a float32 table of 16 entries, got {code.dtype}[{code.numel()}]")
    if (nested_absmax is None) != (nested_code is None):
        raise ValueError(f"{where}: pass both nested_absmax and nested_code for double quantization, or neither")
    if nested_absmax is not None:
        assert nested_code is not None
        if absmax.dtype != torch.uint8:
            raise ValueError(f"{where}: double-quantized absmax must be uint8 codes, got {absmax.dtype}")
        if nested_code.numel() != 256 or nested_code.dtype != torch.float32:
            raise ValueError(
                f"{where}: nested_code must be float32[256], got {nested_code.dtype}[{nested_code.numel()}]"
            )
        if nested_blocksize <= 0:
            raise ValueError(f"{where}: nested_blocksize must be positive, got {nested_blocksize}")
        if nested_absmax.dtype != torch.float32 or nested_absmax.numel() < math.ceil(num_blocks / nested_blocksize):
            raise ValueError(
                f"{where}: nested_absmax must be float32 with ceil({num_blocks} / {nested_blocksize}) entries, "
                f"got {nested_absmax.dtype}[{nested_absmax.numel()}]"
            )
    elif absmax.dtype == torch.uint8:
        raise ValueError(f"{where}: absmax is uint8 codes but nested_absmax/nested_code were not given")
    tensors = [packed, absmax, code] + [t for t in (nested_absmax, nested_code) if t is not None]
    devices = {t.device for t in tensors}
    if len(devices) != 1:
        raise ValueError(f"{where}: all state tensors must be on one device, got {sorted(map(str, devices))}")


def nested_args(
    absmax: torch.Tensor,
    nested_absmax: torch.Tensor | None,
    nested_code: torch.Tensor | None,
    offset: float | torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, float, bool]:
    """Kernel arguments for the (optional) double quantization: pointers, offset, flag."""
    if nested_absmax is None or nested_code is None:
        return absmax, absmax, 0.0, False  # placeholders, never read
    offset_value = 0.0 if offset is None else float(offset)
    return nested_absmax.contiguous(), nested_code.contiguous(), offset_value, True


def dequantize_4bit(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    blocksize: int,
    shape: tuple[int, ...],
    code: torch.Tensor,
    out_dtype: torch.dtype,
    nested_absmax: torch.Tensor | None = None,
    nested_code: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize bitsandbytes-packed 4-bit bytes to a ``shape`` tensor of ``out_dtype``.

    ``packed`` may have any shape (it is read flattened); ``code`` is the 16-entry table
    (NF4 or FP4). With ``out`` (contiguous, ``shape``, ``out_dtype``, same device) the result
    is written there and ``out`` is returned.
    """
    shape = tuple(int(s) for s in shape)
    plan = dequantize_4bit_plan(
        packed,
        absmax,
        blocksize=blocksize,
        shape=shape,
        code=code,
        out_dtype=out_dtype,
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=nested_blocksize,
        offset=offset,
    )
    device = packed.device
    if out is None:
        out = torch.empty(shape, dtype=out_dtype, device=device)
    elif tuple(out.shape) != shape or out.dtype != out_dtype or out.device != device or not out.is_contiguous():
        raise ValueError(
            f"kernels.dequantize_4bit: out must be a contiguous {out_dtype} tensor of shape {shape} on {device}, got "
            f"{out.dtype} {tuple(out.shape)} on {out.device} (contiguous={out.is_contiguous()})"
        )
    return plan(out)


def dequantize_4bit_plan(
    packed: torch.Tensor,
    absmax: torch.Tensor,
    *,
    blocksize: int,
    shape: tuple[int, ...],
    code: torch.Tensor,
    out_dtype: torch.dtype,
    nested_absmax: torch.Tensor | None = None,
    nested_code: torch.Tensor | None = None,
    nested_blocksize: int = 256,
    offset: float | torch.Tensor | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """``dequantize_4bit``'s arguments validated and its launch bound: ``plan(out)`` decodes
    into ``out`` and returns it. ``out`` must be a contiguous ``out_dtype`` tensor of
    ``shape`` on the state's device; the plan does not check (``dequantize_4bit`` does)."""
    where = "kernels.dequantize_4bit"
    shape = tuple(int(s) for s in shape)
    numel = math.prod(shape)
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"{where}: out_dtype must be one of {OUT_DTYPES}, got {out_dtype}")
    check_packed_state(
        packed,
        absmax,
        blocksize=blocksize,
        numel=numel,
        code=code,
        nested_absmax=nested_absmax,
        nested_code=nested_code,
        nested_blocksize=nested_blocksize,
        where=where,
    )
    if numel == 0:
        return lambda out: out
    check_launchable(packed.device, where)
    run = plan_dequantize(
        packed,
        absmax,
        out_dtype,
        {
            "blocksize": blocksize,
            "shape": shape,
            "code": code,
            "nested_absmax": nested_absmax,
            "nested_code": nested_code,
            "nested_blocksize": nested_blocksize,
            "offset": offset,
        },
    )

    def planned(out: torch.Tensor) -> torch.Tensor:
        run(out)
        return out

    return planned


def plan_dequantize(
    packed: torch.Tensor, absmax: torch.Tensor, out_dtype: torch.dtype, kernel_args: Mapping[str, Any]
) -> Callable[[torch.Tensor], None]:
    """The launch of ``dequantize_4bit`` for this state and dtype, decided and bound once:
    ``plan(out)`` decodes into ``out`` (contiguous, the state's shape, ``out_dtype`` and
    device; not checked). ``kernel_args``: ``dequantize_4bit``'s keyword arguments from
    ``blocksize`` to ``offset`` (``Nf4State.kernel_args()``). ``dequantize_4bit_plan``'s step
    after its checks: nothing is validated here, and the state holds at least one element."""
    blocksize, nested_blocksize = kernel_args["blocksize"], kernel_args["nested_blocksize"]
    shape = tuple(int(s) for s in kernel_args["shape"])
    code = kernel_args["code"]
    numel = math.prod(shape)
    device = packed.device
    packed_flat = packed.reshape(-1).contiguous()
    absmax_flat = absmax.reshape(-1).contiguous()
    nested_absmax_arg, nested_code_arg, offset_value, double_quant = nested_args(
        absmax_flat, kernel_args["nested_absmax"], kernel_args["nested_code"], kernel_args["offset"]
    )
    half_blocksize = blocksize // 2
    bytes_per_program, num_warps = _GPU_TILE if device.type != "cpu" else _INTERPRETER_TILE
    blocks_per_program = max(1, bytes_per_program // half_blocksize)
    num_blocks = math.ceil(numel / blocksize)
    if num_blocks + blocks_per_program >= 2**31:
        raise ValueError(
            f"kernels.dequantize_4bit: {num_blocks} blocks exceed the kernel's int32 block index; "
            "use a larger blocksize"
        )
    bf16_bits = out_dtype == torch.bfloat16 and interpreter_active()
    launch = BoundLaunch(
        _dequantize_4bit_kernel,
        (math.ceil(num_blocks / blocks_per_program),),
        dict(
            HALF_BLOCKSIZE=half_blocksize,
            BLOCKS_PER_PROGRAM=blocks_per_program,
            NESTED_BLOCKSIZE=nested_blocksize,
            DOUBLE_QUANT=double_quant,
            BF16_BITS=bf16_bits,
            MASKED=numel % (2 * blocks_per_program * half_blocksize) != 0,
            num_warps=num_warps,
            enable_fp_fusion=False,  # keep nested_code * scale + offset two roundings, like bitsandbytes
        ),
    )
    code_arg = code.contiguous()

    def run(out: torch.Tensor) -> None:
        launch(
            packed_flat,
            absmax_flat,
            code_arg,
            out.view(torch.int16) if bf16_bits else out,
            nested_absmax_arg,
            nested_code_arg,
            offset_value,
            numel,
            num_blocks,
        )

    return run
