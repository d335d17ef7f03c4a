"""Word-kernel gemv sweeps on the device (bench/notes.md v6-v7): tiles and lookups of
``_gemv_4bit_words_kernel`` against v5's elementwise kernel, every configuration checked
against an fp32 decode before it is timed.

Run from the repo root on a CUDA machine:
``PYTHONPATH=. python bench/gemv_sweep_v6.py {gather|shuffle|packed|rows}`` (v6b, v6c, v7, v8).
Times are medians of launches queued behind a device sleep, rotating over weight copies
larger than L2, so host overhead is not timed. Prints one JSON line per configuration and
writes them to ``$OUT/gemv_sweep_v6.jsonl``. (The first v6 run used ``do_bench``, which
times host overhead for small shapes, and a "table" lookup since removed: its numbers are
in bench/notes.md v6 and bench/results/gemv-sweep-v6-h100-dobench.jsonl.)
"""
import json
import math
import os
import sys
import time

import torch

from pytest_qconform import kernels
from pytest_qconform.kernels import nf4_gemv

DEVICE = torch.device("cuda")
GEN = torch.Generator(device=DEVICE).manual_seed(0)
CODE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                     0.7229568362236023, 1.0], device=DEVICE)
COPY_BANDWIDTH = 2.9e12  # bytes/s, the H100's measured copy rate (floor of the packed weight)
ELEMENTWISE = (4, 4, 4, False)  # no power-of-two tile >= 8 divides K: v5's elementwise kernel

# Tiles (BLOCK_N, BLOCK_K, num_warps, PREFETCH) and lookup per mode; x_packed for v7.
MODES = {
    "gather": dict(label="v6b", lookup="gather", x_packed=False, tiles=[
        (16, 512, 4, True), (16, 512, 4, False), (32, 512, 4, True), (16, 512, 8, True), (16, 1024, 4, True),
        (32, 256, 4, True), (8, 512, 4, True), (16, 512, 2, True), (32, 512, 8, True), (64, 256, 4, True)]),
    "shuffle": dict(label="v6c", lookup="shuffle", x_packed=False, tiles=[
        (16, 512, 4, True), (32, 512, 4, True), (32, 512, 8, True), (16, 512, 8, True), (32, 256, 4, True),
        (16, 256, 4, True), (8, 512, 4, True), (64, 512, 8, True), (16, 512, 4, False), (32, 512, 4, False),
        (64, 256, 8, True), (32, 1024, 8, True)]),
    "packed": dict(label="v7", lookup="shuffle", x_packed=True, tiles=[
        (16, 512, 8, True), (16, 512, 4, True), (32, 512, 8, True), (8, 512, 4, True), (16, 1024, 8, True),
        (32, 1024, 8, True), (16, 256, 4, True), (64, 512, 8, True), (32, 256, 8, True), (8, 1024, 8, True)]),
}


