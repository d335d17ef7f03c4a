"""v6 gemv sweep on the device (bench/notes.md v6): the word kernel's tiles and lookups
against v5's elementwise kernel, every configuration checked before it is timed.

Run from the repo root on a CUDA machine: ``PYTHONPATH=. python bench/gemv_sweep_v6.py``.
Prints one line per configuration and writes JSON lines to ``$OUT/gemv_sweep_v6.jsonl``.
Mode ``b`` (``python bench/gemv_sweep_v6.py b``, ``b shuffle`` for the shuffle lookup, ``b packed``
for x in 8-byte loads) times launches queued behind a device
sleep over weight copies larger than L2 (no host overhead in the times); the default mode
uses ``do_bench``, whose times include host overhead for small shapes. The "table" lookup
measured in the first run (addresses OR-ed into an aligned table) was removed after it:
bench/notes.md v6 has its numbers.
"""
import json
import math
import os
import time

import torch
import triton

from pytest_qconform import kernels
from pytest_qconform.kernels import nf4_gemv

dev = torch.device("cuda")
g = torch.Generator(device=dev).manual_seed(0)
CODE = torch.tensor([-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
                     -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
                     0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941,
                     0.7229568362236023, 1.0], device=dev)
out_path = os.path.join(os.environ.get("OUT", "."), "gemv_sweep_v6.jsonl")
log = open(out_path, "w")


