# Twenty-second session (H200): cc_cluster, one launch a call (measured, not kept).
# Needs the library with docs/results/scripts/cluster.patch applied (git apply), run from
# the repository root: python3 docs/results/scripts/ab64.py. Results: docs/performance.md,
# "Twenty-second device session"; log: docs/results/h200-2026-12-01-22-cluster.log.
import sys
sys.path.insert(0, "docs/results/scripts")
from ab63 import run, V
R = [("three", False, None, [])]
for rot in (0, 1):
    for th, extra in ((1024, []), (512, ["-DCLUSTER_MIN_BLOCKS=2"])):
        for ph in (7, 4):
            R.append((f"cl{th} rot={rot} ph={ph}", True, th, extra + [f"-DCLUSTER_ROT={rot}", f"-DCLUSTER_PHASES={ph}"]))
run(16, R)
run(15, R[:1] + R[5:])
