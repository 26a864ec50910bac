"""The 3x3 walk with its width a compile-time constant (every column's loads of a round
before their sums: cupy's _WALK_KW, numba_cuda's WALK_KW) against the width read at run
time, both backends, ABAB in one process: whole call the bench's way, the GPU part,
per-kernel times, bit-equality."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "mid", "big-f32"]
abab(dev, bw, names, ("cupy", "numba_cuda"), knob("_WALK_KW", "WALK_KW"), "KW", n=30)
