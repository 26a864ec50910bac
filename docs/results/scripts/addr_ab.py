"""A/B: the numpy fast path's address read (direct struct read vs __array_interface__), bench timing of toy."""
import statistics, sys
from convcov import _frontend, bench
ways = {"direct": _frontend._address, "interface": _frontend._interface_address}
got = {}
for i in range(int(sys.argv[1])):
    for w in (list(ways) if i % 2 == 0 else list(ways)[::-1]):
        _frontend._address = ways[w]
        r = bench.run(device="cpu", workloads=["toy"], backends=["numba"], with_torch=False, repeat=400, budget_s=2.0)
        got.setdefault(w, []).append(r["rows"][0]["median_us"])
        print(i, w, round(got[w][-1], 1), flush=True)
for w, v in got.items():
    print(w, round(statistics.median(v), 1), [round(x, 1) for x in v])
