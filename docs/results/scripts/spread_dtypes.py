"""Twenty-fifth session: as spread_ab.py, for the cpu workload in float16 and float64 (five rounds of 20 calls)."""
import statistics, sys, time, dataclasses
sys.path.insert(0, "docs/results/scripts")
import numpy as np
import convcov
from convcov import bench
from convcov.backends import numba as nb, _numba_old as old
import _cpu_kernel as ck
for dt in ("float16", "float64"):
    w = dataclasses.replace(ck.W, dtype=dt)
    sets = [bench._inputs(ck.DEV, w) for _ in range(3)]
    calls = []
    real = nb._run
    nb._run = lambda prm, cv, M: calls.append((prm.copy(), cv, M))
    for s in sets:
        convcov.accumulate(s["out"], s["gamma"], s["mu"], s["c"], w.k, backend="numba")
    nb._run = real
    ks = {"old": old._parallel, "new": nb._parallel}
    outs = {}
    for k, f in ks.items():
        o = sets[0]["out"].copy(); prm = calls[0][0].copy(); prm[nb._O_ADDR] = o.ctypes.data
        f(prm, calls[0][1], calls[0][2]); outs[k] = o
    print(dt, "pf", calls[0][0][nb._PRM.index("pf_gamma")], "bits equal", np.array_equal(outs["old"], outs["new"]), flush=True)
    res = {k: [] for k in ks}
    for r in range(5):
        for k in (list(ks) if r % 2 == 0 else list(ks)[::-1]):
            ts = []
            for i in range(20):
                prm, cv, M = calls[i % 3]
                t0 = time.perf_counter(); ks[k](prm, cv, M); ts.append(time.perf_counter() - t0)
            res[k].append(statistics.median(ts) * 1e6)
    for k, v in res.items():
        print(dt, k, round(statistics.median(v)), [round(x) for x in v], flush=True)
