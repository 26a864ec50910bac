"""numba_cuda's dependent launches (convcov/backends/_pdl.py) off and on, the final code,
ABAB in one process (_timing.row), same bits required: mid four rounds, big-f16 two."""
from _timing import abab, knob

from convcov import bench
from convcov.backends import _pdl

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
base = knob(numba_cuda="_plans")  # only for what it clears (plans, bound launchers)


def set_flag(be, pdl):
    _pdl.ENABLED = pdl
    base(be, {})


abab(dev, bw, ["mid"], ["numba_cuda"], set_flag, "pdl", rounds=4)
abab(dev, bw, ["big-f16"], ["numba_cuda"], set_flag, "pdl", rounds=2)
