"""Fifteenth session. How much of a small call's whole time is the host's, and how much of
that is the thread waking from the bench's wait. Per workload and implementation, three
timings interleaved call by call (medians of n each):
  idle  the bench's way: synchronize, then events around the call (dispatch included);
  warm  the same, but the thread spins 200 µs in Python between the synchronize and the
        call (the queue is still empty; the thread is running when the call starts);
  gpu   the GPU part: a sleep kernel queued first hides the host's dispatch.
cupy on mid and big-f16 also runs two launcher variants, interleaved the same way:
  cached  the scratch kept per (device, stream) instead of allocated and freed per call;
  bare    the bound launcher called directly (no front end: what the key and checks cost).
Usage: python probe15.py [n]"""
import statistics as st
import sys

import torch
from _timing import probe_setup, timed

import convcov
from convcov import _frontend, bench, torch_expr
from convcov.backends import cupy as cb

n, dev, bw, W = probe_setup(sys.argv)
compiled = torch.compile(torch_expr.accumulate, dynamic=False)



orig_scratch = cb.torch_scratch
cache = {}


def cached_scratch(nbytes, d, stream, current=False):
    k = (d, stream)
    e = cache.get(k)
    if e is None or e[2] < nbytes:
        blk, ptr = orig_scratch(nbytes, d, stream, current)
        e = cache[k] = (blk, ptr, nbytes)
    return None, e[1]


for name in ("toy", "mid", "big-f16"):
    w = W[name]
    x = bench._inputs(dev, w)
    o, g, m, c = x["out"], x["gamma"], x["mu"], x["c"]
    impls = {
        "cupy": lambda: convcov.accumulate(o, g, m, c, w.k, backend="cupy"),
        "numba_cuda": lambda: convcov.accumulate(o, g, m, c, w.k, backend="numba_cuda"),
        "torch.compile": lambda: compiled(o, g, m, c, w.k, w.k),
    }
    for f in impls.values():
        for _ in range(3):
            f()
    torch.cuda.synchronize()
    floor = w.floor_bytes() / bw * 1e6
    for iname, f in impls.items():
        cases = [(h, f, None) for h in ("idle", "warm", "gpu")]
        if iname == "cupy":
            f()
            entry = next(e for k, e in _frontend._bound.items()
                         if e is not None and k[5] == "cupy" and k[9] == o.shape)
            ptrs = (o.data_ptr(), g.data_ptr(), m.data_ptr(), c.data_ptr(), 0.0)
            bare = lambda: entry.run(o, g, m, c, *ptrs)  # noqa: E731
            cases += [("idle", f, "cached"), ("warm", f, "cached"),
                      ("idle", bare, "bare"), ("warm", bare, "bare")]
        res = {i: [] for i in range(len(cases))}
        for _ in range(n):
            for i, (how, fn, var) in enumerate(cases):
                cb.torch_scratch = cached_scratch if var == "cached" else orig_scratch
                res[i].append(timed(fn, how))
            torch.cuda.synchronize()
            res = {i: [(v if isinstance(v, float) else v[0].elapsed_time(v[1]) * 1e3)
                       for v in r] for i, r in res.items()}
        cb.torch_scratch = orig_scratch
        line = []
        for i, (how, fn, var) in enumerate(cases):
            t = st.median(res[i])
            lab = how + ("" if var is None else "/" + var)
            line.append(f"{lab} {t:8.1f}" + ("" if name == "toy" else f" ({floor / t:5.3f})"))
        print(f"{name:8s} {iname:13s} " + " | ".join(line), flush=True)
    x = o = g = m = c = None
    cache.clear()
    torch.cuda.empty_cache()
