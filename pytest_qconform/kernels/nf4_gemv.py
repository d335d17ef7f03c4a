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

Every program owns BLOCK_N output features of one row of x and keeps an elementwise fp32
accumulator tile, reduced once after the K loop; the programs for the other rows of x
(at most 16) run next to it and find the packed bytes in L2. With K even (the common case) a byte holds the weights of columns
2j and 2j+1 of one row, so both nibbles are used against x's even and odd columns.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from pytest_qconform.kernels.nf4_dequant import (
    check_launchable,
    check_packed_state,
    load_block_absmax,
    nested_args,
    store_as,
)

MAX_ROWS = 16

# (BLOCK_N, BLOCK_K, num_warps): GPU tiles; the interpreter prefers few, large programs.
_GPU_TILE = (4, 1024, 4)
_INTERPRETER_TILE = (64, 1024, 1)


@triton.jit
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
    EVEN_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # Program (n-block, row m); the M programs of one n-block are adjacent, so the packed
    # bytes come from DRAM once and from L2 for the other rows.
    pid = tl.program_id(0)
    m = pid % M
    n = (pid // M).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    n_ok = n < N
    x_row = x_ptr + m.to(tl.int64) * stride_xm

    if EVEN_K:
        # Row n occupies bytes [n*K/2, (n+1)*K/2); byte j of a row holds columns 2j, 2j+1.
        HALF_K: tl.constexpr = BLOCK_K // 2
        acc = tl.zeros((BLOCK_N, HALF_K), dtype=tl.float32)  # reduced once, after the loop
        row_byte = n[:, None] * (K // 2)
        for k0 in range(0, K, BLOCK_K):
            j = k0 // 2 + tl.arange(0, HALF_K)  # [HK] byte within the row
            w_mask = n_ok[:, None] & (j * 2 < K)[None, :]
            byte = row_byte + j[None, :]  # [BN, HK]
            packed = tl.load(packed_ptr + byte, mask=w_mask, other=0).to(tl.int32)
            absmax = load_block_absmax(
                absmax_ptr, byte // (BLOCKSIZE // 2), w_mask, nested_absmax_ptr, nested_code_ptr, offset,
                NESTED_BLOCKSIZE, DOUBLE_QUANT,
            )
            k = k0 + tl.arange(0, BLOCK_K)  # one contiguous load of x, split into even/odd columns
            x = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
            x_even, x_odd = tl.split(tl.reshape(x, (HALF_K, 2)))
            w_even = tl.load(code_ptr + (packed >> 4)) * absmax
            w_odd = tl.load(code_ptr + (packed & 15)) * absmax
            acc += w_even * x_even[None, :] + w_odd * x_odd[None, :]
    else:
        # Odd K: a row may start in a low nibble; decode each element from its flat index.
        acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)  # [BK]
            w_mask = n_ok[:, None] & (k < K)[None, :]
            flat = n[:, None] * K + k[None, :]  # [BN, BK]
            packed = tl.load(packed_ptr + (flat >> 1), mask=w_mask, other=0).to(tl.int32)
            nibble = (packed >> (4 - 4 * (flat & 1).to(tl.int32))) & 15
            absmax = load_block_absmax(
                absmax_ptr, flat // BLOCKSIZE, w_mask, nested_absmax_ptr, nested_code_ptr, offset,
                NESTED_BLOCKSIZE, DOUBLE_QUANT,
            )
            x = tl.load(x_row + k * stride_xk, mask=k < K, other=0.0).to(tl.float32)
            acc += (tl.load(code_ptr + nibble) * absmax) * x[None, :]

    y = tl.sum(acc, axis=1)  # [BN]
    if HAS_BIAS:
        y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
    store_as(out_ptr + m.to(tl.int64) * N + n, y, n_ok, BF16_BITS)


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

    x: [..., K] bf16/fp16/fp32, any strides, at most 16 rows once the leading dims are
    flattened (larger batches should dequantize once and call a GEMM). Returns
    [..., N] in x.dtype; accumulation is fp32.
    """
    where = "kernels.gemv_4bit"
    if len(shape) != 2:
        raise ValueError(f"{where}: shape must be (N, K) of the weight, got {shape}")
    N, K = (int(s) for s in shape)
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"{where}: x must be bf16, fp16 or fp32, got {x.dtype}")
    if x.dim() == 0 or x.shape[-1] != K:
        raise ValueError(f"{where}: x must be [..., K={K}] for a weight of shape {shape}, got {tuple(x.shape)}")
    check_packed_state(
        packed, absmax, blocksize=blocksize, numel=N * K, code=code, nested_absmax=nested_absmax,
        nested_code=nested_code, nested_blocksize=nested_blocksize, where=where,
    )
    if x.device != packed.device:
        raise ValueError(f"{where}: x is on {x.device} but the packed weight is on {packed.device}")
    if bias is not None and (bias.numel() != N or bias.device != x.device):
        raise ValueError(f"{where}: bias must have N={N} entries on {x.device}, got {bias.numel()} on {bias.device}")
    x2 = x.reshape(-1, K)  # a view whenever the strides allow: the kernel takes strides
    M = x2.shape[0]
    if M > MAX_ROWS:
        raise ValueError(
            f"{where}: x has {M} rows after flattening its leading dims {tuple(x.shape[:-1])}; the fused "
            f"gemv handles at most {MAX_ROWS}: dequantize_4bit the weight and use a matmul instead"
        )
    out = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0 or N == 0:
        return out.reshape(*x.shape[:-1], N)
    if K == 0:
        out.copy_(bias.reshape(1, N).expand(M, N) if bias is not None else torch.zeros_like(out))
        return out.reshape(*x.shape[:-1], N)
    check_launchable(x.device, where)

    absmax_flat = absmax.reshape(-1).contiguous()
    nested_absmax_arg, nested_code_arg, offset_value, double_quant = nested_args(
        absmax_flat, nested_absmax, nested_code, offset
    )
    block_n, block_k, num_warps = _GPU_TILE if x.device.type != "cpu" else _INTERPRETER_TILE
    block_k = min(block_k, max(32, triton.next_power_of_2(K)))
    grid = (math.ceil(N / block_n) * M,)
    _gemv_4bit_kernel[grid](
        x2,
        packed.reshape(-1).contiguous(),
        absmax_flat,
        code.contiguous(),
        bias.reshape(-1).contiguous() if bias is not None else absmax_flat,
        out.view(torch.int16) if x.dtype == torch.bfloat16 else out,
        nested_absmax_arg,
        nested_code_arg,
        offset_value,
        M,
        N,
        K,
        x2.stride(0),
        x2.stride(1),
        BLOCKSIZE=blocksize,
        NESTED_BLOCKSIZE=nested_blocksize,
        DOUBLE_QUANT=double_quant,
        HAS_BIAS=bias is not None,
        BF16_BITS=x.dtype == torch.bfloat16,
        EVEN_K=K % 2 == 0,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
    )
    return out.reshape(*x.shape[:-1], N)
