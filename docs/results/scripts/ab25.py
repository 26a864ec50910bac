"""T stored by diagonals for the walk (T_SKEW: cupy's _T_SKEW, numba_cuda's T_SKEW)
against the plain (x0, y0, x1, y1) layout, both backends, ABAB in one process: whole
call the bench's way, the GPU part (host hidden behind a sleep kernel), per-kernel
times, bit-equality of the two layouts' results. Runs on commit ea08a59 with
t-skew.patch (here) applied; the change was measured slower and not kept."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "mid", "big-f32"]
abab(dev, bw, names, ("cupy", "numba_cuda"), knob("_T_SKEW", "T_SKEW"), "skew",
     rounds=int(sys.argv[2]) if len(sys.argv) > 2 else 2)
