"""Seventeenth session. cupy's cc_gsum with two rows a thread (GSUM_PAIR=1: rows p and
p + 1 share each load of mu's column, each row summed exactly as before, so the bits
must not change) against one row a thread, on mid, big-f16 and big-f32, ABAB in one
process, two rounds; the pair also with 3 blocks a multiprocessor named to ptxas. ab56.py
put a gamma-only read of mid's rows about 6 µs under cc_gsum (kernel times), and ab57.py
showed that summing mu's Gram terms in a loop of their own is slower: the mu loads cost
inside the loop, so this halves the column loads instead. (The grid is the one-row
grid; the blocks past the pairs' half exit at once.)

Run with scripts/gsum-pair.patch applied (it adds the knob; without it the -D flags do nothing)."""
import sys

from _timing import abab, knob

from convcov import bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
base = tuple(o for o in cb._OPTIONS if not o.startswith("-DGSUM_"))
MODES = {"one": (), "pair": ("-DGSUM_PAIR=1",),
         "pair3": ("-DGSUM_PAIR=1", "-DGSUM_MIN_BLOCKS=3")}
flag = knob(cupy="_OPTIONS", recompile=True, convert=lambda m: base + MODES[m])
abab(dev, bw, sys.argv[1:] or ["mid", "big-f16", "big-f32"], ["cupy"], flag, "gsum",
     flags=tuple(MODES), rounds=2)
