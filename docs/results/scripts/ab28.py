"""numba_cuda's once-a-thread index divisions in 32 bits when the values fit (DIV32:
gsum's and sbox_walk's position, the out update's tile) against 64-bit floor division,
ABAB in one process: whole call the bench's way, the GPU part, per-kernel times,
bit-equality. (As run, DIV32 also covered the float16 update's tile divisions; shipped
without them, see performance.md.)"""
import sys

from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f16", "big-f32"]
abab(dev, bw, names, ("numba_cuda",), knob(numba_cuda="DIV32", recompile=True), "DIV32")
