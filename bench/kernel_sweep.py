"""Tile/variant sweep of the Triton 4-bit kernels on one GPU (bench/notes.md records the runs).

Run from the repo root: ``PYTHONPATH=. python bench/kernel_sweep.py [dequant] [gemv] [dot]``
(no argument: all three). Each configuration is checked before it is timed: dequantize
bit-identical to the torch fp32 decode, gemv within 2**-7 of the float64 product relative
to |x| |W|. A configuration that fails to compile or to check is reported and skipped.
"""
from __future__ import annotations

import math
import os
import sys
import traceback

import torch
import triton

from pytest_qconform import kernels
from pytest_qconform.kernels import nf4_dequant, nf4_gemv

PARTS = set(sys.argv[1:]) or {"dequant", "gemv", "dot"}
FINAL = "final" in PARTS  # only the default tiles, twice (the spread between the two is the noise)
if FINAL:
    PARTS |= {"dequant", "gemv", "dot"}
SMOKE = os.environ.get("TRITON_INTERPRET") == "1"  # CPU check of this script: tiny sizes, no timing
dev = torch.device("cpu" if SMOKE else "cuda")
g = torch.Generator(device=dev).manual_seed(0)
N = K = 512 if SMOKE else 8192
bs = 64
nb = N * K // bs
DEQUANT_FLOOR_US = 168e6 / 2.9e12 * 1e6
GEMV_FLOOR_US = 33.5e6 / 2.9e12 * 1e6
code = torch.tensor([-1.0, -0.6962, -0.5251, -0.3949, -0.2844, -0.1848, -0.0911, 0.0, 0.0796,
                     0.1609, 0.2461, 0.3379, 0.4407, 0.5626, 0.7230, 1.0], device=dev)
