"""Device probe (bench/notes.md v6c): is `shfl.sync.idx` from a per-lane code table, written
as Triton inline asm, right on its own? It was, which pointed the search for the v6c bug
at the layouts. Run on a CUDA machine: ``python bench/shfl_probe.py``."""
import torch, triton, triton.language as tl

@triton.jit
def probe(code_ptr, idx_ptr, out_ptr, lane_out, BLOCK: tl.constexpr, VIA_ZEROS: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    idx = tl.load(idx_ptr + offs)
    if VIA_ZEROS:
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [tl.zeros((BLOCK,), dtype=tl.int32)],
                                         dtype=tl.int32, is_pure=True, pack=1)
    else:
        lane = tl.inline_asm_elementwise("mov.u32 $0, %laneid;", "=r,r", [idx], dtype=tl.int32, is_pure=True, pack=1)
    lane_code = tl.load(code_ptr + (lane & 15)).to(tl.int32, bitcast=True)
    v = tl.inline_asm_elementwise("shfl.sync.idx.b32 $0, $1, $2, 0x1f, -1;", "=r,r,r", [lane_code, idx],
                                  dtype=tl.int32, is_pure=True, pack=1).to(tl.float32, bitcast=True)
    tl.store(out_ptr + offs, v)
    tl.store(lane_out + offs, lane)

code = torch.arange(16, dtype=torch.float32, device="cuda") * 10
for block, warps in [(32, 1), (128, 4), (256, 4), (1024, 4)]:
    idx = torch.randint(0, 16, (block,), dtype=torch.int32, device="cuda")
    for vz in (True, False):
        out = torch.empty(block, device="cuda"); lanes = torch.empty(block, dtype=torch.int32, device="cuda")
        probe[(1,)](code, idx, out, lanes, BLOCK=block, VIA_ZEROS=vz, num_warps=warps)
        ok = torch.equal(out, code[idx.long()])
        print(block, warps, "via_zeros" if vz else "via_idx", "OK" if ok else "WRONG", lanes[:8].tolist(), out[:6].tolist(), (code[idx.long()])[:6].tolist())
