"""Scratch: structure T (x from shared memory as wgmma's A, decoded W^T in shared memory as B)."""
import torch, triton, triton.language as tl

@triton.jit
def _lane_code(code_ptr, like):
    address = tl.full(like.shape, 0, tl.int64) + code_ptr.to(tl.int64, bitcast=True)
    return tl.inline_asm_elementwise(
        "{ .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 15; mul.wide.u32 a, l, 4; "
        "add.s64 a, a, $1; ld.global.nc.b32 $0, [a]; }", "=r,l", [address], dtype=tl.int32, is_pure=True, pack=1)

@triton.jit
def _code(lane_code, nib):
    return tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [lane_code, nib],
                                     dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)

@triton.jit
def gemm_t(x_ptr, packed_ptr, absmax_ptr, code_ptr, out_ptr, work_ptr, M, N, K, stride_xm,
           BLOCKSIZE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
           SPLIT: tl.constexpr, STACK: tl.constexpr):
    pid = tl.program_id(0)
    split = tl.program_id(1)
    tiles_m = tl.cdiv(M, BM)
    tiles_n = tl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    m = pid_m * BM + tl.arange(0, BM)
    n = pid_n * BN + tl.arange(0, BN)
    m_read = tl.minimum(m, M - 1).to(tl.int64)
    n_read = tl.minimum(n, N - 1).to(tl.int64)
    HALF: tl.constexpr = BK // 2
    steps = K // BK
    per_split = tl.cdiv(steps, SPLIT)
    first_step = split * per_split
    last_step = tl.minimum(first_step + per_split, steps)
    k0 = first_step * BK
    if STACK:
        # x's columns in the order (even k, then odd k) of the step: the decoded tile stacks the
        # high nibbles over the low ones, no interleave.
        j = tl.arange(0, BK)
        col = k0 + 2 * (j % HALF) + j // HALF
    else:
        col = k0 + tl.arange(0, BK)
    x_tile = x_ptr + m_read[:, None] * stride_xm + col[None, :]  # [BM, BK]
    byte = tl.arange(0, HALF)
    w_bytes = packed_ptr + (n_read * (K // 2))[None, :] + (k0 // 2 + byte)[:, None]  # [HALF, BN]
    first_flat = n_read * K + k0
    lane_code = _lane_code(code_ptr, tl.zeros((HALF, BN), dtype=tl.int32))
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for _ in range(first_step, last_step):
        xa = tl.load(x_tile)
        packed = tl.load(w_bytes).to(tl.int32) & 255
        scale = tl.load(absmax_ptr + first_flat // BLOCKSIZE)[None, :]
        high = _code(lane_code, packed >> 4) * scale
        low = _code(lane_code, packed & 15) * scale
        if STACK:
            wt = tl.join(high, low)  # [HALF, BN, 2]
            wt = tl.reshape(tl.permute(wt, (2, 0, 1)), (BK, BN))
        else:
            wt = tl.reshape(tl.permute(tl.join(high, low), (0, 2, 1)), (BK, BN))
        acc = tl.dot(xa, wt.to(tl.bfloat16), acc)
        x_tile += BK
        w_bytes += HALF
        first_flat += BK
    at = m[:, None].to(tl.int64) * N + n[None, :]
    ok = (m < M)[:, None] & (n < N)[None, :]
    if SPLIT > 1:
        tl.atomic_add(work_ptr + at, acc, mask=ok, sem="relaxed")
    else:
        tl.store(out_ptr + at, acc.to(tl.bfloat16), mask=ok)


def run(x, packed, absmax, code, N, K, BM, BN, BK, warps, stages, split=1, stack=False, group_m=8, blocksize=64, work=None):
    M = x.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if split > 1:
        work.zero_()
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN), split)
    gemm_t[grid](x, packed, absmax, code, out, work if work is not None else out, M, N, K, x.stride(0),
                 BLOCKSIZE=blocksize, BM=BM, BN=BN, BK=BK, GROUP_M=group_m, SPLIT=split, STACK=stack,
                 num_warps=warps, num_stages=stages, enable_fp_fusion=False)
    return out if split == 1 else work
