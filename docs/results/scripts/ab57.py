"""Seventeenth session. cupy's cc_gsum in two loops (gamma's channels, then mu's Gram
terms: GSUM_SPLIT=1, gamma's loop GSUM_U channels a step) against the one loop that sums
both a step of channels at a time (GSUM_SPLIT=0), on mid, big-f16 and big-f32, ABAB in one
process, two rounds. ab56.py read mid's gamma rows at 35.0-35.7 µs with plain kernels of
32-40 registers, where cc_gsum (76 registers, 3 blocks a multiprocessor) takes 38-40: the
split takes it to 44 (float32) and 60 (float16) registers. The sums' order changes, so the
bits may differ (the largest difference is printed).

Run with scripts/gsum-split.patch applied (it adds the knob; without it the -D flags do nothing)."""
import sys

from _timing import abab, knob

from convcov import bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
base = tuple(o for o in cb._OPTIONS if not o.startswith("-DGSUM_"))
MODES = {"one": (), "split4": ("-DGSUM_SPLIT=1", "-DGSUM_U=4"),
         "split8": ("-DGSUM_SPLIT=1", "-DGSUM_U=8")}
flag = knob(cupy="_OPTIONS", recompile=True, convert=lambda m: base + MODES[m])
abab(dev, bw, sys.argv[1:] or ["mid", "big-f16", "big-f32"], ["cupy"], flag, "gsum",
     flags=tuple(MODES), rounds=2)
