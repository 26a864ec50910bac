"""Probe (twenty-sixth session): cupy's three launches on `big` with the batch in chunks on
two streams at once (plain launches, no graph: `big`'s scratch is not kept, so it has no
replays), against the plan's three launches over the whole batch on one stream (what
cupy ships). The idea is the replays' two branches (docs/cupy.md, "Replays"), which took
6.6 µs off `mid`: one chunk's walk and each kernel's drain and fill hidden behind the
other chunk's DRAM-bound kernels.

Variants:
* ``whole``: the plan on the call's stream;
* ``two2``: two halves, the second on a side stream forked from the call's stream by an
  event and joined back by another;
* ``two4``: four quarters, 0 and 2 on the call's stream, 1 and 3 on the side stream.

Bits are checked against ``whole``; times are CUDA events on the call's stream around each
call after an empty queue, the variants interleaved, the order rotated every round.
"""
import statistics
import sys

import torch

from convcov import _frontend, _registry, bench
from convcov.backends import cupy as cb


def variants(b, plan, p, s_ptr, optr, gptr, mptr, cptr):
    lk = b._cp.cuda.driver.launchKernel
    rt = b._cp.cuda.runtime
    batch = cb._batch(plan, p)
    whole = [(cb._slots(plan), cb._Offsets(0, 0, 0, 0, plan.t_offset))]
    side = rt.streamCreateWithFlags(rt.streamNonBlocking)
    fork = rt.eventCreateWithFlags(rt.eventDisableTiming)
    join = rt.eventCreateWithFlags(rt.eventDisableTiming)

    def enqueue(chain, stream):
        slots, off = chain
        cb._enqueue(lk, slots, off.t, stream, s_ptr + off.s, optr + off.out,
                    gptr + off.gamma, mptr + off.mu, cptr, 0.0)

    def two(chains):
        def run(stream):
            rt.eventRecord(fork, stream)
            rt.streamWaitEvent(side, fork)
            for i, chain in enumerate(chains):
                enqueue(chain, stream if i % 2 == 0 else side)
            rt.eventRecord(join, side)
            rt.streamWaitEvent(stream, join)
        return run

    return {"whole": lambda st: enqueue(whole[0], st),
            "two2": two(cb._split(plan, batch, 2)),
            "two4": two(cb._split(plan, batch, 4))}


def probe(name, rounds, calls):
    w = next(x for x in bench.WORKLOADS if x.name == name)
    dev = bench._Cuda()
    a = bench._inputs(dev, w)
    b = _registry.get("cupy")
    p = _frontend.normalise(a["out"], a["gamma"], a["mu"], a["c"], w.k, 1, 0, 1, 1)
    plan = b._on_device(p.device, b._plan_of, p)
    scratch = torch.empty(plan.scratch * (8 if plan.acc == "float64" else 4),
                          dtype=torch.uint8, device="cuda")
    ptrs = [t.data_ptr() for t in (a["out"], a["gamma"], a["mu"], a["c"])]
    vs = variants(b, plan, p, scratch.data_ptr(), *ptrs)
    st = torch.cuda.current_stream()
    start = a["out"].clone()
    ref = None
    for v, fn in vs.items():
        a["out"].copy_(start)
        fn(st.cuda_stream)
        torch.cuda.synchronize()
        if ref is None:
            ref = a["out"].clone()
        else:
            same = torch.equal(a["out"], ref)
            print(name, v, "bits equal:", same, flush=True)
            assert same
    del ref, start
    times = {v: [] for v in vs}
    order = list(vs)
    for r in range(rounds):
        k = r % len(order)
        for v in order[k:] + order[:k]:
            fn = vs[v]
            for _ in range(calls):
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                e0.record(st)
                fn(st.cuda_stream)
                e1.record(st)
                e1.synchronize()
                times[v].append(e0.elapsed_time(e1) * 1000)
    base = statistics.median(times["whole"])
    for v in vs:
        m = statistics.median(times[v])
        print(f"{name:8s} {v:6s} median {m:8.1f} us  ({m - base:+7.1f} vs whole)  "
              f"min {min(times[v]):8.1f}", flush=True)
    del a, scratch
    torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    for name in ("big-f16", "big-f32"):
        probe(name, rounds, 10)
