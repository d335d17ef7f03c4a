"""Scratch: the Gluon NF4 GEMM with a producer warp: TMA brings x tiles and the weight's
words into a ring of STAGES slots (ready/empty mbarriers); one consumer warpgroup decodes
the words straight into wgmma's register A operand and multiplies."""
import torch, triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import warpgroup_mma, warpgroup_mma_wait, fence_async_shared, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from tc_g1 import word_layout4, _lane_code, _code


@gluon.jit
def _producer(x_desc, w_desc, x_bufs, w_bufs, ready, empty, off_m, off_n, first_step, count,
              BK: gl.constexpr, STAGES: gl.constexpr):
    W: gl.constexpr = BK // 8
    for i in range(count):
        s = i % STAGES
        ph = (i // STAGES) & 1
        mbarrier.wait(empty.index(s), ph ^ 1)
        mbarrier.expect(ready.index(s), x_desc.block_type.nbytes + w_desc.block_type.nbytes)
        step = first_step + i
        tma.async_copy_global_to_shared(x_desc, [off_m, step * BK], ready.index(s), x_bufs.index(s))
        tma.async_copy_global_to_shared(w_desc, [off_n, step * W], ready.index(s), w_bufs.index(s))


@gluon.jit
def _consumer(x_bufs, w_bufs, ready, empty, absmax_ptr, code_ptr, row_flat, count,
              BLOCKSIZE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, STAGES: gl.constexpr,
              num_warps: gl.constexpr):
    W: gl.constexpr = BK // 8
    L4: gl.constexpr = word_layout4(BN, W, num_warps)
    L3: gl.constexpr = gl.SliceLayout(3, L4)
    L2: gl.constexpr = gl.SliceLayout(2, L3)
    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16])
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=mma, k_width=2)
    t = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    b = gl.arange(0, 2, layout=gl.SliceLayout(0, gl.SliceLayout(1, gl.SliceLayout(2, L4))))
    shift4 = (t * 8)[None, None, :, None] + (4 - 4 * b)[None, None, None, :]
    lane_code = _lane_code(code_ptr, gl.full([BN, W, 4, 2], 0, gl.int32, L4))
    acc = gl.zeros([BN, BM], gl.float32, mma)
    scale = gl.load(absmax_ptr + row_flat // BLOCKSIZE)
    scale1 = gl.load(absmax_ptr + (row_flat + gl.minimum(1, count - 1) * BK) // BLOCKSIZE)
    for i in range(count):
        s = i % STAGES
        ph = (i // STAGES) & 1
        scale2 = gl.load(absmax_ptr + (row_flat + gl.minimum(i + 2, count - 1) * BK) // BLOCKSIZE)
        mbarrier.wait(ready.index(s), ph)
        words = w_bufs.index(s).load(L2)
        v = _code(lane_code, words[:, :, None, None] >> shift4) * scale[:, None, None, None]
        a = gl.convert_layout(gl.reshape(v.to(gl.bfloat16), [BN, BK]), a_layout, assert_trivial=True)
        acc = warpgroup_mma(a, x_bufs.index(s).permute((1, 0)), acc, is_async=True)
        acc, a = warpgroup_mma_wait(1, deps=(acc, a))
        mbarrier.arrive(empty.index((i + STAGES - 1) % STAGES), pred=i > 0)
        scale = scale1
        scale1 = scale2
    acc = warpgroup_mma_wait(0, deps=(acc,))
    return (acc,)


@gluon.jit
def gemm_ws(x_desc, w_desc, absmax_ptr, code_ptr, out_ptr, work_ptr, M, N, K,
            BLOCKSIZE: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, BK: gl.constexpr, GROUP_M: gl.constexpr,
            SPLIT: gl.constexpr, STAGES: gl.constexpr, num_warps: gl.constexpr):
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
    count = gl.minimum(first_step + per_split, steps) - first_step

    x_bufs = gl.allocate_shared_memory(x_desc.dtype, [STAGES] + x_desc.block_type.shape, x_desc.layout)
    w_bufs = gl.allocate_shared_memory(w_desc.dtype, [STAGES] + w_desc.block_type.shape, w_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)

    W: gl.constexpr = BK // 8
    L4: gl.constexpr = word_layout4(BN, W, num_warps)
    L2: gl.constexpr = gl.SliceLayout(2, gl.SliceLayout(3, L4))
    rows = gl.minimum(pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, L2)), N - 1).to(gl.int64)
    row_flat = rows * K + first_step * BK
    (acc,) = gl.warp_specialize([
        (_consumer, (x_bufs, w_bufs, ready, empty, absmax_ptr, code_ptr, row_flat, count,
                     BLOCKSIZE, BM, BN, BK, STAGES, num_warps)),
        (_producer, (x_desc, w_desc, x_bufs, w_bufs, ready, empty, pid_m * BM, pid_n * BN, first_step, count, BK, STAGES)),
    ], [1], [40])

    mma: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BM, 16])
    on = pid_n * BN + gl.arange(0, BN, layout=gl.SliceLayout(1, mma))
    om = pid_m * BM + gl.arange(0, BM, layout=gl.SliceLayout(0, mma))
    at = om[None, :].to(gl.int64) * N + on[:, None]
    ok = (om < M)[None, :] & (on < N)[:, None]
    if SPLIT > 1:
        gl.atomic_add(work_ptr + at, acc, mask=ok, sem="relaxed")
    else:
        gl.store(out_ptr + at, acc.to(gl.bfloat16), mask=ok)


def run(x, packed, absmax, code, N, K, BM, BN, BK, warps, stages, split=1, group_m=8, blocksize=64, work=None, maxnreg=None):
    M = x.shape[0]
    out = torch.empty(M, N, dtype=torch.bfloat16, device=x.device)
    if split > 1:
        work.zero_()
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    words = packed.view(torch.int32).view(N, K // 8)
    w_desc = TensorDescriptor.from_tensor(words, [BN, BK // 8], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    grid = (triton.cdiv(M, BM) * triton.cdiv(N, BN), split)
    gemm_ws[grid](x_desc, w_desc, absmax, code, out, work if work is not None else out, M, N, K,
                  BLOCKSIZE=blocksize, BM=BM, BN=BN, BK=BK, GROUP_M=group_m, SPLIT=split, STAGES=stages,
                  num_warps=warps, maxnreg=maxnreg or (128 if BM <= 64 else 168))
    return out if split == 1 else work
