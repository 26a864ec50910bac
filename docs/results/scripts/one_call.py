"""Two calls of one workload on one backend (warm-up, then the one to profile), for ncu:

    ncu --clock-control none -k regex:walk --launch-skip 1 --launch-count 1 \\
        python3 docs/results/scripts/one_call.py big-f16 cupy

(see ncu_next.sh)."""
import sys

import torch

import convcov
from convcov import bench

name, backend = sys.argv[1], sys.argv[2]
w = {w.name: w for w in bench.WORKLOADS}[name]
x = bench._inputs(bench._Cuda(), w)
for _ in range(2):
    convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=backend)
torch.cuda.synchronize()
