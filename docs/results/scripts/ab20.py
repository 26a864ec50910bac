"""(docs/results/scripts; run from the repository root on the GPU machine.) The front end's fast path (bound launchers) against the full path, ABAB in one
process: whole call the bench's way, the GPU part (host hidden behind a sleep kernel),
bit-equality of the two paths; then host parts of the fast path."""
import statistics as st, sys, time
import torch, convcov
from _timing import measure
from convcov import bench, _frontend

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s; {dev.describe()}", flush=True)
WL = {w.name: w for w in bench.WORKLOADS}
FAST = _frontend._torch_fast
def mode(fast):
    _frontend._torch_fast = FAST if fast else (lambda *a: None)

names = sys.argv[1].split(",") if len(sys.argv) > 1 else ["toy", "mid", "big-f32", "big-f16"]
for name in names:
    w = WL[name]
    x = bench._inputs(dev, w)
    base = x["out"].clone()
    for be in ("cupy", "numba_cuda"):
        f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)
        outs = {}
        for fast in (False, True):
            mode(fast)
            o = base.clone()
            for _ in range(3):
                convcov.accumulate(o, x["gamma"], x["mu"], x["c"], w.k, backend=be)
            outs[fast] = o
        same = bool(torch.equal(outs[False], outs[True]))
        for rnd in range(2):
            for fast in (False, True):
                mode(fast)
                for _ in range(3):
                    f()
                bench_med = st.median(dev.time_calls(f, 60, 1.0)) * 1e6
                wh, gp = measure(f)
                print(f"{name:8s} {be:10s} {'fast' if fast else 'full'} r{rnd}: bench {bench_med:8.1f} us "
                      f"({w.floor_bytes()/bw/bench_med*1e6:5.3f}) | whole {wh:8.1f} gpu {gp:8.1f} diff {wh-gp:6.1f}"
                      + (f"   same bits: {same}" if rnd == 0 and fast else ""), flush=True)
        del outs
    mode(True)
    del x, base
    torch.cuda.empty_cache()

# Host parts on the toy signature (fast path bound), perf_counter medians.
w = WL["toy"]; x = bench._inputs(dev, w)
args = (x["out"], x["gamma"], x["mu"], x["c"], w.k)
def med(f, n=2000):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return st.median(ts) * 1e6
for be in ("cupy", "numba_cuda"):
    convcov.accumulate(*args, backend=be)
    key = [k for k in _frontend._bound if be in k][0]
    e = _frontend._bound[key]
    o, g, m, c = x["out"], x["gamma"], x["mu"], x["c"]
    print(f"host {be}: whole call {med(lambda: convcov.accumulate(*args, backend=be)):.1f} us, "
          f"bound launcher alone {med(lambda: e.run(o, g, m, c, o.data_ptr(), g.data_ptr(), m.data_ptr(), c.data_ptr(), 0.0)):.1f} us, "
          f"full path {med(lambda: (mode(False), convcov.accumulate(*args, backend=be), mode(True))):.1f} us", flush=True)
print(f"host: normalise {med(lambda: _frontend.normalise(*args, 1, 0, 1, 1)):.1f} us, "
      f"torch.empty(1M) {med(lambda: torch.empty(1 << 20, dtype=torch.float32, device=x['out'].device)):.1f} us, "
      f"raw alloc+delete {med(lambda: torch._C._cuda_cudaCachingAllocator_raw_delete(torch._C._cuda_cudaCachingAllocator_raw_alloc(4 << 20, torch.cuda.current_stream().cuda_stream))):.1f} us, "
      f"current_stream {med(lambda: torch._C._cuda_getCurrentRawStream(0)):.2f} us, "
      f"event record {med(lambda: torch.cuda.Event(enable_timing=True).record()):.1f} us", flush=True)
import cProfile, pstats
pr = cProfile.Profile(); pr.enable()
for _ in range(2000):
    convcov.accumulate(*args, backend="numba_cuda")
pr.disable(); torch.cuda.synchronize()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
