"""Fourteenth session. cupy's cc_gsum with its gamma loads asking L2 for 256-byte fills
(GSUM_HINT 2: ld.global.cs.L2::256B) against plain streaming loads (GSUM_HINT 1), on mid,
big-f16 and big-f32, ABAB in one process, two rounds, same bits required. The ncu run of
this session put mid's channel sum at 79% of the HBM peak (1 KB rows 32 KB apart) and
big-f16's at 90%."""
import sys

from _timing import abab, knob

from convcov import bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
base = tuple(o for o in cb._OPTIONS if not o.startswith("-DGSUM_HINT"))
flag = knob(cupy="_OPTIONS", recompile=True,
            convert=lambda on: base if on else base + ("-DGSUM_HINT=1",))
abab(dev, bw, sys.argv[1:] or ["mid", "big-f16", "big-f32"], ["cupy"], flag, "L2::256B", rounds=2)
