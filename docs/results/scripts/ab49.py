"""Programmatic dependent launch (convcov/backends/_pdl.py), ABAB in one process
(_timing.row: the bench's median, whole call and GPU part, per-kernel times), with the
same bits required every way:
* cupy: off (plain launches, the update's loads in their old order: the code before),
  wait (dependent launches, the update waits first), pre (dependent launches, the update's
  first tile of out loaded before its wait: STREAM_PREFETCH);
* numba_cuda: the same three, and the update capped at 80 registers (pre80, wait80: 3
  blocks a multiprocessor instead of 2).
On mid, big-f16 and big-f32. Needs scripts/cupy-pdl.patch and
scripts/numba-stream-prefetch.patch applied (the cupy variants and numba_cuda's
STREAM_PREFETCH and STREAM_MAX_REGISTERS knobs; neither was kept)."""
import torch

from _timing import abab

from convcov import _frontend, bench
from convcov.backends import _pdl, cupy as cb, numba_cuda as nc

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
OPT = cb._OPTIONS
VARIANTS = {  # name -> (pdl, prefetch, numba_cuda's register cap)
    "off": (False, False, 0), "wait": (True, False, 0), "pre": (True, True, 0),
    "pre80": (True, True, 80), "wait80": (True, False, 80),
}


def set_flag(be, name):
    pdl, pre, cap = VARIANTS[name]
    _pdl.ENABLED = pdl
    if be == "cupy":
        cb._OPTIONS = OPT + (f"-DSTREAM_PREFETCH={int(pre)}",)
        cb.backend._modules.clear(); cb.backend._functions.clear(); cb.backend._plans.clear()
    else:
        nc.STREAM_PREFETCH, nc.STREAM_MAX_REGISTERS = pre, cap
        nc._compiled.clear(); nc._device_kernels.clear(); nc._plans.clear()
    _frontend._bound.clear()


for names in (["mid"], ["big-f16"], ["big-f32"]):
    abab(dev, bw, names, ["cupy"], set_flag, "pdl", flags=("off", "wait", "pre"), rounds=2)
    abab(dev, bw, names, ["numba_cuda"], set_flag, "pdl",
         flags=("off", "wait", "pre", "pre80", "wait80"), rounds=2)
print(f"copy {dev.copy_bandwidth() / 1e9:.0f} GB/s", flush=True)
