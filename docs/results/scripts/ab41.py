"""cupy's update with S formed inside it (cc_stream_box: cc_gsum, then one kernel) against
the walk + cc_stream (three launches), and cc_stream_box's P (vectors of positions a
thread keeps S for; 4 / P channels in flight). ABAB in one process: whole call the bench's
way, the GPU part, per-kernel times. Then the Co = 1, 2, 4, 8 variants of big-f16 (one
group: Co / G channels share each element of S), fused (auto P) against not, for
_FUSED_MIN_COG.

Runs against scripts/fused-update.patch (git apply it first): the fused kernel was
measured in the tenth session (2026-11-30) and not kept, being slower everywhere."""
import sys

from _timing import abab
from convcov import bench
from convcov.backends import cupy as cb
from convcov import _frontend

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)


def set_flag(be, value):
    cb._FUSED = value != "off"
    cb._FUSED_MIN_COG = 1
    cb._FUSED_P = None if value in ("off", "auto") else int(value[1:])
    cb.backend._plans.clear()
    _frontend._bound.clear()


names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f16", "big-f32"]
flags = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("off", "p1", "p2", "p4")
abab(dev, bw, names, ("cupy",), set_flag, "FUSED", flags=flags)
if len(sys.argv) <= 3 or sys.argv[3] != "nocog":
    for co in (1, 2, 4, 8):
        w = bench.Workload(f"cog{co}", 32, 64, co, 32, 3, "diag", "float16", "cuda")
        bench.WORKLOADS.append(w)
        abab(dev, bw, [w.name], ("cupy",), set_flag, "FUSED", flags=("off", "auto"), rounds=1)
