"""Twenty-fifth session (Intel host): one process's toy calls on the numba backend, 1000 timed one by one after 20 warm-up calls: median and minimum; with argument 1, again after the bench's copy measurement. Run from the repository root, several processes in a row."""
import sys, time, numpy as np
import convcov
from convcov import bench
def loop(tag):
    W = next(x for x in bench.WORKLOADS if x.name == "toy")
    s = bench._inputs(bench._Host(), W)
    f = lambda: convcov.accumulate(s["out"], s["gamma"], s["mu"], s["c"], 3, backend="numba")
    for _ in range(20): f()
    ts = []
    for _ in range(1000):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    print(tag, "median %.1f min %.1f" % (np.median(ts) * 1e6, min(ts) * 1e6), flush=True)
loop("before copy_bandwidth")
if sys.argv[1] == "1":
    bench._Host().copy_bandwidth()
    loop("after copy_bandwidth")
    loop("after copy_bandwidth, again")
