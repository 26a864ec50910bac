"""numba_cuda's dependent launches (convcov/backends/_pdl.py) off and on, the final code,
ABAB in one process (_timing.row), same bits required: mid four rounds, big-f16 two."""
from _timing import abab

from convcov import _frontend, bench
from convcov.backends import _pdl, numba_cuda as nc

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)


def set_flag(be, pdl):
    _pdl.ENABLED = pdl
    nc._plans.clear()  # plans and bound launchers remember how they launch
    _frontend._bound.clear()


abab(dev, bw, ["mid"], ["numba_cuda"], set_flag, "pdl", rounds=4)
abab(dev, bw, ["big-f16"], ["numba_cuda"], set_flag, "pdl", rounds=2)
