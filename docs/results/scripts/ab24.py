"""Scratch through torch's raw allocator entry points (_arrays.torch_scratch) against
torch.empty: the allocation alone, and `mid` whole calls ABAB in one process."""
import statistics as st, sys, time
import torch, convcov
from _timing import measure
from convcov import bench, _arrays

dev = bench._Cuda()
d = torch.cuda.current_device()
s = torch.cuda.current_stream().cuda_stream
RAW = _arrays.torch_scratch
def empty_path(nbytes, dv, stream):
    t = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=torch.device("cuda", dv))
    return t, t.data_ptr()
def med(f, n=3000):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return st.median(ts) * 1e6
def alloc(fn):
    o, p = fn(7 << 20, d, s)
    del o
for rnd in range(2):
    print(f"alloc+free 7 MiB r{rnd}: raw {med(lambda: alloc(RAW)):.2f} us, torch.empty {med(lambda: alloc(empty_path)):.2f} us", flush=True)
w = {x.name: x for x in bench.WORKLOADS}["mid"]
x = bench._inputs(dev, w)
for rnd in range(2):
    for label, fn in (("torch.empty", empty_path), ("raw", RAW)):
        _arrays.torch_scratch = fn
        for be in ("numba_cuda", "cupy"):
            mod = sys.modules[f"convcov.backends.{be}"] if f"convcov.backends.{be}" in sys.modules else None
            if mod is not None:
                mod.torch_scratch = fn
            f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)
            f()
            if mod is None:
                mod = sys.modules[f"convcov.backends.{be}"]; mod.torch_scratch = fn
            for _ in range(3):
                f()
            bm = st.median(dev.time_calls(f, 60, 1.0)) * 1e6
            wh, gp = measure(f, 30)
            print(f"mid {be:10s} {label:11s} r{rnd}: bench {bm:7.1f} us, whole {wh:7.1f}, gpu {gp:7.1f}", flush=True)
