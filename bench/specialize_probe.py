"""What does Triton's integer specialization buy a gemv kernel? (bench/notes.md "Compile census")

A cold conformance run compiles one variant per key, and Triton keys integers by class
(equal to 1, multiple of 16, other) unless a kernel lists them in ``do_not_specialize``.
- ``rows``: the batch-1 hot path (bf16 x), compiled 8 times at about 0.8 s each on the H100
  host: 2 dtypes x double quant x (batch 1 or more), the last only because ``M == 1`` is
  specialized. Compared: the package kernel against the same source with ``M`` not
  specialized.
- ``words``: the word kernel (fp32 x), which no longer specializes ``M`` and ``N``.
  Compared: the package kernel against the same source with Triton's default keys.
Each pair is checked for identical outputs, then timed in alternating rounds.

    PYTHONPATH=.:bench python bench/specialize_probe.py rows|words   (writes $OUT/specialize-KERNEL.jsonl)
"""
from __future__ import annotations

import json
import os
import sys

import torch
import triton

from gemv_sweep_v6 import CODE, DEVICE, GEN, queued_us, weight
from pytest_qconform import kernels
from pytest_qconform.kernels import nf4_gemv

SHAPES = ((8192, 8192), (4096, 14336), (14336, 4096))
ROUNDS = 3


def main(which: str) -> None:
    attr, x_dtype = {"rows": ("_gemv_4bit_rows_kernel", torch.bfloat16),
                     "words": ("_gemv_4bit_words_kernel", torch.float32)}[which]
    package = getattr(nf4_gemv, attr)
    if which == "rows":
        variants = {"package (M specialized)": package,
                    "M not specialized": triton.jit(do_not_specialize=["word_step", "M"])(package.fn)}
    else:
        variants = {"package (M, N not specialized)": package, "Triton default keys": triton.jit(package.fn)}
    out = open(os.path.join(os.environ.get("OUT", "."), f"specialize-{which}.jsonl"), "w")
    for N, K in SHAPES:
        copies = [weight(N, K) for _ in range(4)]  # 4 x 16.8-33.5 MB: more than L2
        for M in (1, 4):
            for double_quant in (False, True):
                x = torch.randn(M, K, device=DEVICE, generator=GEN).to(x_dtype)

                def calls():
                    result = []
                    for packed, absmax, codes, dq in copies:
                        kw = dict(blocksize=64, shape=(N, K), code=CODE, **(dq if double_quant else {}))
                        a = codes if double_quant else absmax
                        result.append(lambda packed=packed, a=a, kw=kw: kernels.gemv_4bit(x, packed, a, **kw))
                    return result

                outputs = {}
                for name, kernel in variants.items():
                    setattr(nf4_gemv, attr, kernel)
                    outputs[name] = calls()[0]()
                setattr(nf4_gemv, attr, package)
                same = torch.equal(*outputs.values())
                times = {name: [] for name in variants}
                for _ in range(ROUNDS):
                    for name, kernel in variants.items():
                        setattr(nf4_gemv, attr, kernel)
                        times[name].append(round(queued_us(calls()), 2))
                setattr(nf4_gemv, attr, package)
                row = dict(kernel=which, N=N, K=K, M=M, dq=double_quant, identical=same, us=times)
                print(json.dumps(row), flush=True)
                out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