def weight(N, K, bs=64):
    """Random packed NF4 bytes, absmax, double-quant codes and nested state for an N x K weight."""
    nb = N * K // bs
    packed = torch.randint(0, 256, (N * K // 2,), dtype=torch.uint8, device=DEVICE, generator=GEN)
    absmax = torch.rand(nb, device=DEVICE, generator=GEN) + 0.5
    codes = torch.randint(0, 256, (nb,), dtype=torch.uint8, device=DEVICE, generator=GEN)
    dq = dict(nested_absmax=torch.rand(math.ceil(nb / 256), device=DEVICE, generator=GEN),
              nested_code=torch.linspace(-1, 1, 256, device=DEVICE), offset=0.75)
    return packed, absmax, codes, dq


def decode(N, K, packed, absmax, codes, dq, double_quant, bs=64):
    """fp32 decode in torch (separate roundings, as bitsandbytes): the check's reference."""
    nb = N * K // bs
    a = absmax
    if double_quant:
        a = dq["nested_code"][codes.long()] * dq["nested_absmax"][torch.arange(nb, device=DEVICE) // 256] + dq["offset"]
    nib = torch.stack([packed >> 4, packed & 15], 1).reshape(-1).long()
    return (CODE[nib].view(-1, bs) * a[:, None]).view(N, K)


def queued_us(calls, n=60):
    """Median device time per call with the launches queued behind a device sleep, so host
    overhead is not timed; ``calls`` rotate over weight copies larger than L2 together."""
    for c in calls:
        c()
    torch.cuda.synchronize()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    torch.cuda._sleep(40_000_000)  # ~20 ms at 1.98 GHz: longer than queueing n calls
    events[0].record()
    for i in range(n):
        calls[i % len(calls)]()
        events[i + 1].record()
    torch.cuda.synchronize()
    times = sorted(events[i].elapsed_time(events[i + 1]) for i in range(n))
    return times[n // 2] * 1e3


class Sweep:
    """Weight copies of one shape, their decodes, and the JSON-lines log."""

    def __init__(self, N, K, copies, log):
        self.N, self.K, self.log = N, K, log
        self.copies = [weight(N, K) for _ in range(copies)]
        self.ref = {dq: decode(N, K, *self.copies[0], dq) for dq in (False, True)}

    def run(self, label, M, double_quant, tile=ELEMENTWISE, lookup="gather", x_packed=False, rows_per_sm=0,
            rows_words=None):
        """Check one configuration against the fp32 decode, then time it; a failure to
        compile is a result, not the end of the sweep. rows_per_sm > 0: the rows kernel (v8)
        with that many programs per multiprocessor and rows_words (words per step, num_warps)
        as its only step size (None: the package's); 0: the word or elementwise kernel."""
        names = ("_GPU_WORDS_TILE", "_WORDS_LOOKUP", "_X_PACKED", "_ROWS_KERNEL", "_ROWS_PROGRAMS_PER_SM", "_ROWS_WORDS",
                 "_ROWS_WORDS_MANY_ITEMS")
        saved = [getattr(nf4_gemv, n) for n in names]
        values = (tile, lookup, x_packed, rows_per_sm > 0, rows_per_sm or saved[-3],
                  (rows_words,) if rows_words else saved[-2], (rows_words,) if rows_words else saved[-1])
        for n, v in zip(names, values):
            setattr(nf4_gemv, n, v)
        row = dict(label=label, N=self.N, K=self.K, M=M, dq=double_quant, tile=tile, lookup=lookup, x_packed=x_packed,
                   rows_per_sm=rows_per_sm, rows_words=rows_words)
        try:
            x = torch.randn(M, self.K, device=DEVICE, generator=GEN).bfloat16()

            def call(copy):
                packed, absmax, codes, dq = copy
                kw = dict(blocksize=64, shape=(self.N, self.K), code=CODE, **(dq if double_quant else {}))
                return lambda: kernels.gemv_4bit(x, packed, codes if double_quant else absmax, **kw)

            ref = self.ref[double_quant]
            y = call(self.copies[0])()
            row["err"] = ((y.float() - x.float() @ ref.T).abs() / (x.float().abs() @ ref.abs().T)).max().item()
            if row["err"] < 2**-8:
                t = queued_us([call(c) for c in self.copies])
                row.update(status="ok", us=round(t, 2),
                           pct_floor=round(self.N * self.K / 2 / COPY_BANDWIDTH * 1e6 / t * 100, 1))
            else:
                row["status"] = "WRONG"
        except Exception as e:
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
        finally:
            for n, v in zip(names, saved):
                setattr(nf4_gemv, n, v)
        print(json.dumps(row), flush=True)
        self.log.write(json.dumps(row) + "\n")
        return row


def rows_sweep(log):
    """v8: the rows kernel (the package's choice of step size and grid, label "v8") against
    the word kernel (v7) on every shape, batch 1 and 4; at 8192 x 8192 and 4096 x 14336
    batch 1 also step sizes and programs per SM ("v8-steps")."""
    v7 = dict(tile=(16, 512, 4, True), lookup="shuffle", x_packed=True)
    square = Sweep(8192, 8192, copies=3, log=log)
    for per_sm, rows_words in ((16, (256, 1)), (12, (256, 1)), (20, (256, 1)), (16, (128, 1)), (16, (512, 1)),
                               (16, (256, 2)), (8, (256, 2)), (16, (512, 2)), (8, (512, 2))):
        square.run("v8-steps", 1, False, rows_per_sm=per_sm, rows_words=rows_words)
    for M, double_quant in ((1, False), (2, False), (4, False), (1, True)):
        square.run("v7", M, double_quant, **v7)
        square.run("v8", M, double_quant, rows_per_sm=nf4_gemv._ROWS_PROGRAMS_PER_SM)
    for N, K in [(4096, 4096), (14336, 4096), (4096, 14336)]:
        other = Sweep(N, K, copies=6, log=log)
        if K == 14336:
            for per_sm, rows_words in ((16, (256, 1)), (16, (256, 2)), (16, (128, 1)), (16, (128, 2))):
                other.run("v8-steps", 1, False, rows_per_sm=per_sm, rows_words=rows_words)
        for M in (1, 4):
            other.run("v7", M, False, **v7)
            other.run("v8", M, False, rows_per_sm=nf4_gemv._ROWS_PROGRAMS_PER_SM)


def main(mode):
    if mode == "rows":
        with open(os.path.join(os.environ.get("OUT", "."), "gemv_sweep_v6.jsonl"), "w") as log:
            rows_sweep(log)
        return
    spec = MODES[mode]
    start = time.time()
    with open(os.path.join(os.environ.get("OUT", "."), "gemv_sweep_v6.jsonl"), "w") as log:
        square = Sweep(8192, 8192, copies=3, log=log)
        square.run("v5", 1, False)
        rows = [square.run(spec["label"], 1, False, tile=t, lookup=spec["lookup"], x_packed=spec["x_packed"])
                for t in spec["tiles"]]
        best = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["us"])[:2]
        configs = [dict(tile=tuple(r["tile"]), lookup=r["lookup"], x_packed=r["x_packed"]) for r in best]
        for config in configs:
            square.run("best", 1, True, **config)
            for M in (2, 4):
                square.run("best", M, False, **config)
        square.run("v5", 4, False)
        square.run("v5", 1, True)
        for N, K in [(4096, 4096), (14336, 4096)]:
            other = Sweep(N, K, copies=6, log=log)
            other.run("v5", 1, False)
            for config in configs:
                for M in (1, 4):
                    other.run("best", M, False, **config)
    print(json.dumps({"sweep_s": round(time.time() - start)}))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "packed")
