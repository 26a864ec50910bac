"""Where a cupy call's host time goes, by what the host did before it: perf_counter
marks inside the fast path (entering _torch_fast, cupy's _enter, the stream read, the
scratch allocation, the first launch) of a timed call made right after
  A  a mid call and torch.cuda.synchronize (the bench's way, on mid),
  B  a big-f16 call and synchronize (a mid call after a 3 ms wait),
  C  a big-f16 call and synchronize, the timed call big-f16 (the bench on big-f16),
  D  as C, the wait a Python loop polling an event (the thread never blocks),
  E  a mid call, synchronize, then time.sleep(3 ms) (the thread idle 3 ms).
Medians over 40 calls each, in µs from the call's start; 'whole' is e0 -> e1 on the GPU."""
import statistics as st
import time

import cupy
import torch

import convcov
from convcov import _frontend, bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
WL = {w.name: w for w in bench.WORKLOADS}
X = {n: bench._inputs(dev, WL[n]) for n in ("mid", "big-f16")}
marks = []


def wrap(obj, name, label, once=False):
    orig = getattr(obj, name)

    def f(*a, **k):
        if not (once and any(m[0] == label for m in marks)):
            marks.append((label, time.perf_counter()))
        return orig(*a, **k)
    setattr(obj, name, f)


def call(n):
    x = X[n]
    convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], WL[n].k, backend="cupy")


for n in X:  # compile, bind the fast path
    for _ in range(3):
        call(n)
torch.cuda.synchronize()
wrap(_frontend, "_torch_fast", "fast")
wrap(cb.CupyBackend, "_enter", "enter")
wrap(cb, "current_stream", "stream")
wrap(cb, "torch_scratch", "scratch")
wrap(cupy.cuda.driver, "launchKernel", "launch", once=True)


def wait_poll():
    ev = torch.cuda.Event()
    ev.record()
    while not ev.query():
        pass


scen = {"A": ("mid", torch.cuda.synchronize, "mid"), "B": ("big-f16", torch.cuda.synchronize, "mid"),
        "C": ("big-f16", torch.cuda.synchronize, "big-f16"), "D": ("big-f16", wait_poll, "big-f16"),
        "E": ("mid", lambda: (torch.cuda.synchronize(), time.sleep(0.003)), "mid")}
for rnd in range(2):
    for key, (prev, wait, timed) in scen.items():
        rows = []
        for _ in range(40):
            call(prev)
            wait()
            marks.clear()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            call(timed)
            t1 = time.perf_counter()
            e1.record()
            torch.cuda.synchronize()
            rows.append(({k: (t - t0) * 1e6 for k, t in marks} | {"ret": (t1 - t0) * 1e6},
                         e0.elapsed_time(e1) * 1e3))
        keys = rows[0][0].keys()
        print(f"r{rnd} {key} {prev:7s} -> {timed:7s} host µs: "
              + " ".join(f"{k}@{st.median(r[0][k] for r in rows):.1f}" for k in keys)
              + f" | whole {st.median(r[1] for r in rows):.1f}", flush=True)
