import sys, os, re
sys.path.insert(0, "/work/main/.whl/exp")
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
import importlib, os; tc_g = importlib.import_module(os.environ.get("MOD", "tc_g1"))
target = GPUTarget("cuda", 90, 32)
out = "/work/scratch/g_out"; os.makedirs(out, exist_ok=True)
sig = {"x_ptr": "*bf16", "packed_ptr": "*u8", "absmax_ptr": "*fp32", "code_ptr": "*fp32", "out_ptr": "*bf16", "work_ptr": "*fp32",
       "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32"}
cfgs = {"g64": (64, 64, 64, 4, 3, 1)}
for a in sys.argv[1:]:
    name, v = a.split("="); cfgs[name] = tuple(map(int, v.split(",")))
for name, (BM, BN, BK, warps, stages, split) in cfgs.items():
    consts = dict(BLOCKSIZE=64, BM=BM, BN=BN, BK=BK, GROUP_M=8, SPLIT=split, STAGES=stages, num_warps=warps)
    src = tc_g.gemm_g.ASTSource if False else None
    from triton.experimental.gluon._runtime import GluonASTSource
    src = GluonASTSource(tc_g.gemm_g, {**sig, **{k: "constexpr" for k in consts}}, constexprs=consts,
                    attrs={(i,): [["tt.divisibility", 16]] for i in (0, 1, 2, 3, 4, 5, 8, 9)})
    c = triton.compile(src, target=target, options=dict(num_warps=warps, num_stages=stages))
    open(f"{out}/{name}.ttgir", "w").write(c.asm["ttgir"]); open(f"{out}/{name}.cubin", "wb").write(c.asm["cubin"])
    os.system(f"/work/main/.venv/lib/python3.11/site-packages/triton/backends/nvidia/bin/nvdisasm -c {out}/{name}.cubin > {out}/{name}.sass 2>/dev/null")
    sass = open(f"{out}/{name}.sass").read()
    print(name, "shared", c.metadata.shared, {k: sass.count(k) for k in ("BAR", "STS", "LDS", "LDSM", "SHFL", "GMMA", "LDG", "PRMT", "LDL", "STL")}, "lines", sass.count("\n"))
