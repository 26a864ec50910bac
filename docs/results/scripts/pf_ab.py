"""Twenty-fifth session (Intel host): A/B of the numba kernel's prefetch distance (PREFETCH_BYTES) on the cpu workload, bench timing, the order reversed every other round. Usage: python docs/results/scripts/pf_ab.py ROUNDS 8192,4096,2048"""
import statistics, sys
from convcov import _frontend, bench
from convcov.backends import numba as nb
got = {}
ds = [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [8192, 4096]
for i in range(int(sys.argv[1])):
    for d in (ds if i % 2 == 0 else ds[::-1]):
        nb.PREFETCH_BYTES = d
        _frontend._bound.clear()
        r = bench.run(device="cpu", workloads=["cpu"], backends=["numba"], with_torch=False,
                      repeat=60, budget_s=1.0)
        m = r["rows"][0]["median_us"]
        got.setdefault(d, []).append(m)
        print(i, d, round(m, 1), round(r["copy_bandwidth_GBps"], 1), flush=True)
for d, v in got.items():
    print(d, round(statistics.median(v), 1), [round(x) for x in v])
