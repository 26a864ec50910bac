"""The out update (the last launch) with its grid capped at a few blocks per
multiprocessor (the kernels loop over their tiles with the grid's stride) against one
block a tile, both backends, rounds in one process: whole call, GPU part, same bits."""
import sys
import torch, convcov
from _timing import measure
from convcov import bench, _frontend
from convcov.backends import cupy as cb, numba_cuda as nc

dev = bench._Cuda()
bw = dev.copy_bandwidth()
SMS = torch.cuda.get_device_properties(0).multi_processor_count
print(f"copy bandwidth {bw/1e9:.0f} GB/s, {SMS} SMs", flush=True)
WL = {w.name: w for w in bench.WORKLOADS}

def plan_of(be):
    plans = cb.backend._plans if be == "cupy" else nc._plans
    (plan,) = plans.values()
    return plan

for name in (sys.argv[1].split(",") if len(sys.argv) > 1 else ["big-f16", "big-f32", "mid"]):
    w = WL[name]
    x = bench._inputs(dev, w)
    base = x["out"].clone()
    for be in ("cupy", "numba_cuda"):
        cb.backend._plans.clear(); nc._plans.clear(); _frontend._bound.clear()
        f = lambda: convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)
        f()
        last = plan_of(be).launches[-1]
        full = last.grid
        ref = None
        for rnd in range(2):
            for per_sm in (None, 2, 4, 8, 16, 32):
                last.grid = full if per_sm is None else min(full, per_sm * SMS)
                o = base.clone()
                convcov.accumulate(o, x["gamma"], x["mu"], x["c"], w.k, backend=be)
                same = True if ref is None else bool(torch.equal(o, ref))
                ref = o if ref is None else ref
                for _ in range(3):
                    f()
                wh, gp = measure(f, 25)
                print(f"{name:8s} {be:10s} grid {last.grid:7d} ({'one block a tile' if per_sm is None else f'{per_sm} a SM'}) r{rnd}: "
                      f"whole {wh:8.1f} gpu {gp:8.1f} ({w.floor_bytes()/bw/gp*1e6:5.3f})  same bits {same}", flush=True)
        last.grid = full
    del x, base, ref
    torch.cuda.empty_cache()
