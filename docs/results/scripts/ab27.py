"""A whole cupy call's timeline, host and GPU, on mid and the big workloads: host
perf_counter offsets of the scratch allocation and of each launch, and GPU event
timestamps recorded after each launch (one call at a time, an empty queue before each,
as the bench times it)."""
import statistics as st, sys, time
import torch, convcov, cupy
from convcov import bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
WL = {w.name: w for w in bench.WORKLOADS}
orig_launch, orig_scratch = cupy.cuda.driver.launchKernel, cb.torch_scratch
marks, events = [], []


def launch(*a):
    marks.append(("L0", time.perf_counter()))
    orig_launch(*a)
    marks.append(("L1", time.perf_counter()))
    ev = torch.cuda.Event(enable_timing=True)
    ev.record()
    events.append(ev)


def scratch(*a):
    marks.append(("S0", time.perf_counter()))
    r = orig_scratch(*a)
    marks.append(("S1", time.perf_counter()))
    return r


for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["mid", "big-f16", "big-f32"]):
    w = WL[name]
    x = bench._inputs(dev, w)
    f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend="cupy")
    for _ in range(3):
        f()
    for instrumented in (False, True):
        cupy.cuda.driver.launchKernel = launch if instrumented else orig_launch
        cb.torch_scratch = scratch if instrumented else orig_scratch
        rows = []
        for _ in range(30):
            torch.cuda.synchronize()
            marks.clear(); events.clear()
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            e1.record()
            torch.cuda.synchronize()
            host = [(k, (t - t0) * 1e6) for k, t in marks] + [("ret", (t1 - t0) * 1e6)]
            gpu = [e0.elapsed_time(ev) * 1e3 for ev in events] + [e0.elapsed_time(e1) * 1e3]
            rows.append((host, gpu))
        med = lambda xs: st.median(xs)
        nh, ng = len(rows[0][0]), len(rows[0][1])
        host = [(rows[0][0][i][0], med([r[0][i][1] for r in rows])) for i in range(nh)]
        gpu = [med([r[1][i] for r in rows]) for i in range(ng)]
        print(f"{name:8s} instrumented={instrumented!s:5s} host µs: "
              + " ".join(f"{k}@{v:.1f}" for k, v in host)
              + " | GPU µs from e0 (after each launch, then end): " + " ".join(f"{v:.1f}" for v in gpu),
              flush=True)
    cupy.cuda.driver.launchKernel, cb.torch_scratch = orig_launch, orig_scratch
    x = None  # free this workload's arrays before the next one's
    torch.cuda.empty_cache()
