"""cupy's walk with its threads in groups of _WALK_DG neighbouring diagonals (each
group's walks start together, so that at every step the group reads neighbouring
128-byte rows of T, x1 = x + d, and writes neighbouring rows of S) against one diagonal
a run of threads (0: the 128-byte rows a block reads at a step lie 4 KB apart). ABAB in
one process: whole call the bench's way, the GPU part, per-kernel times, bit-equality."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "mid"]
flags = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("0", "4", "8", "16")
groups = knob(cupy="_WALK_DG", recompile=True, convert=int)
abab(dev, bw, names, ("cupy",), groups, "WALK_DG", flags=flags)
