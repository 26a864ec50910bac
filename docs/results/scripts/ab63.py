# Twenty-second session (H200): cc_cluster, one launch a call (measured, not kept).
# Needs the library with docs/results/scripts/cluster.patch applied (git apply), run from
# the repository root: python3 docs/results/scripts/ab63.py. Results: docs/performance.md,
# "Twenty-second device session"; log: docs/results/h200-2026-12-01-22-cluster.log.
"""Session 22, device call: where cc_cluster's time goes (phases), and 2 blocks a multiprocessor."""
import sys
sys.path.insert(0, "docs/results/scripts")
import torch
import convcov
from ab62 import BK, mod, reset, took_cluster, make, gpu_part, whole, occ, CASES

EXTRA = []
_orig = mod._family_options
mod._family_options = lambda fam: _orig(fam) + tuple(EXTRA) if fam[0] == "cluster" else _orig(fam)


def run(Bn, variants):
    out, gamma, mu, c, kk, conv = make(Bn, *CASES[0][1:13])
    call = lambda: convcov.accumulate(out, gamma, mu, c, kk, **conv)
    for name, cl, th, extra in variants:
        EXTRA[:] = extra
        reset(cl, threads=th, fill=0.0)
        for _ in range(3):
            call()
        mc = None
        if cl:
            ln = list(BK._plans.values())[0].launches[0]
            mc = occ(ln)[0]
        gp = gpu_part(call)
        wc = whole(call, 200)
        print(f"B={Bn:2d} {name:28s} cluster={took_cluster()} max_clusters={mc} gpu_part {gp:7.1f} us whole {wc:7.1f} us", flush=True)
    del out, gamma, mu
    torch.cuda.empty_cache()


V = [("three", False, None, [])]
for ph in (7, 1, 3, 4, 5):
    V.append((f"cl1024 phases={ph}", True, 1024, [f"-DCLUSTER_PHASES={ph}"]))
V.append(("cl512x2", True, 512, ["-DCLUSTER_MIN_BLOCKS=2"]))
for ph in (1, 3, 4):
    V.append((f"cl512x2 phases={ph}", True, 512, ["-DCLUSTER_MIN_BLOCKS=2", f"-DCLUSTER_PHASES={ph}"]))
if __name__ == "__main__":
    run(15, V)
    run(16, [V[0], ("cl512x2", True, 512, ["-DCLUSTER_MIN_BLOCKS=2"]), ("cl1024", True, 1024, [])])
