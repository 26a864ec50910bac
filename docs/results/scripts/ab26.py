"""Where a whole call's time beyond its GPU part goes on the big workloads: per-kernel
times with the calls queued back to back against one call at a time (the bench's way,
an empty queue before each), and whole calls after host idle gaps of 0, 1 and 10 ms
before each. Both GPU backends."""
import statistics as st, sys, time
import torch, convcov
from _timing import kernels, measure
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
WL = {w.name: w for w in bench.WORKLOADS}


def whole(f, gap, n=30):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        if gap:
            time.sleep(gap)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(); f(); e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return st.median(ts)


for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "big-f32", "mid"]):
    w = WL[name]
    x = bench._inputs(dev, w)
    for be in ("cupy", "numba_cuda"):
        f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)
        for _ in range(3):
            f()
        for rnd in range(2):
            wh, gp = measure(f)
            print(f"{name:8s} {be:10s} r{rnd} whole {wh:8.1f} gpu {gp:8.1f} | gaps 0/1/10 ms: "
                  + " / ".join(f"{whole(f, g):.1f}" for g in (0, 0.001, 0.01)), flush=True)
            print(f"   queued [{kernels(f, 8)}]", flush=True)
            print(f"   synced [{kernels(f, 8, synced=True)}]", flush=True)
    x = None  # free this workload's arrays before the next one's
    torch.cuda.empty_cache()
