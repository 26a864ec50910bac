"""Fifteenth session, after the kept scratch (_arrays.kept_torch_scratch). cupy's bound
launcher with its kept scratch against the same launcher taking and freeing scratch each
call (KEEP_SCRATCH = 0 when bound, the code before this session), interleaved call by
call, medians of n each:
  idle  the bench's way: synchronize, then CUDA events around the whole call;
  warm  the same after the thread has spun 200 µs in Python;
  gpu   the GPU part (a sleep kernel queued first hides the host's dispatch).
Usage: python probe15b.py [n]"""
import statistics as st
import sys

import torch
from _timing import probe_setup, timed

import convcov
from convcov import _frontend, bench
from convcov.backends import cupy as cb

n, dev, bw, W = probe_setup(sys.argv)

for name in ("toy", "mid", "big-f16", "big-f32"):
    w = W[name]
    x = bench._inputs(dev, w)
    o, g, m, c = x["out"], x["gamma"], x["mu"], x["c"]
    f = lambda: convcov.accumulate(o, g, m, c, w.k, backend="cupy")  # noqa: E731
    runs = {}
    for keep in (0, cb.KEEP_SCRATCH):
        cb.KEEP_SCRATCH = keep
        _frontend._bound.clear()
        for _ in range(3):
            f()
        (key, entry), = [(k, e) for k, e in _frontend._bound.items() if e is not None]
        runs["kept" if keep else "fresh"] = entry.run
    torch.cuda.synchronize()
    floor = w.floor_bytes() / bw * 1e6
    cases = [(h, v) for h in ("idle", "warm") for v in ("kept", "fresh")] + [("gpu", "kept")]
    res = {case: [] for case in cases}
    for _ in range(n):
        for case in cases:
            entry.run = runs[case[1]]
            res[case].append(timed(f, case[0]))
        torch.cuda.synchronize()
    line = []
    for case in cases:
        t = st.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in res[case])
        line.append(f"{case[0]}/{case[1]} {t:8.1f}" + ("" if name == "toy" else f" ({floor / t:5.3f})"))
    print(f"{name:8s} cupy " + " | ".join(line), flush=True)
    entry.run = runs["kept"]
    x = o = g = m = c = f = None
    torch.cuda.empty_cache()
