"""Where numba_cuda's host time goes on `mid`, before and after the `big` workloads ran in
the same process (ab21/ab22 saw its whole call 30-100 µs above its GPU part there, cupy's
not): whole call and GPU part; per-part host times inside the bound launcher; whether the
device's context is current (else every call pushes Numba's)."""
import statistics as st, time
import torch, convcov
from _timing import measure
from convcov import bench, _frontend
from convcov.backends import numba_cuda as nc

dev = bench._Cuda()
WL = {w.name: w for w in bench.WORKLOADS}
parts = {}

def timed(obj, name):
    orig = getattr(obj, name)
    def w(*a, **k):
        t = time.perf_counter(); r = orig(*a, **k)
        parts.setdefault(name, []).append((time.perf_counter() - t) * 1e6); return r
    setattr(obj, name, w)
    return orig

def report(label, be, x, w):
    f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)
    for _ in range(5):
        f()
    res = []
    for _ in range(3):
        wh, gp = measure(f, 30)
        res.append(f"{wh:.1f}/{gp:.1f}")
    ctx = nc._current_context()
    print(f"{label:24s} {be:10s} whole/gpu {', '.join(res)} us; context current: {nc._ready.get(0) == ctx} "
          f"({nc._ready.get(0)} vs {ctx})", flush=True)

mid = WL["mid"]
xm = bench._inputs(dev, mid)
for be in ("numba_cuda", "cupy"):
    report("mid, fresh", be, xm, mid)
for big in ("big-f16", "big-f32"):
    wb = WL[big]
    xb = bench._inputs(dev, wb)
    for be in ("numba_cuda", "cupy"):
        for _ in range(5):
            convcov.accumulate(xb["out"], xb["gamma"], xb["mu"], xb["c"], wb.k, backend=be)
    del xb
    torch.cuda.empty_cache()
    for be in ("numba_cuda", "cupy"):
        report(f"mid, after {big}", be, xm, mid)

# Per-part host times inside numba_cuda's bound launcher (wrappers add ~0.3 µs each).
for name in ("_current_context", "_driver_stream", "_workspace", "current_stream", "_bits"):
    timed(nc, name)
orig_call = nc._Launch.__call__
def call(self, stream, values):
    t = time.perf_counter(); orig_call(self, stream, values)
    parts.setdefault(f"launch {self.name}", []).append((time.perf_counter() - t) * 1e6)
nc._Launch.__call__ = call
f = lambda: convcov.accumulate(xm["out"], xm["gamma"], xm["mu"], xm["c"], mid.k, backend="numba_cuda")
_frontend._bound.clear()
f()
wall = []
for _ in range(300):
    torch.cuda.synchronize()
    t = time.perf_counter(); f(); wall.append((time.perf_counter() - t) * 1e6)
torch.cuda.synchronize()
q = lambda v: f"median {st.median(v):6.1f}  p90 {sorted(v)[int(0.9 * len(v))]:6.1f}  max {max(v):7.1f}"
print(f"{'whole call (host)':22s} {q(wall)}")
for k, v in parts.items():
    print(f"{k:22s} {q(v[-300:])}  (n={len(v)})")
