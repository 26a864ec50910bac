"""Twenty-fifth session (Intel host): the numba kernel on toy in parts (both phases, phase 1, phase 2, empty prange regions), parallel and serial, compiled from the kernel's source like cpu_parts.py; timeit minima, 7 rounds. Run from the repository root."""
import sys, timeit, statistics
sys.path.insert(0, "docs/results/scripts")
import numpy as np
from numba import njit
import convcov
from convcov import bench, _frontend
from convcov.backends import numba as nb
from _cpu_kernel import SRC, phases
W = next(x for x in bench.WORKLOADS if x.name == "toy")
dev = bench._Host()
s = bench._inputs(dev, W)
calls = []
real = nb._run
nb._run = lambda prm, cv, M: calls.append((prm.copy(), cv, M))
convcov.accumulate(s["out"], s["gamma"], s["mu"], s["c"], 3, backend="numba")
nb._run = real
prm, cv, M = calls[0]
P1, P2 = phases(SRC)
def comp(code, name, parallel):
    ns = dict(nb.__dict__)
    exec(code.replace("def _kernel(", f"def {name}("), ns)
    return njit(parallel=parallel, nogil=True, error_model="numpy")(ns[name])
EMPTY = SRC.split("    for first in range(")[0] + "    for first in range(0, B * G, pairs):\n        n = min(pairs, B * G - first)\n        for task in prange(n * H):\n            pass\n        for task in prange(n * Ho):\n            pass\n"
vs = {}
for par in (True, False):
    for nm, code in (("both", SRC), ("p1", P1), ("p2", P2), ("empty", EMPTY)):
        f = comp(code, f"k_{nm}_{par}", par)
        f(prm, cv, M)
        vs[f"{nm} {'par' if par else 'ser'}"] = f
fe = lambda: convcov.accumulate(s["out"], s["gamma"], s["mu"], s["c"], 3, backend="numba")
res = {k: [] for k in list(vs) + ["accumulate"]}
for r in range(7):
    for k, f in vs.items():
        res[k].append(min(timeit.repeat(lambda: f(prm, cv, M), number=200, repeat=3)) / 200 * 1e6)
    res["accumulate"].append(min(timeit.repeat(fe, number=200, repeat=3)) / 200 * 1e6)
for k, v in res.items():
    print(f"{k:12s} {statistics.median(v):7.1f} us  {[round(x,1) for x in v]}")
