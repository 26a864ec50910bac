"""Experiment: phase 1 of pair s on one core while phase 2 of pair s-1 runs on the other
(a two-stage pipeline, M double-buffered), against the shipped kernel (both phases on both
cores, one after the other). Interleaved rounds on the cpu workload's inputs."""
import statistics, sys, textwrap, time
import numpy as np
from _cpu_kernel import DEV as dev, W as w, SRC, compiled, inputs_and_calls, run_with
from convcov.backends import numba as nb

ROUNDS = int(sys.argv[1]) if len(sys.argv) > 1 else 6
sets, calls = inputs_and_calls()
print("pairs per chunk in the shipped call:", calls[0][0][nb._PRM.index("pairs")],
      "M elements:", calls[0][2].size)

head, rest = SRC.split("    for first in range(0, B * G, pairs):\n")
p1 = rest.split("        # Phase 1:")[1].split("        # Phase 2:")[0]
p2 = rest.split("        # Phase 2:")[1]
p1 = "        # Phase 1:" + p1
p2 = "        # Phase 2:" + p2
def ed(code, old, new, count=1):
    assert code.count(old) == count, (old, code.count(old))
    return code.replace(old, new)
p1 = ed(p1, "for task in prange(n * H):", "for task in range(n * H):")
p1 = ed(p1, "dst = _offset(_data(M), (task * W + y0) * HW)", "dst = _offset(_data(M), ((slot * H + task) * W + y0) * HW)")
p2 = ed(p2, "for task in prange(n * Ho):", "for task in range(n * Ho):")
p2 = ed(p2, "at = ((t * H + x0) * W + y0) * HW", "at = (((t + slot) * H + x0) * W + y0) * HW")
p2 = ed(p2, "elif task + 1 < n * Ho", "elif task + 1 < n * Ho and False")
ind = lambda s, k: textwrap.indent(s, " " * k)
PIPE = (head  # (still named _kernel: compiled() renames it)
        + "    nch = B * G\n"
        + "    for step in range(nch + 1):\n"
        + "        for which in prange(2):\n"
        + "            n = 1\n"
        + "            if which == 0 and step < nch:\n"
        + "                first = step\n                slot = step % 2\n"
        + ind(p1, 8)
        + "            elif which == 1 and step >= 1:\n"
        + "                first = step - 1\n                slot = (step - 1) % 2\n"
        + ind(p2, 8))
pipe = compiled(PIPE, "_pipe")
p1only = compiled(ed(PIPE, "elif which == 1 and step >= 1:", "elif which == 1 and step >= 1 and step < 0:"), "_p1o")
p2only = compiled(ed(PIPE, "if which == 0 and step < nch:", "if which == 0 and step < nch and step < 0:"), "_p2o")

HW = w.H * w.H
Ms = [np.empty(2 * HW * HW, calls[0][2].dtype) for _ in range(3)]

# same bits?
a, b = sets[0]["out"].copy(), sets[0]["out"].copy()
run_with(nb._parallel, a, sets[0])
run_with(lambda prm, cv, M: pipe(prm, cv, Ms[0]), b, sets[0])
print("same bits:", np.array_equal(a, b))

variants = {"kernel": lambda i: nb._parallel(*calls[i % 3]),
            "pipe": lambda i: pipe(calls[i % 3][0], calls[i % 3][1], Ms[i % 3]),
            "p1 one core": lambda i: p1only(calls[i % 3][0], calls[i % 3][1], Ms[i % 3]),
            "p2 one core": lambda i: p2only(calls[i % 3][0], calls[i % 3][1], Ms[i % 3])}
for f in variants.values():
    f(0)
res = {n: [] for n in variants}
for rnd in range(ROUNDS):
    for n in (variants if rnd % 2 == 0 else list(variants)[::-1]):
        ts = []
        for i in range(40):
            t0 = time.perf_counter(); variants[n](i); ts.append(time.perf_counter() - t0)
        res[n].append(statistics.median(ts) * 1e6)
    print(rnd, {n: round(v[-1]) for n, v in res.items()}, flush=True)
for n, v in res.items():
    print(f"{n:10s} median {statistics.median(v):7.0f}  range {min(v):.0f}-{max(v):.0f}")
print("copy GB/s:", round(dev.copy_bandwidth() / 1e9, 1))
