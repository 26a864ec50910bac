"""numba_cuda's update with every position's offsets computed before the first load
(STREAM_INDEX_FIRST) against each position's loads right after its own index arithmetic
(two divisions a position for out in segments, as mid's full layout; locally the first
load of position 3 came some 700 SASS lines after position 0's). ABAB in one process:
whole call the bench's way, the GPU part, per-kernel times, bit-equality. Run once
(ninth session, 11:08 UTC): the offsets first took 94 registers locally and were far
slower on the H200 (mid's update 59 -> 74 us, big-f32's 3300 -> 3691), so the knob was
removed; the run's code loaded through a device function load(k, ...) called from the
offsets loop, or from a second loop over the positions when STREAM_INDEX_FIRST."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f32"]
first = knob(numba_cuda="STREAM_INDEX_FIRST", recompile=True, convert=lambda v: v == "True")
abab(dev, bw, names, ("numba_cuda",), first, "INDEX_FIRST", flags=("False", "True"))
first("numba_cuda", "True")
