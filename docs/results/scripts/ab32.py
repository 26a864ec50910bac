"""numba_cuda's 3x3 walk with 8, 4 or 2 steps a round (WALK_U), then cupy's with 8, 16
or 4 (_WALK_U). Locally (numba_sass.py, nvJitLink 13.5) numba_cuda's walk takes 136
registers at 8 steps (one block of 256 threads a multiprocessor), 84 at 4 (three), 80 at
2 (three), no spills; cupy's (cupy_sass.py) 48 at 8, 86 at 16, 44 at 4. ABAB in one
process: whole call the bench's way, the GPU part, per-kernel times, bit-equality (the
steps a round do not change the sums). Run in the ninth session (10:49 UTC): 2 steps
shipped for numba_cuda, 4 for cupy."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "mid", "big-f32"]
steps = knob(cupy="_WALK_U", numba_cuda="WALK_U", recompile=True, convert=int)
abab(dev, bw, names, ("numba_cuda",), steps, "WALK_U", flags=("8", "4", "2"))
# cupy's 3x3 walk: 48 registers at 8 steps (five blocks a multiprocessor), 86 at 16 (two).
abab(dev, bw, names, ("cupy",), steps, "WALK_U", flags=("8", "16", "4"))
steps("numba_cuda", "8")
steps("cupy", "8")
