"""Nineteenth session, issue 3: does the host's hardware prefetcher fetch the rest of a
4 KB page past a 1 KB run, so that gamma's channel-diagonal planes (1 KB runs 16 KB
apart in the `cpu` workload, at page offsets 0, 1, 2 or 3 KB by channel) cost extra
bytes? Both cores read 32768 such runs, one load a 64-byte line, all at page offset k
KB; then the same bytes back to back. A run at offset 3 KB ends at its page's end, where
a stream prefetcher must stop: if over-fetch were the cost, it would be much faster.

Usage: python overfetch.py [rounds=7]; medians of 7 calls a round, median over rounds."""
import statistics as st
import sys
import time

import numpy as np
from numba import njit, prange

N, RUN, STRIDE = 32768, 256, 4096  # runs; floats a run (1 KB); floats between runs (16 KB)


@njit(parallel=True)
def runs(a, off, n, stride, run):
    tot = np.zeros(n // 64)
    for t in prange(n // 64):
        s = 0.0
        for r in range(t * 64, t * 64 + 64):
            p = off + r * stride
            for e in range(0, run, 16):  # one load a 64-byte line
                s += a[p + e]
        tot[t] = s
    return tot.sum()


buf = np.ones(N * STRIDE + 4096, np.float32)  # 537 MB
page = (-buf.ctypes.data // 4) % 1024  # floats to the first 4 KB boundary
cont = np.ones(N * RUN, np.float32)
cases = {**{f"offset {k} KB": (buf, page + 256 * k, STRIDE) for k in range(4)},
         "back to back": (cont, 0, RUN)}
for a, off, stride in cases.values():
    runs(a, off, N, stride, RUN)
res = {label: [] for label in cases}
for _ in range(int(sys.argv[1]) if len(sys.argv) > 1 else 7):
    for label, (a, off, stride) in cases.items():
        ts = []
        for _ in range(7):
            t0 = time.perf_counter()
            runs(a, off, N, stride, RUN)
            ts.append(time.perf_counter() - t0)
        res[label].append(st.median(ts))
for label, v in res.items():
    m = st.median(v)
    print(f"{label:14s} {m * 1e6:8.0f} us  {N * RUN * 4 / m / 1e9:5.1f} GB/s  "
          f"(rounds {', '.join(f'{x * 1e6:.0f}' for x in v)})")
