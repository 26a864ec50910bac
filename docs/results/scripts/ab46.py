"""Would overlapping cupy's kernels pay? On mid and big-f16, each of the plan's kernels
(gsum, walk, update) alone, pairs of them back to back on one stream, and the same pairs
on two streams at once (independent input sets A and B, each with its own scratch).
If a pair on two streams takes much less than back to back, the kernels are not at the
memory's limit alone, and a pipelined (persistent) kernel could gain. GPU times only:
the host is hidden behind a sleep kernel queued first. Medians over 30, in µs."""
import statistics as st

import cupy
import torch

import convcov
from convcov import _frontend, bench
from convcov.backends import cupy as cb

dev = bench._Cuda()
WL = {w.name: w for w in bench.WORKLOADS}
launch_kernel = cupy.cuda.driver.launchKernel
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()


def prepared(w, x):
    convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend="cupy")
    p = _frontend.normalise(x["out"], x["gamma"], x["mu"], x["c"], w.k, 1, 0, 1, 1)
    plan = cb.backend._plan_of(0, p)
    buf = torch.empty(plan.scratch, dtype=torch.float32, device="cuda")
    s_ptr = buf.data_ptr()
    args = [cb._fill(ln, x["out"].data_ptr(), x["gamma"].data_ptr(), x["mu"].data_ptr(),
                     x["c"].data_ptr(), s_ptr + plan.t_offset, s_ptr, 0) for ln in plan.launches]
    return plan, args, buf


def timed(jobs, n=30):
    """jobs: list of (stream, [(launch, args), ...]); every stream starts after one event
    and the clock stops when all are done."""
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s1):
            torch.cuda._sleep(2_000_000)
            e0.record()
        for s, seq in jobs:
            s.wait_event(e0)
            for ln, a in seq:
                cb._cu_launch(launch_kernel, ln, a, s.cuda_stream)
        for s, _ in jobs:
            if s is not s1:
                ev = torch.cuda.Event()
                ev.record(s)
                s1.wait_event(ev)
        with torch.cuda.stream(s1):
            e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return st.median(ts)


for name in ("mid", "big-f16"):
    w = WL[name]
    xa, xb = bench._inputs(dev, w), bench._inputs(dev, w)
    (pa, aa, ba), (pb, ab, bb) = prepared(w, xa), prepared(w, xb)
    K = ("gsum", "walk", "upd")
    A = dict(zip(K, zip(pa.launches, aa)))
    Bk = dict(zip(K, zip(pb.launches, ab)))
    cases = {
        "all3 A": [(s1, [A["gsum"], A["walk"], A["upd"]])],
        "gsum A": [(s1, [A["gsum"]])],
        "walk A": [(s1, [A["walk"]])],
        "upd B": [(s1, [Bk["upd"]])],
        "gsum A; upd B (1 stream)": [(s1, [A["gsum"], Bk["upd"]])],
        "gsum A | upd B (2 streams)": [(s1, [A["gsum"]]), (s2, [Bk["upd"]])],
        "gsum A; gsum B (1 stream)": [(s1, [A["gsum"], Bk["gsum"]])],
        "gsum A | gsum B (2 streams)": [(s1, [A["gsum"]]), (s2, [Bk["gsum"]])],
        "upd A; upd B (1 stream)": [(s1, [A["upd"], Bk["upd"]])],
        "upd A | upd B (2 streams)": [(s1, [A["upd"]]), (s2, [Bk["upd"]])],
        "all3 A; all3 B (1 stream)": [(s1, [A["gsum"], A["walk"], A["upd"],
                                             Bk["gsum"], Bk["walk"], Bk["upd"]])],
        "all3 A | all3 B (2 streams)": [(s1, [A["gsum"], A["walk"], A["upd"]]),
                                         (s2, [Bk["gsum"], Bk["walk"], Bk["upd"]])],
    }
    for rnd in range(2):
        for label, jobs in cases.items():
            print(f"{name:8s} r{rnd} {label:30s} {timed(jobs):8.1f} us", flush=True)
    del xa, xb, ba, bb
    torch.cuda.empty_cache()
