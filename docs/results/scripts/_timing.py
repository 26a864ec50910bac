"""Shared by the A/B scripts here: a call's whole time and its GPU part, alternately;
per-kernel times; one printed row of all three."""
import statistics as st
import time

import torch

#: Kernel names as the profiler reports them, shortened to these (first match wins).
TAGS = ("cc_gsum", "cc_sbox_walk", "cc_sbox", "cc_stream", "cc_direct",
        "gsum", "sbox_walk", "sbox", "stream", "direct")


def measure(f, n=40):
    """(median whole-call time, median GPU part) in µs over n calls each: the whole call
    after draining the queue (host dispatch included, as the bench times it), and the
    GPU part with the host hidden behind a sleep kernel queued first."""
    whole, gpu = [], []
    for i in range(2 * n):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hide = i % 2 == 1
        if hide:
            torch.cuda._sleep(3_000_000)
        e0.record(); f(); e1.record()
        torch.cuda.synchronize()
        (gpu if hide else whole).append(e0.elapsed_time(e1) * 1e3)
    return st.median(whole), st.median(gpu)


def kernels(f, n=5, synced=False):
    """Per-kernel GPU time of f (torch profiler), averaged over n calls: queued back to
    back, or each after an empty queue (synced)."""
    f(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            if synced:
                torch.cuda.synchronize()
            f()
        torch.cuda.synchronize()
    out = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            out.append(f"{next((g for g in TAGS if g in e.key), e.key[:20])} {t/n:.1f}")
    return ", ".join(out)


def bound_call(name, backend):
    """Workload ``name``'s bench inputs and a call of ``backend`` on them, run until its
    signature is bound (the fast path): (inputs, call, the call with its bound launcher
    replaced by a no-op: the front end alone, that bound entry)."""
    import convcov
    from convcov import _frontend, bench

    w = {w.name: w for w in bench.WORKLOADS}[name]
    x = bench._inputs(bench._Cuda(), w)

    def call():
        convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=backend)

    for _ in range(3):
        call()
    torch.cuda.synchronize()
    entry = next(e for e in _frontend._bound.values() if e is not None)
    run = entry.run

    def front():
        entry.run = lambda *a: None
        try:
            call()
        finally:
            entry.run = run

    return x, call, front, entry


def host_pieces(pieces, call, width=28, rounds=2):
    """Each of ``pieces`` (label -> function) timed with perf_counter, hot (back to back,
    synchronized every 50) and right after ``call()`` and a synchronize (the bench's
    state); medians in µs, one printed line a piece and round."""
    import time

    for rnd in range(rounds):
        for label, f in pieces.items():
            hot, synced = [], []
            for i in range(200):
                if i % 50 == 0:
                    torch.cuda.synchronize()
                t0 = time.perf_counter(); f(); hot.append(time.perf_counter() - t0)
            for i in range(60):
                call()
                torch.cuda.synchronize()
                t0 = time.perf_counter(); f(); synced.append(time.perf_counter() - t0)
            print(f"r{rnd} {label:{width}s} hot {st.median(hot) * 1e6:7.2f}   after sync "
                  f"{st.median(synced) * 1e6:7.2f}", flush=True)
    torch.cuda.synchronize()


def row(dev, f, w, bw, n=40):
    """f warmed up, then timed the bench's way (dev.time_calls), as measure() does, and
    per kernel: one line's worth."""
    for _ in range(3):
        f()
    bm = st.median(dev.time_calls(f, 60, 1.0)) * 1e6
    wh, gp = measure(f, n)
    return (f"bench {bm:8.1f} us ({w.floor_bytes()/bw/bm*1e6:5.3f}) whole {wh:8.1f} "
            f"gpu {gp:8.1f}  [{kernels(f)}]")


def rotating(sets, w, backend):
    """A call of accumulate on ``backend`` that takes the next of ``sets`` (bench inputs
    of workload ``w``) each time, as the bench rotates them."""
    import convcov

    turn = [0]

    def f():
        turn[0] = (turn[0] + 1) % len(sets)
        x = sets[turn[0]]
        convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=backend)

    return f


