"""Twenty-fifth session (issue 3, Intel host): the numba kernel with one task a (b, g) pair
(phase 1 and then phase 2 of the pair on one thread, one parallel region a chunk) against
the shipped kernel (phase 1 of every pair of a chunk, then phase 2, each spread over
(pair, row) tasks: two parallel regions a chunk, and M shared between the cores). Both
variants are the kernel's own source (``convcov.backends.numba._kernel``), the second
with its two loops rewritten, compiled like the kernel and called with the parameters of
a real ``convcov.accumulate`` call on the bench's inputs; bits compared; rounds
interleave the variants (timeit minima of 100 calls a round for ``toy``, medians of 20
calls for ``cpu``).

Usage: ``python docs/results/scripts/cpu_pairs.py [rounds=7]`` from the repository root."""
import statistics
import sys
import timeit

import numpy as np

sys.path.insert(0, "docs/results/scripts")
from _cpu_kernel import SRC, compiled  # noqa: E402

import convcov  # noqa: E402
from convcov import bench  # noqa: E402
from convcov.backends import numba as nb  # noqa: E402


def indent(block, n):
    return "".join((" " * n + line if line.strip() else line)
                   for line in block.splitlines(keepends=True))


def pairwise(src):
    head, rest = src.split("        # Phase 1:")
    p1, p2 = rest.split("        # Phase 2:")
    p1_head, p1_body = p1.split("        for task in prange(n * H):\n")
    p2_head, p2_body = p2.split("        for task in prange(n * Ho):\n")
    return (head + "        # One task a pair: its phase 1, then its phase 2.\n"
            + "        for tp in prange(n):\n"
            + "            for x0p in range(H):\n"
            + "                task = tp * H + x0p\n" + indent(p1_body, 4)
            + "            for i0p in range(Ho):\n"
            + "                task = tp * Ho + i0p\n" + indent(p2_body, 4))


def setup(name, nsets):
    w = next(x for x in bench.WORKLOADS if x.name == name)
    dev = bench._Host()
    sets = [bench._inputs(dev, w) for _ in range(nsets)]
    calls = []
    real = nb._run
    nb._run = lambda prm, cv, M: calls.append((prm.copy(), cv, M))
    try:
        for s in sets:
            convcov.accumulate(s["out"], s["gamma"], s["mu"], s["c"], w.k, backend="numba")
    finally:
        nb._run = real
    return sets, calls


def main(rounds):
    kernels = {"shipped": compiled(SRC, "k_shipped"), "pairs": compiled(pairwise(SRC), "k_pairs")}
    for name, nsets, number in (("toy", 1, 100), ("cpu", 3, 1)):
        sets, calls = setup(name, nsets)
        outs = {}
        for k, f in kernels.items():
            o = sets[0]["out"].copy()
            prm = calls[0][0].copy()
            prm[nb._O_ADDR] = o.ctypes.data
            f(prm, calls[0][1], calls[0][2])
            outs[k] = o
        same = np.array_equal(outs["shipped"], outs["pairs"])
        print(name, "bits equal:", same, flush=True)
        assert same
        res = {k: [] for k in kernels}
        for r in range(rounds):
            for k in (list(kernels) if r % 2 == 0 else list(kernels)[::-1]):
                f = kernels[k]
                if name == "toy":
                    prm, cv, M = calls[0]
                    t = min(timeit.repeat(lambda: f(prm, cv, M), number=number, repeat=3))
                    res[k].append(t / number * 1e6)
                else:
                    ts = []
                    for i in range(20):
                        prm, cv, M = calls[i % nsets]
                        ts.append(timeit.timeit(lambda: f(prm, cv, M), number=1))
                    res[k].append(statistics.median(ts) * 1e6)
        for k, v in res.items():
            print(f"{name:4s} {k:8s} {statistics.median(v):9.1f} us  "
                  f"{[round(x, 1) for x in v]}", flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 7)
