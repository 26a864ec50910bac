"""cupy's update (cc_stream) for 16-bit out: output channels a thread updates from each
vector of S it loads (CH, _stream_ch: 2) and vectors of out in flight a thread
(STREAM_SU: 4), as SU/CH: 4/2 (shipped), 4/4, 8/4, 8/2. ABAB in one process: whole call
the bench's way, the GPU part, per-kernel times, bits."""
import sys

from _timing import abab
from convcov import _frontend, bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
SRC, CH = cb.SOURCE, cb._stream_ch


def set_flag(be, flag):
    su, ch = (int(v) for v in flag.split("/"))
    cb.SOURCE = SRC.replace("#define STREAM_SU 4", f"#define STREAM_SU {su}")
    cb._STREAM_SU = su
    cb._stream_ch = lambda o, a: ch if o in ("f16", "bf16") and a == "float" else CH(o, a)
    cb.backend._modules.clear(); cb.backend._functions.clear(); cb.backend._plans.clear()
    _frontend._bound.clear()


names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16"]
flags = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("4/2", "4/4", "8/4", "8/2")
abab(dev, bw, names, ("cupy",), set_flag, "SU/CH", flags=flags)
