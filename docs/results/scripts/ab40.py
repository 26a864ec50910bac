"""numba_cuda's update for float32 out with 4, 2 or 1 positions a thread (STREAM_P;
locally 90, 68 and 56 registers). On mid (out in 784-byte segments) its update takes
59 µs against cupy's 55 and a plain probe's 54 on the same rows (ab33.py). ABAB in one
process: whole call the bench's way, the GPU part, per-kernel times, bit-equality."""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f32"]
positions = knob(numba_cuda="STREAM_P", recompile=True, convert=int)
abab(dev, bw, names, ("numba_cuda",), positions, "STREAM_P", flags=("4", "2", "1"))
