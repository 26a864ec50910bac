"""Nineteenth session. In the bench runs where cupy lost `big-f32` to numba_cuda, cupy's
median was 5415-5460 µs against its usual 5381-5387, and numba_cuda's was its usual: one
block of cupy's 60 calls was slow. Is a slow block a moment of the GPU (then calls of
both backends in that moment are slow) or a property of cupy's call in that process (then
all of cupy's calls in it are)?

One process: the bench's inputs of one workload (one set, as the bench has for `big`),
both backends warmed up, then
  1. the bench's order: 60 calls of numba_cuda, then 60 of cupy (dev.time_calls);
  2. R rounds of N calls of each, the order alternating (AB, BA, ...), each round's
     medians printed;
  3. each backend's kernels (torch profiler, five calls back to back).
Usage: python ab61.py [workload=big-f32] [R=10] [N=10]; run it in several processes."""
import datetime
import statistics as st
import sys

from _timing import kernels

import convcov
from convcov import bench

name = sys.argv[1] if len(sys.argv) > 1 else "big-f32"
R = int(sys.argv[2]) if len(sys.argv) > 2 else 10
N = int(sys.argv[3]) if len(sys.argv) > 3 else 10
dev = bench._Cuda()
bw = dev.copy_bandwidth()
w = {w.name: w for w in bench.WORKLOADS}[name]
floor = w.floor_bytes() / bw * 1e6
print(f"copy {bw / 1e9:.0f} GB/s; {name} floor {floor:.1f} us", flush=True)
x = bench._inputs(dev, w)
calls = {be: (lambda be=be: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k,
                                               backend=be))
         for be in ("numba_cuda", "cupy")}
for f in calls.values():
    for _ in range(3):
        f()


def us(ts):
    return st.median(ts) * 1e6


def now():  # UTC to the millisecond, to line rounds up with sampled GPU clocks
    return datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M:%S.%f")[:-3]


print(f"{now()} bench order starts", flush=True)
seq = {be: dev.time_calls(f, 60, 10.0) for be, f in calls.items()}
print(f"{now()} bench order: " + "  ".join(f"{be} {us(t):8.1f}" for be, t in seq.items())
      + f"  (numba_cuda - cupy {us(seq['numba_cuda']) - us(seq['cupy']):+.1f})", flush=True)
ts = {be: [] for be in calls}
for r in range(R):
    order = list(calls) if r % 2 == 0 else list(calls)[::-1]
    line = []
    for be in order:
        t = dev.time_calls(calls[be], N, 10.0)
        ts[be] += t
        line.append(f"{be} {us(t):8.1f}")
    print(f"  {now()} r{r}: " + "  ".join(line), flush=True)
print("rounds: " + "  ".join(f"{be} {us(t):8.1f}" for be, t in ts.items())
      + f"  (numba_cuda - cupy {us(ts['numba_cuda']) - us(ts['cupy']):+.1f})", flush=True)
for be, f in calls.items():
    print(f"  {be} kernels: {kernels(f)}", flush=True)
