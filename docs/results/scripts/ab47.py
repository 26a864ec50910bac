"""Would one call gain from running its batch in chunks on two streams (the chunks'
kernels overlapping: one chunk's update beside the next one's channel sum and walk)?
cupy's plan for mid (and big-f16) split into C chunks of B / C batch elements (the same
kernels, pointers offset, B and the work counts scaled), launched on 1, 2 or 4 streams
in turn, forked from and joined back to the first. GPU part (host hidden behind a sleep
kernel) and whole (after an empty queue, host launches included), medians over 30, µs;
then whether every way gave the same bits as the shipped call."""
import cupy
import torch

import convcov
from convcov import _frontend, bench
from convcov.backends import cupy as cb

from _timing import measure

dev = bench._Cuda()
WL = {w.name: w for w in bench.WORKLOADS}
launch_kernel = cupy.cuda.driver.launchKernel
streams = [torch.cuda.current_stream()] + [torch.cuda.Stream() for _ in range(3)]
SL = cb._SLOT


def chunked(w, x, C):
    """[(chunk's launches with filled args)] for C chunks of the call on x."""
    p = _frontend.normalise(x["out"], x["gamma"], x["mu"], x["c"], w.k, 1, 0, 1, 1)
    plan = cb.backend._plan_of(0, p)
    buf = torch.empty(plan.scratch, dtype=torch.float32, device="cuda")
    s_ptr = buf.data_ptr()
    size = x["out"].element_size()
    B, G, HW, HoWo = p.B, p.G, p.H * p.W, p.Ho * p.Wo
    bc = B // C
    chunks = []
    for k in range(C):
        b0 = k * bc
        seq = []
        for ln in plan.launches:
            a = cb._fill(ln, x["out"].data_ptr(), x["gamma"].data_ptr(), x["mu"].data_ptr(),
                         x["c"].data_ptr(), s_ptr + plan.t_offset, s_ptr, 0)
            a[SL["out"]] += b0 * a[SL["so0"]] * size
            a[SL["gamma"]] += b0 * a[SL["sg0"]] * size
            a[SL["mu"]] += b0 * a[SL["sm0"]] * size
            a[SL["t"]] += b0 * G * HW * HW * 4
            a[SL["s"]] += b0 * G * HoWo * HoWo * 4
            a[SL["n"]] = a[SL["n"]] * bc // B
            a[SL["B"]] = bc
            grid = max(1, ln.grid * bc // B)
            seq.append((cb._Launch(ln.func, grid, a), a))
        chunks.append(seq)
    return chunks, buf


def enqueue(chunks, ns):
    main = streams[0]
    if ns > 1:
        fork = torch.cuda.Event()
        fork.record(main)
        for s in streams[1:ns]:
            s.wait_event(fork)
    for k, seq in enumerate(chunks):
        s = streams[k % ns]
        for ln, a in seq:
            cb._cu_launch(launch_kernel, ln, a, s.cuda_stream)
    for s in streams[1:ns]:
        ev = torch.cuda.Event()
        ev.record(s)
        main.wait_event(ev)


for name in ("mid", "big-f16"):
    w = WL[name]
    x = bench._inputs(dev, w)
    base = x["out"].clone()
    ref = base.clone()
    convcov.accumulate(ref, x["gamma"], x["mu"], x["c"], w.k, backend="cupy")
    shipped = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k,  # noqa: E731
                                         backend="cupy")
    ways = [(1, 1), (2, 1), (2, 2), (4, 1), (4, 2), (4, 4), (8, 2), (16, 2)]
    if name != "mid":
        ways = [(1, 1), (2, 2), (4, 2)]
    made = {}
    for C, ns in ways:
        if C not in made:
            made[C] = chunked(w, x, C)
    for rnd in range(2):
        wh, g = measure(shipped, 30)
        print(f"{name:8s} r{rnd} shipped call           gpu {g:8.1f} whole {wh:8.1f}", flush=True)
        for C, ns in ways:
            wh, g = measure(lambda: enqueue(made[C][0], ns), 30)
            print(f"{name:8s} r{rnd} {C:2d} chunks, {ns} streams  gpu {g:8.1f} whole {wh:8.1f}",
                  flush=True)
    for C, ns in ways:
        x["out"].copy_(base)
        enqueue(made[C][0], ns)
        torch.cuda.synchronize()
        same = torch.equal(x["out"], ref)
        print(f"{name:8s} {C:2d} chunks, {ns} streams: {'same bits' if same else 'DIFFERENT'}",
              flush=True)
    del x, base, ref, made
    torch.cuda.empty_cache()
