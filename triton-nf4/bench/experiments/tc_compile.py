"""Compile the tc GEMM variants for sm_90 on the CPU and read TTGIR/SASS counts."""
import sys, json, re, subprocess, os
sys.path.insert(0, "/work/main/triton-nf4/bench")
import torch
from qconform_triton_nf4.compile import check as cc
from qconform_triton_nf4.kernels.nf4_tc_gemm import TcConfig
import tc_gemm_sweep as sw
from triton.backends.compiler import GPUTarget

target = GPUTarget("cuda", 90, 32)
configs = {
  "join64": TcConfig(64, 64, 64, 4, 4, split_k=4),
}
for arg in sys.argv[1:]:
    name, spec = arg.split("=")
    configs[name] = TcConfig(**json.loads(spec))
outdir = "/work/scratch/tc_out" + os.environ.get("SUFFIX",""); os.makedirs(outdir, exist_ok=True)
for name, cfg in configs.items():
    from dataclasses import asdict
    launches = sw._captured_launches([(8192, 8192, cfg.block_m, asdict(cfg))], 132)
    with cc._driver_for(target):
        for l in launches:
            c = l.kernel.warmup(*l.args, grid=l.grid, **l.kwargs)
    ttgir = c.asm["ttgir"]; open(f"{outdir}/{name}.ttgir","w").write(ttgir)
    open(f"{outdir}/{name}.ptx","w").write(c.asm["ptx"])
    open(f"{outdir}/{name}.cubin","wb").write(c.asm["cubin"])
    sass = subprocess.run(["nvdisasm" if False else "cuobjdump", "-sass", f"{outdir}/{name}.cubin"], capture_output=True, text=True).stdout if False else ""
    n_cvt = ttgir.count("ttg.convert_layout"); n_alloc = ttgir.count("ttg.local_alloc"); n_ll = ttgir.count("ttg.local_load")
    res = cc._resources(c, cc.archs.KNOWN_ARCHS["sm90"])
    print(name, res, "shared", c.metadata.shared, "cvt", n_cvt, "local_alloc", n_alloc, "local_load", n_ll,
          "wgmma", ttgir.count("warp_group_dot "), "async_copy", ttgir.count("async_copy_global_to_local"))
