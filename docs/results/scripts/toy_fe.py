"""Twenty-fifth session (Intel host): where a toy call's time goes: the whole call, _accumulate_at, the kernel, and the front end with the kernel stubbed (timeit minima, 7 rounds). Run from the repository root."""
import timeit, statistics
import numpy as np
import convcov
from convcov import bench, _frontend
from convcov.backends import numba as nb
W = next(x for x in bench.WORKLOADS if x.name == "toy")
s = bench._inputs(bench._Host(), W)
out, g, mu, c = s["out"], s["gamma"], s["mu"], s["c"]
acc = lambda: convcov.accumulate(out, g, mu, c, 3, backend="numba")
acc()
p = _frontend.normalise(out, g, mu, c, 3, 1, 0, 1, 1)
prms = nb._params(p)
ptrs = (out.ctypes.data, g.ctypes.data, mu.ctypes.data, c.ctypes.data)
at = lambda: nb._accumulate_at(prms, *ptrs, 0.0)
prm, accd, plane = prms
q = prm.copy(); q[nb._O_ADDR], q[nb._G_ADDR], q[nb._M_ADDR], q[nb._C_ADDR] = ptrs
M = np.empty(q[nb._PAIRS] * plane, accd)
cv = accd(0.0)
ker = lambda: nb._parallel(q, cv, M)
noop = nb._parallel
real = nb._run
def fake(prm, c_value, M): pass
cases = {"accumulate": acc, "_accumulate_at": at, "kernel": ker}
res = {k: [] for k in cases}
res["accumulate, kernel stubbed"] = []
res["_accumulate_at, kernel stubbed"] = []
for r in range(7):
    for k, f in cases.items():
        res[k].append(min(timeit.repeat(f, number=300, repeat=3)) / 300 * 1e6)
    nb._run = fake
    res["accumulate, kernel stubbed"].append(min(timeit.repeat(acc, number=300, repeat=3)) / 300 * 1e6)
    res["_accumulate_at, kernel stubbed"].append(min(timeit.repeat(at, number=300, repeat=3)) / 300 * 1e6)
    nb._run = real
for k, v in res.items():
    print(f"{k:32s} {statistics.median(v):7.1f} us  {[round(x,1) for x in v]}")
