"""Does mid's process-to-process spread (131-154 µs for numba_cuda in separate bench
processes, eighth session) live in the GPU part or on the host? Run this in several
fresh processes: each times mid on both GPU backends the bench's way (three rotating
input sets), as the GPU part (host hidden behind a sleep kernel) and per kernel."""
import sys

from _timing import rotating, row
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
w = {w.name: w for w in bench.WORKLOADS}["mid"]
sets = [bench._inputs(dev, w) for _ in range(3)]
tag = sys.argv[1] if len(sys.argv) > 1 else ""
for rnd in range(2):
    for be in ("numba_cuda", "cupy"):
        f = rotating(sets, w, be)
        print(f"process {tag} copy {bw/1e9:.0f} GB/s mid {be:10s} r{rnd}: {row(dev, f, w, bw)}",
              flush=True)
