"""The walk over (b, g) planes last to first (WALK_BACKWARDS) against first to last, both
backends, ABAB in one process: whole call the bench's way, the GPU part (host hidden
behind a sleep kernel), per-kernel times, bit-equality."""
import statistics as st, sys
import torch, convcov
from _timing import kernels, measure
from convcov import bench, _frontend
from convcov.backends import cupy as cb, numba_cuda as nc

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
WL = {w.name: w for w in bench.WORKLOADS}


OPT = cb._OPTIONS
def back(be, flag):
    if be == "cupy":
        cb._OPTIONS = OPT if flag else OPT + ("-DWALK_BACKWARDS=0",)
        cb.backend._modules.clear(); cb.backend._functions.clear(); cb.backend._plans.clear()
    else:
        nc.WALK_BACKWARDS = flag
        nc._compiled.clear(); nc._device_kernels.clear(); nc._plans.clear()
    _frontend._bound.clear()

for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "big-f32", "mid"]):
    w = WL[name]
    x = bench._inputs(dev, w)
    base = x["out"].clone()
    for be in ("cupy", "numba_cuda"):
        outs = {}
        for rnd in range(2):
            for flag in (False, True):
                back(be, flag)
                o = base.clone()
                convcov.accumulate(o, x["gamma"], x["mu"], x["c"], w.k, backend=be)
                outs[flag] = o
                f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)
                for _ in range(3):
                    f()
                bm = st.median(dev.time_calls(f, 60, 1.0)) * 1e6
                wh, gp = measure(f)
                print(f"{name:8s} {be:10s} backwards={flag!s:5s} r{rnd}: bench {bm:8.1f} us ({w.floor_bytes()/bw/bm*1e6:5.3f})"
                      f" whole {wh:8.1f} gpu {gp:8.1f}  [{kernels(f)}]", flush=True)
            print(f"   {name} {be}: same bits both ways: {bool(torch.equal(outs[False], outs[True]))}", flush=True)
        back(be, True)
    del x, base, outs
    torch.cuda.empty_cache()
