import sys, os
sys.path.insert(0, "/work/main/.whl/exp")
import torch, triton
from triton.backends.compiler import GPUTarget
from qconform_triton_nf4.compile import check as cc
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
import tc_ws
target = GPUTarget("cuda", 90, 32)
out = "/work/scratch/ws_out"; os.makedirs(out, exist_ok=True)
meta = torch.device("meta")
N = K = 8192
cfgs = {"ws64": (64, 64, 64, 4, 4, 4)}
for a in sys.argv[1:]:
    name, v = a.split("="); cfgs[name] = tuple(map(int, v.split(",")))
for name, (BM, BN, BK, warps, stages, split) in cfgs.items():
    x = torch.empty(BM, K, dtype=torch.bfloat16, device=meta)
    words = torch.empty(N, K // 8, dtype=torch.int32, device=meta)
    x_desc = TensorDescriptor.from_tensor(x, [BM, BK], gl.NVMMASharedLayout.get_default_for([BM, BK], gl.bfloat16))
    w_desc = TensorDescriptor.from_tensor(words, [BN, BK // 8], gl.NVMMASharedLayout(swizzle_byte_width=0, element_bitwidth=32, rank=2))
    absmax = torch.empty(N * K // 64, dtype=torch.float32, device=meta)
    code = torch.empty(16, dtype=torch.float32, device=meta)
    o = torch.empty(BM, N, dtype=torch.bfloat16, device=meta)
    w = torch.empty(BM, N, dtype=torch.float32, device=meta)
    with cc._driver_for(target):
        c = tc_ws.gemm_ws.warmup(x_desc, w_desc, absmax, code, o, w, BM, N, K, BLOCKSIZE=64, BM=BM, BN=BN, BK=BK, GROUP_M=8,
                                 SPLIT=split, STAGES=stages, num_warps=warps, maxnreg=int(os.environ.get("R", "128")), grid=(1,))
    open(f"{out}/{name}.ttgir", "w").write(c.asm["ttgir"]); open(f"{out}/{name}.cubin", "wb").write(c.asm["cubin"])
    os.system(f"/work/main/.venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/nvdisasm -c {out}/{name}.cubin > {out}/{name}.sass 2>/dev/null")
    sass = open(f"{out}/{name}.sass").read()
    print(name, "shared", c.metadata.shared, {k: sass.count(k) for k in ("BAR", "SYNCS", "LDS", "SHFL", "GMMA", "LDG", "UTMALDG", "LDL", "STL")}, "lines", sass.count("\n"))
    os.system(f"/work/main/.venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/cuobjdump -res-usage {out}/{name}.cubin 2>/dev/null | grep -o 'REG:[0-9]*' ")
