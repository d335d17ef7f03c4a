"""Scratch: a Gluon NF4 GEMM whose bytes are loaded and decoded straight into wgmma's
register A-operand layout (no shared-memory round trip of the decoded tile)."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared
from triton.experimental.gluon.language.nvidia.ampere import async_copy


@gluon.constexpr_function
def word_layout4(BN, W, num_warps):
    """[BN, W, 4, 2] (row, word of 8 values, byte of the word = lane % 4, nibble) laid out as
    wgmma's A operand [BN, 8 W] (k = 8 w + 2 t + b) with k_width 2: registers hold the nibble,
    the words, then row + 8 (and further row blocks); lanes the byte, then rows 0-7; warps rows 16, 32..."""
    reg = [[0, 0, 0, 1]]
    w = 1
    while w < W:
        reg.append([0, w, 0, 0]); w *= 2
    reg.append([8, 0, 0, 0])
    lane = [[0, 0, 1, 0], [0, 0, 2, 0], [1, 0, 0, 0], [2, 0, 0, 0], [4, 0, 0, 0]]
    warp = []
    r = 16
    for _ in range(num_warps.bit_length() - 1):
        warp.append([r, 0, 0, 0]); r *= 2
    while r < BN:
        reg.append([r, 0, 0, 0]); r *= 2
    return gl.DistributedLinearLayout(reg, lane, warp, [], [BN, W, 4, 2])


@gluon.jit
def _lane_code(code_ptr, like):
    address = gl.full(like.shape, 0, gl.int64, like.type.layout) + code_ptr.to(gl.int64, bitcast=True)
    return gl.inline_asm_elementwise(
        "{ .reg .b32 l; .reg .b64 a; mov.u32 l, %laneid; and.b32 l, l, 15; mul.wide.u32 a, l, 4; "
        "add.s64 a, a, $1; ld.global.nc.b32 $0, [a]; }", "=r,l", [address], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _code(lane_code, nib):
    return gl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [lane_code, nib],
                                     dtype=gl.int32, is_pure=True, pack=1).to(gl.float32, bitcast=True)


@gluon.jit
def gemm_g(x_ptr, packed_ptr, absmax_ptr, code_ptr, out_ptr, work_ptr, M, N, K, stride_xm,
           BLOCKSIZE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
           SPLIT: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
    W: gl.constexpr = BK // 8
    L4: gl.constexpr = word_layout4(BN, W, num_warps)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    x_load: gl.constexpr = gl.BlockedLayout([1, 8], [32 // (BK // 8), BK // 8], [num_warps, 1], [1, 0])
    x_shared: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16)

    pid = gl.program_id(0)
    split = gl.program_id(1)
    tiles_m = gl.cdiv(M, BM)
    tiles_n = gl.cdiv(N, BN)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = gl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % per_group) % group_rows
    pid_n = (pid % per_group) // group_rows
    steps = K // BK
    per_split = gl.cdiv(steps, SPLIT)
    first_step = split * per_split
    last_step = gl.minimum(first_step + per_split, steps)
    count = last_step - first_step
    k0 = first_step * BK

    # every K step's x tile, weight words and absmax go through one cp.async ring of STAGES
    x_smem = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BM, BK], x_shared)
    w_smem = gl.allocate_shared_memory(gl.int32, [STAGES, BN, W], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    s_smem = gl.allocate_shared_memory(gl.float32, [STAGES, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    xm = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, x_load))
    xk = gl.arange(0, BK, layout=gl.SliceLayout(0, x_load))
    x_ptrs = x_ptr + (gl.minimum(xm, M - 1).to(gl.int64) * stride_xm)[:, None] + (k0 + xk)[None, :]
    w_load: gl.constexpr = gl.BlockedLayout([1, 4], [32 // (W // 4), W // 4], [num_warps, 1], [1, 0])
    wr = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, w_load)), N - 1).to(gl.int64)
    wc = gl.arange(0, W, layout=gl.SliceLayout(0, w_load))
    words_ptr = packed_ptr.to(gl.pointer_type(gl.int32), bitcast=True)
    w_ptrs = words_ptr + (wr * (K // 8) + k0 // 8)[:, None] + wc[None, :]
    s_load: gl.constexpr = gl.BlockedLayout([1], [32], [num_warps], [0])
    sr = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=s_load), N - 1).to(gl.int64)
    s_flat = sr * K + k0  # one absmax per row per step (BK <= BLOCKSIZE)
    for s in gl.static_range(STAGES - 1):
        step = gl.minimum(s, count - 1)
        async_copy.async_copy_global_to_shared(x_smem.index(s), x_ptrs + step * BK)
        async_copy.async_copy_global_to_shared(w_smem.index(s), w_ptrs + step * W)
        async_copy.async_copy_global_to_shared(s_smem.index(s), absmax_ptr + (s_flat + step * BK) // BLOCKSIZE)
        async_copy.commit_group()

    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    b = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    shift3 = (t * 8)[None, None, :]
    nib_shift = (4 - 4 * b)[None, None, None, :]
    lane_code = _lane_code(code_ptr, gl.full([BN, W, 4, 2], 0, gl.int32, L4))
    acc = gl.zeros([BN, BM], gl.float32, mma)
    for i in range(count):
        slot = i % STAGES
        async_copy.wait_group(STAGES - 2)
        gl.thread_barrier()
        words = w_smem.index(slot).load(L2)
        scale = s_smem.index(slot).load(gl.SliceLayout(1, L2))
        by = (words[:, :, None] >> shift3) & 255  # [BN, W, 4]
        nib = (by[:, :, :, None] >> nib_shift) & 15  # [BN, W, 4, 2]
        val = _code(lane_code, nib) * scale[:, None, None, None]
        a = gl.convert_layout(gl.reshape(val.to(gl.bfloat16), [BN, BK]), a_layout, assert_trivial=True)
        fence_async_shared()
        acc = warpgroup_mma(a, x_smem.index(slot).permute((1, 0)), acc, is_async=True)
        acc, a = warpgroup_mma_wait(1, deps=(acc, a))
        gl.thread_barrier()  # every warp's reads of the slot refilled next are done
        ahead = gl.minimum(i + STAGES - 1, count - 1)
        refill = (i + STAGES - 1) % STAGES
        async_copy.async_copy_global_to_shared(x_smem.index(refill), x_ptrs + ahead * BK)
        async_copy.async_copy_global_to_shared(w_smem.index(refill), w_ptrs + ahead * W)
        async_copy.async_copy_global_to_shared(s_smem.index(refill), absmax_ptr + (s_flat + ahead * BK) // BLOCKSIZE)
        async_copy.commit_group()
    acc = warpgroup_mma_wait(0, deps=(acc,))
    async_copy.wait_group(0)

    on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    at = om[None, :].to(gl.int64) * N + on[:, None]
    ok = (om < M)[None, :] & (on < N)[:, None]
    if SPLIT > 1:
        gl.atomic_add(work_ptr + at, acc, mask=ok, sem="relaxed")
    else:
        gl.store(out_ptr + at, acc.to(gl.bfloat16), mask=ok)


def run(x, packed, absmax, code, N, K, BM, BN, BK, warps, stages, split=1, group_m=8, blocksize=64, work=None):
    M = x.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if split > 1:
        work.zero_()
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN), split)
    gemm_g[grid](x, packed, absmax, code, out, work if work is not None else out, M, N, K, x.stride(0),
                 BLOCKSIZE=blocksize, BM=BM, BN=BN, BK=BK, GROUP_M=group_m, SPLIT=split, STAGES=stages,
                 num_warps=warps)
    return out if split == 1 else work
