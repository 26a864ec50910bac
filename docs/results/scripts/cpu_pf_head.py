"""Experiment: phase 1 with software prefetch of only the first K lines of each gamma plane
(the L2 stream prefetcher to fetch the rest), at several distances, against the shipped
prefetch of every line 8 planes ahead. Interleaved rounds, both cores."""
import statistics, sys, time
from numba import njit
from _cpu_kernel import DEV as dev, SRC, compiled, inputs_and_calls, phases, with_prm
from convcov.backends import numba as nb

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 4
sets, calls = inputs_and_calls()
PHASE1 = phases(SRC)[0]

def make_pf(K):
    @njit(**nb._inner)
    def pf(addr, code, off, sx, sy, H, W, write):
        if sy != 1:
            return
        if sx == W:
            H, W = 1, H * W
        isz = nb._itemsize(code)
        for x in range(H):
            start = addr + (off + x * sx) * isz
            end = start + W * isz
            line = start & ~63
            k = 0
            while line < end and k < K:
                nb._prefetch_read(line)
                line += 64
                k += 1
    return pf

base = compiled(PHASE1, "_p1")
variants = {"p1 shipped (16 lines, 8 ahead)": base}
for K in (1, 2, 4):
    k = compiled(PHASE1, f"_p1k{K}", {"_prefetch_plane": make_pf(K)})
    for dist in (8, 16, 32):
        variants[f"p1 head {K} lines, {dist} ahead"] = with_prm(k, pf_gamma=dist)
variants["p1 no prefetch"] = with_prm(base, pf_gamma=0)
for f in variants.values():
    f(*calls[0])
res = {n: [] for n in variants}
names = list(variants)
for rnd in range(ROUNDS):
    for n in (names if rnd % 2 == 0 else names[::-1]):
        ts = []
        for i in range(30):
            prm, cv, M = calls[i % 3]
            t0 = time.perf_counter(); variants[n](prm, cv, M); ts.append(time.perf_counter() - t0)
        res[n].append(statistics.median(ts) * 1e6)
    print(rnd, flush=True)
for n, v in res.items():
    print(f"{n:34s} median {statistics.median(v):7.0f}  range {min(v):.0f}-{max(v):.0f}")
print("copy GB/s:", round(dev.copy_bandwidth() / 1e9, 1))