def knob(cupy=None, numba_cuda=None, recompile=False, convert=lambda v: v):
    """A set_flag for abab: sets module attribute ``cupy`` of convcov.backends.cupy or
    ``numba_cuda`` of convcov.backends.numba_cuda to convert(value) for that backend, and
    drops what remembers the old value (plans, bound launchers; compiled kernels too
    when ``recompile``: flags read when a kernel is made)."""
    from convcov import _frontend
    from convcov.backends import cupy as cb, numba_cuda as nc

    def set_flag(be, value):
        if be == "cupy":
            setattr(cb, cupy, convert(value))
            if recompile:
                cb.backend._modules.clear(); cb.backend._functions.clear()
            cb.backend._plans.clear()
        else:
            setattr(nc, numba_cuda, convert(value))
            if recompile:
                nc._compiled.clear(); nc._device_kernels.clear()
            nc._plans.clear()
        _frontend._bound.clear()

    return set_flag


def abab(dev, bw, names, backends, set_flag, label, flags=(False, True), rounds=2, n=40):
    """For each workload in ``names`` and each backend: ``rounds`` passes over ``flags``,
    ``set_flag(backend, flag)`` before each, one row() line each; then whether every
    flag gave the same bits (else the largest difference from the first flag's result).
    Leaves each backend at the last flag."""
    import convcov
    from convcov import bench

    workloads = {w.name: w for w in bench.WORKLOADS}
    for name in names:
        w = workloads[name]
        x = bench._inputs(dev, w)
        base = x["out"].clone()
        for be in backends:
            outs = {}
            for rnd in range(rounds):
                for flag in flags:
                    set_flag(be, flag)
                    o = base.clone()
                    convcov.accumulate(o, x["gamma"], x["mu"], x["c"], w.k, backend=be)
                    outs[flag] = o
                    f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k,  # noqa: E731
                                                   backend=be)
                    print(f"{name:8s} {be:10s} {label}={flag!s:6s} r{rnd}: {row(dev, f, w, bw, n)}",
                          flush=True)
            first = outs[flags[0]]
            diff = max((o.double() - first.double()).abs().max().item() for o in outs.values())
            print(f"   {name} {be}: " + ("same bits every way" if diff == 0 else
                                         f"max |difference| from {flags[0]}: {diff:.2e}"), flush=True)
            set_flag(be, flags[-1])
        x = base = None  # free this workload's arrays before the next one's
        torch.cuda.empty_cache()


def spin(us):
    """Keep the thread running (in Python) for ``us`` microseconds."""
    t = time.perf_counter() + us * 1e-6
    while time.perf_counter() < t:
        pass


def timed(f, how, cycles=2_000_000):
    """Queue f between two CUDA events after draining the queue: ``how`` "idle" (the
    bench's way), "warm" (after spinning 200 µs) or "gpu" (a sleep kernel of ``cycles``
    queued first hides the host's dispatch). The events; read them after a synchronize."""
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    if how == "warm":
        spin(200)
    elif how == "gpu":
        torch.cuda._sleep(cycles)
    e0.record(); f(); e1.record()
    return e0, e1


def probe_setup(argv):
    """A probe's start: (n from argv[1], default 40; the bench's CUDA device; its copy
    bandwidth, printed; the bench's workloads by name)."""
    from convcov import bench

    dev = bench._Cuda()
    bw = dev.copy_bandwidth()
    print(f"copy {bw / 1e9:.0f} GB/s", flush=True)
    return (int(argv[1]) if len(argv) > 1 else 40), dev, bw, {w.name: w for w in bench.WORKLOADS}


def gpu_median(f, n=30):
    """Median GPU time of f in µs: n calls timed(f, "gpu", 1_000_000) (the probes' timing,
    ab56.py-ab59.py)."""
    ts = []
    for _ in range(n):
        e0, e1 = timed(f, "gpu", 1_000_000)
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return st.median(ts)


def mid_inputs():
    """The bench's CUDA device, its copy bandwidth (printed), the `mid` workload and one
    set of its bench inputs."""
    from convcov import bench

    dev = bench._Cuda()
    bw = dev.copy_bandwidth()
    print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
    w = {w.name: w for w in bench.WORKLOADS}["mid"]
    return dev, bw, w, bench._inputs(dev, w)
