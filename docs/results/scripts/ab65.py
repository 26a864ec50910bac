# Twenty-second session (H200): cc_cluster, one launch a call (measured, not kept).
# Needs the library with docs/results/scripts/cluster.patch applied (git apply), run from
# the repository root: python3 docs/results/scripts/ab65.py. Results: docs/performance.md,
# "Twenty-second device session"; log: docs/results/h200-2026-12-01-22-cluster.log.
import sys
sys.path.insert(0, "docs/results/scripts")
from ab63 import run
R = [("three", False, None, [])]
for u in (2, 4, 8, 16):
    R.append((f"cl1024 U={u} ph=4", True, 1024, [f"-DCLUSTER_U={u}", "-DCLUSTER_PHASES=4"]))
for u in (8, 16):
    R.append((f"cl512 U={u} ph=4", True, 512, [f"-DCLUSTER_U={u}", "-DCLUSTER_PHASES=4"]))
    R.append((f"cl512x2 U={u} ph=4", True, 512, ["-DCLUSTER_MIN_BLOCKS=2", f"-DCLUSTER_U={u}", "-DCLUSTER_PHASES=4"]))
    R.append((f"cl512x2 U={u} ph=7", True, 512, ["-DCLUSTER_MIN_BLOCKS=2", f"-DCLUSTER_U={u}"]))
run(15, R)
run(16, R[:1] + R[-2:])
