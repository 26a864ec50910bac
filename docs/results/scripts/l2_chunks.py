"""Probe (twenty-fifth session): cupy's three launches on `big`, the batch in N chunks
one after another on one stream, so that a chunk's T and S may still be in L2 when the
next kernel reads them (T: 4 MiB a batch element, S: 3.3 MiB, float32; the H200's L2 is
50 MB). Against the plan's three launches over the whole batch (what cupy ships).

Variants, per N:
* ``seqN``: chunk k's gsum, walk and update, then chunk k+1's, each chunk with its own
  S and T (the offsets _split gives);
* ``shareN``: the same with every chunk's S and T at the same addresses (the scratch of
  one chunk: lines rewritten while still in L2 need not be written back);
* ``tN``: gsum and walk per chunk (T in L2), then one update over the whole batch.

Bits are checked against the whole-batch launches; times are CUDA events around each
call after an empty queue, the variants interleaved, the order rotated every round.
"""
import statistics
import sys

import torch

from convcov import _frontend, _registry, bench
from convcov.backends import cupy as cb

NS = (2, 4, 8, 16)


def variants(b, plan, p, s_ptr, optr, gptr, mptr, cptr):
    lk = b._cp.cuda.driver.launchKernel
    batch = cb._batch(plan, p)
    whole = [(cb._slots(plan), cb._Offsets(0, 0, 0, 0, plan.t_offset))]

    def run(chains, stream, upto=3, tail=None):
        for slots, off in chains:
            cb._enqueue(lk, slots[:upto], off.t, stream, s_ptr + off.s, optr + off.out,
                        gptr + off.gamma, mptr + off.mu, cptr, 0.0)
        if tail is not None:
            slots, off = tail[0]
            cb._enqueue(lk, slots[upto:], off.t, stream, s_ptr + off.s, optr, gptr, mptr,
                        cptr, 0.0)

    out = {"whole": lambda st: run(whole, st)}
    for n in NS:
        if n > p.B:
            continue
        seq = cb._split(plan, batch, n)
        shared = [(slots, cb._Offsets(off.out, off.gamma, off.mu, 0, plan.t_offset))
                  for slots, off in seq]
        out[f"seq{n}"] = lambda st, c=seq: run(c, st)
        out[f"share{n}"] = lambda st, c=shared: run(c, st)
        out[f"t{n}"] = lambda st, c=seq: run(c, st, upto=2, tail=whole)
    return out


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
    # Bits: every variant from the same start, against the whole batch.
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
        print(f"{name:8s} {v:8s} median {m:8.1f} us  ({m - base:+7.1f} vs whole)  "
              f"min {min(times[v]):8.1f}", flush=True)
    del a, scratch
    torch.cuda.empty_cache()


if __name__ == "__main__":
    print(torch.__version__, torch.cuda.get_device_name(0), flush=True)
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 4
    for name in ("big-f16", "big-f32"):
        probe(name, rounds, 10)
