"""Run one kernel a few times (for ncu): python prof.py MODULE N K ROWS BM BN BK WARPS STAGES SPLIT"""
import sys, os
sys.path.insert(0, os.path.dirname(__file__))
import importlib, torch
from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.backends.registry import create
mod, n, k, rows, bm, bn, bk, w, st, sp = sys.argv[1], *map(int, sys.argv[2:11])
dev = torch.device("cuda")
ours = create("triton-nf4")
weight = torch.randn(n, k, device=dev).to(torch.bfloat16)
q = ours.quantize(weight, QuantSpec("nf4", 64, double_quant=False)).handle
x = torch.randn(rows, k, device=dev).to(torch.bfloat16)
work = torch.empty(rows, n, dtype=torch.float32, device=dev)
if mod == "dense":
    for _ in range(3):
        torch.nn.functional.linear(x, weight)
elif mod == "tree":
    from qconform_triton_nf4.kernels import nf4_tc_gemm as T
    cfg = T.TcConfig(bm, bn, bk, w, st, split_k=sp)
    for _ in range(3):
        T.tc_gemm_4bit(x, q.packed, q.absmax, blocksize=64, shape=(n, k), code=q.code, config=cfg)
else:
    m = importlib.import_module(mod)
    for _ in range(3):
        m.run(x, q.packed, q.absmax, q.code, n, k, bm, bn, bk, w, st, split=sp, work=work)
torch.cuda.synchronize()
print("ok", mod)