def weight(N, K, bs=64):
    nb = N * K // bs
    packed = torch.randint(0, 256, (N * K // 2,), dtype=torch.uint8, device=dev, generator=g)
    absmax = torch.rand(nb, device=dev, generator=g) + 0.5
    codes = torch.randint(0, 256, (nb,), dtype=torch.uint8, device=dev, generator=g)
    dq = dict(nested_absmax=torch.rand(math.ceil(nb / 256), device=dev, generator=g),
              nested_code=torch.linspace(-1, 1, 256, device=dev), offset=0.75)
    return packed, absmax, codes, dq


def decode(N, K, packed, absmax, codes, dq, double_quant, bs=64):
    nb = N * K // bs
    a = absmax
    if double_quant:
        a = dq["nested_code"][codes.long()] * dq["nested_absmax"][torch.arange(nb, device=dev) // 256] + dq["offset"]
    nib = torch.stack([packed >> 4, packed & 15], 1).reshape(-1).long()
    return (CODE[nib].view(-1, bs) * a[:, None]).view(N, K)


def ms(f):
    return triton.testing.do_bench(f, warmup=25, rep=150, return_mode="median") * 1e3


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


def run(label, N, K, M, double_quant, state, tile=None, lookup="gather", elementwise=False):
    packed, absmax, codes, dq, ref = state
    kw = dict(blocksize=64, shape=(N, K), code=CODE, **(dq if double_quant else {}))
    a = codes if double_quant else absmax
    saved = nf4_gemv._GPU_WORDS_TILE, nf4_gemv._WORDS_LOOKUP
    if elementwise:
        nf4_gemv._GPU_WORDS_TILE = (4, 4, 4, False)  # no tile divides K: v5's kernel
    elif tile:
        nf4_gemv._GPU_WORDS_TILE = tile
    nf4_gemv._WORDS_LOOKUP = lookup
    row = dict(label=label, N=N, K=K, M=M, dq=double_quant, tile=tile, lookup=lookup)
    try:
        x = torch.randn(M, K, device=dev, generator=g).bfloat16()
        y = kernels.gemv_4bit(x, packed, a, **kw)
        want = x.float() @ ref.T
        err = ((y.float() - want).abs() / (x.float().abs() @ ref.abs().T)).max().item()
        row["err"] = err
        if not err < 2 ** -8:
            row["status"] = "WRONG"
        else:
            t = ms(lambda: kernels.gemv_4bit(x, packed, a, **kw))
            row.update(status="ok", us=round(t, 2), pct_floor=round(N * K / 2 / 2.9e12 * 1e6 / t * 100, 1))
    except Exception as e:  # a config that fails to compile is a result, not the end of the sweep
        row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
    finally:
        nf4_gemv._GPU_WORDS_TILE, nf4_gemv._WORDS_LOOKUP = saved
    print(json.dumps(row), flush=True)
    log.write(json.dumps(row) + "\n")
    log.flush()
    return row


import sys

if len(sys.argv) > 1 and sys.argv[1] == "b":  # v6b: queued timing, gather tiles, weight copies > L2
    t0 = time.time()
    N = K = 8192
    copies = []
    for _ in range(3):
        p, a, c, d = weight(N, K)
        copies.append((p, a, c, d))
    ref0 = {dqf: decode(N, K, *copies[0], dqf) for dqf in (False, True)}
    def sweep(label, M, dqf, tile=None, lookup="gather", elementwise=False, n=N, k=K, cps=copies, ref=None,
              x_packed=False):
        saved = nf4_gemv._GPU_WORDS_TILE, nf4_gemv._WORDS_LOOKUP, nf4_gemv._X_PACKED
        nf4_gemv._GPU_WORDS_TILE = (4, 4, 4, False) if elementwise else (tile or saved[0])
        nf4_gemv._WORDS_LOOKUP = lookup
        nf4_gemv._X_PACKED = x_packed
        row = dict(label=label, N=n, K=k, M=M, dq=dqf, tile=tile, lookup=lookup, x_packed=x_packed)
        try:
            x = torch.randn(M, k, device=dev, generator=g).bfloat16()
            def call(cp):
                p, a, c, d = cp
                kw = dict(blocksize=64, shape=(n, k), code=CODE, **(d if dqf else {}))
                return lambda: kernels.gemv_4bit(x, p, c if dqf else a, **kw)
            r = ref if ref is not None else ref0[dqf]
            y = call(cps[0])()
            err = ((y.float() - x.float() @ r.T).abs() / (x.float().abs() @ r.abs().T)).max().item()
            row["err"] = err
            if err < 2 ** -8:
                t = queued_us([call(cp) for cp in cps])
                row.update(status="ok", us=round(t, 2), pct_floor=round(n * k / 2 / 2.9e12 * 1e6 / t * 100, 1))
            else:
                row["status"] = "WRONG"
        except Exception as e:
            row.update(status="error", error=f"{type(e).__name__}: {e}"[:300])
        finally:
            nf4_gemv._GPU_WORDS_TILE, nf4_gemv._WORDS_LOOKUP, nf4_gemv._X_PACKED = saved
        print(json.dumps(row), flush=True)
        log.write(json.dumps(row) + "\n")
        return row
    sweep("v5", 1, False, elementwise=True)
    rows = []
    if len(sys.argv) > 2 and sys.argv[2] == "packed":  # v7: x in 8-byte loads
        rows.append(sweep("v6c", 1, False, tile=(16, 512, 8, True), lookup="shuffle"))
        for t in [(16, 512, 8, True), (16, 512, 4, True), (32, 512, 8, True), (8, 512, 4, True), (16, 1024, 8, True),
                  (32, 1024, 8, True), (16, 256, 4, True), (64, 512, 8, True), (32, 256, 8, True), (8, 1024, 8, True)]:
            rows.append(sweep("v7", 1, False, tile=t, lookup="shuffle", x_packed=True))
        rows.append(sweep("v7", 1, False, tile=(16, 512, 4, True), lookup="gather", x_packed=True))
    elif len(sys.argv) > 2 and sys.argv[2] == "shuffle":  # v6c: the shuffle lookup
        rows.append(sweep("v6b", 1, False, tile=(16, 512, 4, True)))
        for t in [(16, 512, 4, True), (32, 512, 4, True), (32, 512, 8, True), (16, 512, 8, True), (32, 256, 4, True),
                  (16, 256, 4, True), (8, 512, 4, True), (64, 512, 8, True), (16, 512, 4, False), (32, 512, 4, False),
                  (64, 256, 8, True), (32, 1024, 8, True)]:
            rows.append(sweep("v6c", 1, False, tile=t, lookup="shuffle"))
    else:
        for t in [(16, 512, 4, True), (16, 512, 4, False), (32, 512, 4, True), (16, 512, 8, True), (16, 1024, 4, True),
                  (32, 256, 4, True), (8, 512, 4, True), (16, 512, 2, True), (32, 512, 8, True), (64, 256, 4, True)]:
            rows.append(sweep("v6b", 1, False, tile=t))
        for t in [(16, 512, 4, True), (16, 256, 4, True), (32, 256, 4, True)]:
            rows.append(sweep("v6b", 1, False, tile=t, lookup="index"))
    ok = sorted((r for r in rows if r.get("status") == "ok"), key=lambda r: r["us"])
    for r in ok[:2]:
        xp = r.get("x_packed", False)
        sweep("v6b-best", 1, True, tile=tuple(r["tile"]), lookup=r["lookup"], x_packed=xp)
        for M in (2, 4):
            sweep("v6b-best", M, False, tile=tuple(r["tile"]), lookup=r["lookup"], x_packed=xp)
    sweep("v5", 4, False, elementwise=True)
    sweep("v5", 1, True, elementwise=True)
    for (n, k) in [(4096, 4096), (14336, 4096)]:
        cps = [weight(n, k) for _ in range(6)]
        r = decode(n, k, *cps[0], False)
        sweep("v5", 1, False, elementwise=True, n=n, k=k, cps=cps, ref=r)
        for r0 in ok[:2]:
            xp = r0.get("x_packed", False)
            sweep("v6b-best", 1, False, tile=tuple(r0["tile"]), lookup=r0["lookup"], n=n, k=k, cps=cps, ref=r, x_packed=xp)
            sweep("v6b-best", 4, False, tile=tuple(r0["tile"]), lookup=r0["lookup"], n=n, k=k, cps=cps, ref=r, x_packed=xp)
    print(json.dumps({"sweep_s": round(time.time() - t0)}))
    sys.exit(0)

t0 = time.time()
print(torch.__version__, triton.__version__, torch.cuda.get_device_name())
src = torch.empty(8192 * 8192, dtype=torch.bfloat16, device=dev)
dst = torch.empty_like(src)
print(json.dumps({"copy_134MB_us": round(ms(lambda: dst.copy_(src)), 1)}))
N = K = 8192
packed, absmax, codes, dq = weight(N, K)
states = {d: (packed, absmax, codes, dq, decode(N, K, packed, absmax, codes, dq, d)) for d in (False, True)}
wb = states[False][4].bfloat16()
xb = torch.randn(1, K, device=dev, generator=g).bfloat16()
print(json.dumps({"torch_bf16_gemv_materialized_us": round(ms(lambda: xb @ wb.T), 1)}))
run("v5", N, K, 1, False, states[False], elementwise=True)
TILES = [(8, 512, 4, True), (16, 512, 4, True), (16, 512, 8, True), (16, 256, 4, True), (8, 256, 2, True),
         (32, 256, 4, True), (8, 1024, 4, True), (4, 512, 2, True), (8, 512, 4, False), (16, 512, 4, False),
         (16, 256, 4, False)]
results = [run("v6", N, K, 1, False, states[False], tile=t) for t in TILES]
for lookup in ("index",):
    for t in [(8, 512, 4, True), (16, 512, 4, True), (16, 256, 4, True)]:
        results.append(run("v6", N, K, 1, False, states[False], tile=t, lookup=lookup))
ok = sorted((r for r in results if r.get("status") == "ok"), key=lambda r: r["us"])
best = [tuple(r["tile"]) for r in ok[:3]]
best_lookup = [r["lookup"] for r in ok[:3]]
for t, lk in zip(best, best_lookup):
    run("v6-best", N, K, 1, True, states[True], tile=t, lookup=lk)
    for M in (2, 4):
        run("v6-best", N, K, M, False, states[False], tile=t, lookup=lk)
run("v5", N, K, 4, False, states[False], elementwise=True)
for (n, k) in [(4096, 4096), (14336, 4096), (4096, 14336)]:
    p2, a2, c2, dq2 = weight(n, k)
    st = (p2, a2, c2, dq2, decode(n, k, p2, a2, c2, dq2, False))
    run("v5", n, k, 1, False, st, elementwise=True)
    run("v6-best", n, k, 1, False, st, tile=best[0], lookup=best_lookup[0])
print(json.dumps({"sweep_s": round(time.time() - t0)}))
