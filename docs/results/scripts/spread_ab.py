"""Twenty-fifth session: the numba kernel of this commit against the previous one (its numba.py saved as convcov/backends/_numba_old.py, not committed: git show 46e50e6:convcov/backends/numba.py), on the cpu workload: bits, then interleaved rounds of 30 calls. Usage: python docs/results/scripts/spread_ab.py ROUNDS from the repository root."""
import statistics, sys, time
sys.path.insert(0, "docs/results/scripts")
import numpy as np
from _cpu_kernel import inputs_and_calls, run_with, W
from convcov.backends import numba as nb, _numba_old as old
sets, calls = inputs_and_calls()
ks = {"old": old._parallel, "new": nb._parallel}
for k, f in ks.items():
    f(*calls[0])
a, b = sets[0]["out"].copy(), sets[0]["out"].copy()
run_with(old._parallel, a, sets[0]); run_with(nb._parallel, b, sets[0])
print("bits equal", np.array_equal(a, b), flush=True)
res = {k: [] for k in ks}
for r in range(int(sys.argv[1])):
    for k in (list(ks) if r % 2 == 0 else list(ks)[::-1]):
        ts = []
        for i in range(30):
            prm, cv, M = calls[i % 3]
            t0 = time.perf_counter(); ks[k](prm, cv, M); ts.append(time.perf_counter() - t0)
        res[k].append(statistics.median(ts) * 1e6)
for k, v in res.items():
    print(k, round(statistics.median(v)), [round(x) for x in v])
