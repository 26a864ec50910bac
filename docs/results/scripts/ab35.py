"""cupy's batch passes (_L2_SHARE: the three launches in passes of batches whose T and S
fit that share of L2, over one T and S) against one pass, on big (T and S 7.4 MB a
batch, 237 MB in all); then the walk at 4 against 2 steps a round. ABAB in one process:
whole call the bench's way, the GPU part, per-kernel times (summed over the passes),
bit-equality (each batch's sums are the same either way). Run once (ninth session,
10:54 UTC) with scripts/batch-passes.patch applied; the passes were slower and were not
kept, so this script needs that patch (and _WALK_U = 4 against 2 ran with it too)."""
import sys

import cupy
from _timing import abab, knob
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
l2 = cupy.cuda.Device(0).attributes["L2CacheSize"]
print(f"copy bandwidth {bw/1e9:.0f} GB/s, L2 {l2 / 2**20:.0f} MiB", flush=True)
names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "big-f32"]
abab(dev, bw, names, ("cupy",), knob(cupy="_L2_SHARE", convert=float), "L2_SHARE",
     flags=("0", "0.25", "0.5", "0.75"))
share = sys.argv[2] if len(sys.argv) > 2 else "0.5"
knob(cupy="_L2_SHARE", convert=float)("cupy", share)
abab(dev, bw, names[:1], ("cupy",), knob(cupy="_WALK_U", recompile=True, convert=int),
     "WALK_U", flags=("4", "2"))
