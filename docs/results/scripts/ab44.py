"""cupy's channel sum (cc_gsum) with UNROLL = 8 channels' loads in flight a thread
against 4 (shipped; 76 -> 99 registers for float32, 89 -> 119 for float16). ABAB in one
process: whole call the bench's way, the GPU part, per-kernel times, bits."""
import sys

from _timing import abab
from convcov import _frontend, bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
SRC = cb.SOURCE


def set_flag(be, flag):
    cb.SOURCE = SRC.replace("#define UNROLL 4 ", f"#define UNROLL {flag} ")
    cb.backend._modules.clear(); cb.backend._functions.clear(); cb.backend._plans.clear()
    _frontend._bound.clear()


names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f16", "big-f32"]
flags = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("4", "8")
abab(dev, bw, names, ("cupy",), set_flag, "UNROLL", flags=flags)
