"""Twenty-fifth session, issue 3, on the Intel Xeon host: how fast can both cores read
gamma's channel-diagonal pattern of the `cpu` workload (1 KB runs 16 KB apart, 32 MiB in
all), and which way of asking for the lines helps? Each variant sums every float of every
run (vectorised), both cores (prange over blocks of 64 runs); rounds interleave the
variants; a cell is the median over rounds of each round's median of 7 calls.

* ``plain``: loads only (the hardware prefetchers alone).
* ``t0 Dr`` / ``t1`` / ``t2`` / ``nta``: before summing run r, every line of run r + D is
  prefetched with locality 3 (prefetcht0, what the kernel ships), 2 (t1), 1 (t2) or 0
  (prefetchnta).
* ``spread Dr``: one line of run r + D prefetched (t0) per line summed, instead of a
  burst.
* ``contiguous``: the same bytes back to back, plain loads (the best case for the
  hardware prefetchers).
* ``np.copyto`` of 256 MiB: the bench's one-thread copy (bytes read + written), for scale.

Usage: ``python cpu_read_modes.py [rounds=5]`` from this folder."""
import statistics as st
import sys
import time

import numpy as np
from numba import njit, prange

from convcov.backends import numba as nb

N, RUN, STRIDE = 32768, 256, 4096  # runs; floats a run (1 KB); floats between runs (16 KB)


PF = {loc: nb._prefetcher(0, loc) for loc in (0, 1, 2, 3)}


def make(loc, mode):
    pf = PF[loc]

    @njit(parallel=True, fastmath=True)
    def runs(a, n, stride, run, dist):
        tot = np.zeros(n // 64, np.float32)
        base = a.ctypes.data
        for t in prange(n // 64):
            s = np.float32(0)
            for r in range(t * 64, t * 64 + 64):
                p = r * stride
                ahead = r + dist
                if mode == 1 and dist > 0 and ahead < n:  # a burst: the whole run ahead
                    q = base + ahead * stride * 4
                    for line in range(0, run * 4, 64):
                        pf(q + line)
                if mode == 2 and dist > 0 and ahead < n:  # spread: one line a line summed
                    q = base + ahead * stride * 4
                    for k in range(0, run, 16):
                        pf(q + k * 4)
                        for e in range(k, k + 16):
                            s += a[p + e]
                else:
                    for e in range(run):
                        s += a[p + e]
            tot[t] = s
        return tot.sum()

    return runs


buf = np.ones(N * STRIDE, np.float32)  # 537 MB
cont = np.ones(N * RUN, np.float32)
big_a = np.ones(64 << 20, np.float32)
big_b = np.empty_like(big_a)
cases = {"plain": (make(3, 0), buf, STRIDE, 0), "contiguous": (make(3, 0), cont, RUN, 0)}
for d in (4, 8, 16):
    cases[f"t0 {d}r"] = (make(3, 1), buf, STRIDE, d)
for d in (8,):
    cases[f"t1 {d}r"] = (make(2, 1), buf, STRIDE, d)
    cases[f"t2 {d}r"] = (make(1, 1), buf, STRIDE, d)
    cases[f"nta {d}r"] = (make(0, 1), buf, STRIDE, d)
for d in (4, 8):
    cases[f"spread {d}r"] = (make(3, 2), buf, STRIDE, d)
for f, a, stride, d in cases.values():
    f(a, N, stride, RUN, d)
np.copyto(big_b, big_a)
res = {label: [] for label in cases}
res["np.copyto"] = []
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for label, (f, a, stride, d) in cases.items():
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            f(a, N, stride, RUN, d)
            ts.append(time.perf_counter() - t0)
        res[label].append(st.median(ts))
    ts = []
    for _ in range(5):
        t0 = time.perf_counter()
        np.copyto(big_b, big_a)
        ts.append(time.perf_counter() - t0)
    res["np.copyto"].append(st.median(ts))
for label, v in res.items():
    m = st.median(v)
    nbytes = 2 * big_a.nbytes if label == "np.copyto" else N * RUN * 4
    print(f"{label:12s} {m * 1e6:8.0f} us  {nbytes / m / 1e9:5.1f} GB/s  "
          f"(rounds {', '.join(f'{x * 1e6:.0f}' for x in v)})", flush=True)
