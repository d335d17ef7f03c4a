"""Scratch sweep: structure T against dense and the tree's route (issue 52)."""
import json, os, sys, time, copy, statistics, itertools
sys.path.insert(0, os.path.dirname(__file__)); sys.path.insert(0, "triton-nf4/bench")
import torch, torch.nn.functional as F
import importlib
MODS = {m: importlib.import_module(m) for m in os.environ.get('MODS', 'tc_g1').split(',')}
from tc_gemm_sweep import _error
from pytest_qconform.benchmark import harness
from pytest_qconform.backends.base import QuantSpec
from pytest_qconform.backends.registry import create
from qconform_triton_nf4 import kernels
from qconform_triton_nf4 import plans as P
from qconform_triton_nf4.backend import FUSED_MAX_ROWS

dev = torch.device("cuda"); torch.backends.cuda.matmul.allow_tf32 = False
facts = harness.measure_facts(dev)
out_path = os.path.join(os.environ.get("OUT", "/tmp"), "g_sweep.json")
budget = float(os.environ.get("BUDGET", "240")); t0 = time.perf_counter()
SHAPES = [tuple(map(int, s.split("x"))) for s in os.environ.get("SHAPES", "8192x8192,4096x4096,14336x4096,4096x14336").split(",")]
ROWS = [int(r) for r in os.environ.get("ROWS", "64,128,256,512,2048").split(",")]

def grid(rows, mod):
    g = []
    pair = mod == "tc_g3"
    if mod == "tc_ws":
        if rows <= 64:
            return [(64, 64, 64, 4, st, sp, r) for st in (6, 8) for sp in (1, 2) for r in (128, 96)]
        if rows <= 128:
            return [(bm, 64, 64, 4, st, sp, 128) for bm in (128, 64) for st in (4, 6) for sp in (1, 2)]
        if rows <= 256:
            return [(bm, 64, 64, 4, st, sp, r) for bm, r in ((256, 168), (128, 128), (128, 168)) for st in (3, 4) for sp in (1, 2)]
        return [(bm, 64, 64, 4, st, 1, r) for bm, r in ((256, 168), (256, 184), (128, 128)) for st in (3, 4)]
    if rows <= 64:
        for bn, w in ((64, 4),):
            for st in ((4, 5) if pair else (3, 4)):
                for sp in (2, 4, 8):
                    g.append((64, bn, 64, w, st, sp))
    elif rows <= 128:
        for bm in (128, 64):
            for bn, w in ((64, 4),):
                for st in ((4,) if pair else (3,)):
                    for sp in (1, 2, 4):
                        g.append((bm, bn, 64, w, st, sp))
    else:
        for bm in ((128,) if pair else (256, 128)):
            for bn, w in ((64, 4), (128, 8)):
                for st in ((4,) if pair else (3,)):
                    for sp in (1, 2):
                        g.append((bm, bn, 64, w, st, sp))
    return g

ours = create("triton-nf4"); spec = QuantSpec("nf4", 64, double_quant=False)
record = {"device": torch.cuda.get_device_name(dev), "cases": []}
def timed(call, n):
    times, hidden = harness.device_times(call, n, 30, facts, dev)
    return round(statistics.median(times) * 1e6, 2)
with torch.no_grad():
    for n, k in SHAPES:
        gen = torch.Generator(device=dev).manual_seed(0)
        weight = torch.randn(n, k, generator=gen, device=dev).to(torch.bfloat16)
        first = ours.quantize(weight, spec)
        sb = first.handle.packed.numel() + first.handle.absmax.numel() * 4
        count = harness.copies_for(sb, facts.cache_bytes)
        states = [first.handle] + [copy.deepcopy(first.handle) for _ in range(count - 1)]
        dws = [weight] + [weight.clone() for _ in range(harness.copies_for(n * k * 2, facts.cache_bytes) - 1)]
        st0 = states[0]
        deq = kernels.dequantize_4bit(st0.packed, st0.absmax, out_dtype=torch.bfloat16, **st0.kernel_args()).float()
        for rows in ROWS:
            xs = [torch.randn(rows, k, generator=gen, device=dev).to(torch.bfloat16) for _ in range(count)]
            ref = xs[0].float() @ deq.T; mag = xs[0].float().abs() @ deq.abs().T
            case = {"shape": f"{n}x{k}", "rows": rows, "t": {}}
            nd = len(dws)
            case["dense"] = timed(lambda i: F.linear(xs[i % count], dws[i % nd]), max(count, nd))
            plans = [P.linear_plan(xs[i], s.packed, s.absmax, s.kernel_args(), None, FUSED_MAX_ROWS,
                                   lambda dt, s=s: ours.buffered_weight(s, dt)) for i, s in enumerate(states)]
            case["route"] = timed(lambda i: plans[i](xs[i], None), count)
            work = torch.empty(rows, n, dtype=torch.float32, device=dev)
            for modname, tc_t in MODS.items():
             for cfg in grid(rows, modname):
                if time.perf_counter() - t0 > budget:
                    case["t"]["skipped"] = "budget"; break
                bm, bn, bk, w, stg, sp = cfg[:6]
                kw = {'maxnreg': cfg[6]} if len(cfg) > 6 else {}
                label = modname[3:] + f" m{bm}n{bn}k{bk}w{w}s{stg}x{sp}" + (f"r{cfg[6]}" if len(cfg) > 6 else "")
                try:
                    call = lambda i, tc_t=tc_t, bm=bm, bn=bn, bk=bk, w=w, stg=stg, sp=sp, kw=kw: tc_t.run(xs[i], states[i].packed, states[i].absmax, states[i].code, n, k,
                                                      bm, bn, bk, w, stg, split=sp, work=work, **kw)
                    got = call(0)
                    err = _error(got, ref, mag, k)
                    if err > 1:
                        case["t"][label] = {"error": err}; continue
                    case["t"][label] = {"us": timed(call, count), "error": round(err, 3)}
                except Exception as exc:
                    case["t"][label] = {"failed": f"{type(exc).__name__}: {str(exc)[-300:]}"}
            good = {l: v["us"] for l, v in case["t"].items() if isinstance(v, dict) and "us" in v}
            best = min(good, key=good.get) if good else None
            case["best"] = [best, good.get(best)]
            per = {}
            for l, v in good.items():
                mname = l.split()[0]
                if mname not in per or v < per[mname][1]:
                    per[mname] = (l.split()[1], v)
            print(f"{n}x{k} rows {rows}: dense {case['dense']} route {case['route']} " + " ".join(f"{m}:{c}={v}" for m, (c, v) in per.items()), flush=True)
            record["cases"].append(case)
            json.dump(record, open(out_path, "w"), indent=1)
