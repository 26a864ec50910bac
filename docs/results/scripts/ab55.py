"""Sixteenth session; needs scripts/pipe.patch applied (`git apply`), which was not kept.
cupy's cc_pipe (the channel sum, the walk and the update in one
launch, pipelined over the (b, g) planes; SOURCE) against the three launches on `mid`,
ABAB in one process: first its lags (_PIPE_LAGS: rounds the walk and the update trail
the channel sum), then the blocks a multiprocessor named to ptxas (PIPE_MIN_BLOCKS, a
recompile each); same bits required every way.
Usage: python ab55.py [LW,LS ...] [--blocks] [--two]: the lags to try (default: the first
run's); --two: cc_gsum, then cc_pipe with the walk and the update only."""
import sys

from _timing import abab

from convcov import _frontend, bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy {bw / 1e9:.0f} GB/s", flush=True)


def replan():
    cb.backend._plans.clear()
    _frontend._bound.clear()


def lags(be, value):
    cb._PIPE = None if value == "three" else MODE
    if cb._PIPE:
        cb._PIPE_LAGS = value
    replan()


def blocks(be, value):
    cb._PIPE, cb._OPTIONS = MODE, ("-std=c++14", f"-DPIPE_MIN_BLOCKS={value}",
                                   f"-DPIPE2_MIN_BLOCKS={value}")
    cb.backend._modules.clear()
    cb.backend._functions.clear()
    replan()


MODE = "walk+update" if "--two" in sys.argv else "all"  # cc_pipe after cc_gsum, or alone
tried = [tuple(int(v) for v in a.split(",")) for a in sys.argv[1:] if "," in a]
if "--cg" in sys.argv:  # T and S in cc_pipe through L2 only (the first runs')
    cb._OPTIONS = ("-std=c++14", "-DPIPE_HINT=2")
abab(dev, bw, ["mid"], ["cupy"], lags, "pipe",
     flags=("three", *(tried or [(0, 0), (1, 2), (2, 3), (3, 5), (5, 8)])), rounds=2)
if "--blocks" in sys.argv or not tried:
    abab(dev, bw, ["mid"], ["cupy"], blocks, "min_blocks", flags=(3, 4, 5), rounds=2)
