"""Does the size of the kernel's parameters change a launch's latency? An empty kernel
taking 8, 128, 584 (convcov's Args) or 2048 bytes by value, launched through CuPy's
driver binding as convcov launches: host time of the call, and event-to-event time of
a drained single launch."""
import array, statistics, time
import cupy as cp
import torch

SIZES = (8, 128, 584, 2048)
src = "".join(f"struct P{n} {{ long long v[{n // 8}]; }};\n"
              f"extern \"C\" __global__ void k{n}(const P{n} a) {{ if (a.v[0] == 12345) *(long long*)a.v[1] = 1; }}\n"
              for n in SIZES)
mod = cp.RawModule(code=src)
funcs = {n: mod.get_function(f"k{n}").kernel.ptr for n in SIZES}
launch = cp.cuda.driver.launchKernel
stream = torch.cuda.current_stream().cuda_stream
torch.cuda.synchronize()
res = {}
for rnd in range(3):
    for n in SIZES:
        args = array.array("q", [0] * (n // 8))
        params = array.array("Q", (args.buffer_info()[0],))
        pp = params.buffer_info()[0]
        f = funcs[n]
        for _ in range(20):
            launch(f, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
        torch.cuda.synchronize()
        host, ev = [], []
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(300):
            torch.cuda.synchronize()
            e0.record()
            t0 = time.perf_counter()
            launch(f, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
            t1 = time.perf_counter()
            e1.record()
            e1.synchronize()
            host.append((t1 - t0) * 1e6)
            ev.append(e0.elapsed_time(e1) * 1e3)
        # three in a row (as a call does), drained before
        three = []
        for _ in range(300):
            torch.cuda.synchronize()
            e0.record()
            launch(f, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
            launch(f, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
            launch(f, 1, 1, 1, 32, 1, 1, 0, stream, pp, 0)
            e1.record()
            e1.synchronize()
            three.append(e0.elapsed_time(e1) * 1e3)
        print(f"round {rnd} params {n:5d} B: launch call {statistics.median(host):5.2f} us (p10 {sorted(host)[30]:5.2f}), "
              f"event-to-event one {statistics.median(ev):5.2f} us, three {statistics.median(three):5.2f} us", flush=True)
