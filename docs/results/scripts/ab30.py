"""mid, both GPU backends: one input set against three rotating ones (the bench's way
for mid, so that calls are not served from L2), whole calls the bench's way and the GPU
part (host hidden behind a sleep kernel), ABAB in one process."""
import statistics as st
import torch, convcov
from convcov import bench

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
w = {w.name: w for w in bench.WORKLOADS}["mid"]
sets = [bench._inputs(dev, w) for _ in range(3)]


def gpu_part(f, n=40):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(3_000_000)
        e0.record(); f(); e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return st.median(ts)


for be in ("numba_cuda", "cupy"):
    for rnd in range(2):
        for nsets in (1, 3):
            turn = [0]

            def f():
                turn[0] = (turn[0] + 1) % nsets
                x = sets[turn[0]]
                convcov.accumulate(x["out"], x["gamma"], x["mu"], x["c"], w.k, backend=be)

            for _ in range(6):
                f()
            bm = st.median(dev.time_calls(f, 60, 1.0)) * 1e6
            print(f"mid {be:10s} r{rnd} sets={nsets}: bench {bm:7.1f} us ({w.floor_bytes()/bw/bm*1e6:5.3f})"
                  f"  gpu part {gpu_part(f):7.1f} us", flush=True)
