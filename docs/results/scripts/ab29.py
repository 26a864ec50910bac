"""cupy's cc_gsum: every load of a step before its sums (GSUM_PAIRWISE=1, the step's
gamma terms summed pairwise) against the channel-by-channel step (0), with 4, 3 or no
blocks a multiprocessor named to ptxas (GSUM_MIN_BLOCKS), ABAB in one process: whole
call the bench's way, the GPU part, per-kernel times, and how far each variant's
results are from the first's (the summation order differs). The "old" variant
(GSUM_PAIRWISE=0) needs commit d9814ea: the channel-by-channel step was removed after."""
import sys

from _timing import abab
from convcov import bench, _frontend
from convcov.backends import cupy as cb

OPT = cb._OPTIONS
VARIANTS = {"old": ("-DGSUM_PAIRWISE=0", "-DGSUM_MIN_BLOCKS=0"), "pair4": ("-DGSUM_MIN_BLOCKS=4",),
            "pair3": ("-DGSUM_MIN_BLOCKS=3",), "pair0": ("-DGSUM_MIN_BLOCKS=0",)}


def variant(be, v):
    cb._OPTIONS = OPT + VARIANTS[v]
    b = cb.backend
    b._modules.clear(); b._functions.clear(); b._plans.clear()
    _frontend._bound.clear()


dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "big-f32", "mid"]
order = sys.argv[2].split(",") if len(sys.argv) > 2 else ["old", "pair4", "pair3", "pair0"]
abab(dev, bw, names, ("cupy",), variant, "gsum", flags=order)
variant("cupy", "pair0")
