"""How the bench's wait for an empty queue changes a whole call's time. The bench waits
with torch.cuda.synchronize() before each call (3-5 ms on big); the host code of the next
call then runs several times slower than after a short wait (eighth session, ab27.py).
Here, per backend and workload, median whole-call times (events around one call after
an empty queue, as the bench) with three ways of waiting, ABAB in one process:

* sync: torch.cuda.synchronize(), the bench's way;
* poll: a Python loop on an event recorded behind the queue (event.query()) until it
  has passed: the same empty queue, the host never blocks;
* sync+spin: synchronize, then 200 µs of busy host loop before the call.

and the GPU part (host hidden behind a sleep kernel) for reference."""
import statistics as st
import sys
import time

import torch

from _timing import measure, rotating
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f16", "big-f32"]
workloads = {w.name: w for w in bench.WORKLOADS}


def wait(how):
    if how == "poll":
        e = torch.cuda.Event()
        e.record()
        while not e.query():
            pass
    else:
        torch.cuda.synchronize()
        if how == "sync+spin":
            t = time.perf_counter() + 200e-6
            while time.perf_counter() < t:
                pass


def whole(f, how, n=40):
    ts = []
    for _ in range(n):
        wait(how)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); f(); e1.record()
        ts.append((e0, e1))
    torch.cuda.synchronize()
    return st.median(e0.elapsed_time(e1) * 1e3 for e0, e1 in ts)


for name in names:
    w = workloads[name]
    sets = [bench._inputs(dev, w) for _ in range(1 if w.floor_bytes() > 2**30 else 3)]
    floor = w.floor_bytes() / bw * 1e6
    for be in ("cupy", "numba_cuda"):
        f = rotating(sets, w, be)
        for _ in range(5):
            f()
        for rnd in range(2):
            cells = []
            for how in ("sync", "poll", "sync+spin"):
                us = whole(f, how)
                cells.append(f"{how} {us:7.1f} ({floor/us:5.3f})")
            print(f"{name:8s} {be:10s} r{rnd}: " + "  ".join(cells)
                  + f"  gpu part {measure(f, 20)[1]:7.1f}", flush=True)
    sets = None
    torch.cuda.empty_cache()