packed = torch.randint(0, 256, (N * K // 2,), dtype=torch.uint8, device=dev, generator=g)
absmax = torch.rand(nb, device=dev, generator=g) + 0.5
dq = dict(nested_absmax=torch.rand(math.ceil(nb / 256), device=dev, generator=g),
          nested_code=torch.linspace(-1, 1, 256, device=dev), offset=0.75)
absmax_codes = torch.randint(0, 256, (nb,), dtype=torch.uint8, device=dev, generator=g)


def decode_fp32(double_quant: bool) -> torch.Tensor:  # torch eager: separate fp32 roundings, like bitsandbytes
    a = absmax
    if double_quant:
        a = dq["nested_code"][absmax_codes.long()] * dq["nested_absmax"][torch.arange(nb, device=dev) // 256]
        a = a + dq["offset"]
    nib = torch.stack([packed >> 4, packed & 15], 1).reshape(-1).long()
    return (code[nib].view(-1, bs) * a[:, None]).view(N, K)


def ms(f) -> float:
    if SMOKE:
        f()
        return 1.0
    return triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median") * 1e3


def attempt(label: str, f) -> None:
    try:
        f()
    except Exception as exc:  # noqa: BLE001 - report and go on with the next configuration
        print(f"{label}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}")
        traceback.print_exc(limit=2, file=sys.stdout)


src = torch.empty(N * K, dtype=torch.bfloat16, device=dev)
dst = torch.empty_like(src)
print(torch.cuda.get_device_name() if not SMOKE else "cpu", "triton", triton.__version__, "torch", torch.__version__)
print(f"copy 134MB bf16 (read+write 268MB): {ms(lambda: dst.copy_(src)):.1f} us")
xs = {M: torch.randn(M, K, device=dev, generator=g).bfloat16() for M in (1, 4, 16)}

for double_quant in (False, True):
    kw = dict(blocksize=bs, code=code, **(dq if double_quant else {}))
    a = absmax_codes if double_quant else absmax
    ref = decode_fp32(double_quant)
    if "dequant" in PARTS:
        out = torch.empty(N, K, dtype=torch.bfloat16, device=dev)
        for tile in [(2048, 4), (2048, 4)] if FINAL else [(2048, 4), (1024, 4), (4096, 8)]:
            def run_dequant(tile=tile):
                nf4_dequant._GPU_TILE = tile
                for dt in (torch.bfloat16, torch.float16, torch.float32):
                    got = kernels.dequantize_4bit(packed, a, shape=(N, K), out_dtype=dt, **kw)
                    assert torch.equal(got, ref.to(dt)), ("dequant mismatch", dt, double_quant)
                t = ms(lambda: kernels.dequantize_4bit(packed, a, shape=(N, K), out_dtype=torch.bfloat16, out=out, **kw))
                print(f"dequant bf16 dq={double_quant} tile={tile}: {t:.1f} us = {DEQUANT_FLOOR_US / t:.0%} of floor")
            attempt(f"dequant dq={double_quant} tile={tile}", run_dequant)
        nf4_dequant._GPU_TILE = (2048, 4)
    w64 = ref.double()
    for M, x in xs.items():
        exact = x.double() @ w64.T
        scale = (x.double().abs() @ w64.abs().T).max()

        def check(y, label):
            err = ((y.double() - exact).abs().max() / scale).item()
            assert err < 2 ** -7, (label, err)
            return err

        if "gemv" in PARTS:
            nf4_gemv._DOT_MIN_ROWS = 99
            tiles = [(4, 512, 4), (4, 512, 4)] if FINAL else [(4, 512, 4), (4, 1024, 4), (16, 256, 4), (8, 256, 4)]
            tiles = tiles if M < 16 else tiles[:1]
            for tile in tiles:
                def run_gemv(tile=tile):
                    nf4_gemv._GPU_TILE = tile
                    err = check(kernels.gemv_4bit(x, packed, a, shape=(N, K), **kw), ("gemv", M, tile))
                    t = ms(lambda: kernels.gemv_4bit(x, packed, a, shape=(N, K), **kw))
                    print(f"gemv elementwise M={M} dq={double_quant} tile={tile}: {t:.1f} us = "
                          f"{GEMV_FLOOR_US / t:.0%} of floor (err {err:.1e})")
                attempt(f"gemv M={M} tile={tile}", run_gemv)
            nf4_gemv._GPU_TILE = (4, 512, 4)
        if "dot" in PARTS:
            nf4_gemv._DOT_MIN_ROWS = 1
            tiles = [(64, 64, 4, 3, "wx")] * 2 if FINAL else [(64, 64, 4, 3, "wx"), (64, 128, 4, 3, "wx")]
            for tile in tiles if M > 1 else []:
                for precision in ("tf32x3",):
                    def run_dot(tile=tile, precision=precision):
                        nf4_gemv._GPU_DOT_TILE, nf4_gemv._DOT_PRECISION = tile, precision
                        err = check(kernels.gemv_4bit(x, packed, a, shape=(N, K), **kw), ("dot", M, tile))
                        t = ms(lambda: kernels.gemv_4bit(x, packed, a, shape=(N, K), **kw))
                        print(f"gemv dot M={M} dq={double_quant} tile={tile} {precision}: {t:.1f} us = "
                              f"{GEMV_FLOOR_US / t:.0%} of floor (err {err:.1e})")
                    attempt(f"dot M={M} tile={tile} {precision}", run_dot)
            nf4_gemv._DOT_MIN_ROWS, nf4_gemv._DOT_PRECISION = 5, "tf32x3"
            nf4_gemv._GPU_DOT_TILE = (64, 64, 4, 3, "wx")
        if not double_quant and ("gemv" in PARTS or "dot" in PARTS):
            wb = ref.bfloat16()
            wbuf = torch.empty(N, K, dtype=torch.bfloat16, device=dev)
            print(f"  M={M} torch bf16 matmul, W materialized: {ms(lambda: x @ wb.T):.1f} us; dequantize + matmul: "
                  f"{ms(lambda: x @ kernels.dequantize_4bit(packed, a, shape=(N, K), out_dtype=torch.bfloat16, out=wbuf, **kw).T):.1f} us")
