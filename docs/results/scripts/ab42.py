"""The 3x3 walks' inner rounds (WALK_INNER: no bounds tests and one base a round where a
diagonal's rows and columns are inside) against every round tested, both backends; and,
with them, twice the steps a round (cupy _WALK_U 4 -> 8, numba_cuda WALK_U 2 -> 4).
ABAB in one process: whole call the bench's way, the GPU part, per-kernel times, bits."""
import sys

from _timing import abab
from convcov import _frontend, bench
from convcov.backends import cupy as cb, numba_cuda as nc

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
OPT, CU, NU = cb._OPTIONS, cb._WALK_U, nc.WALK_U


def set_flag(be, flag):
    inner, double = flag != "off", flag == "on-2U"
    if be == "cupy":
        cb._OPTIONS = OPT if inner else OPT + ("-DWALK_INNER=0",)
        cb._WALK_U = 2 * CU if double else CU
        cb.backend._modules.clear(); cb.backend._functions.clear(); cb.backend._plans.clear()
    else:
        nc.WALK_INNER, nc.WALK_U = inner, 2 * NU if double else NU
        nc._compiled.clear(); nc._device_kernels.clear(); nc._plans.clear()
    _frontend._bound.clear()


names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "mid", "big-f32"]
flags = tuple(sys.argv[2].split(",")) if len(sys.argv) > 2 else ("off", "on", "on-2U")
abab(dev, bw, names, ("cupy", "numba_cuda"), set_flag, "INNER", flags=flags)
