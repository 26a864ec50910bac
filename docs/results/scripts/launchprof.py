"""What one kernel launch costs the host on the H200 machine, through CuPy's driver
binding (cuLaunchKernel), by the size of the parameter block (8 bytes, or a 560-byte
struct like convcov's Args), by how the parameters are passed (kernelParams, or the
'extra' buffer), and by stream (torch's current, which is the legacy default stream
here, or a non-blocking one). Medians of perf_counter around the call, in µs: hot
(back to back, synchronized every 100) and right after a synchronize."""
import array
import statistics as st
import time

import cupy
import torch

SRC = r"""
struct P { long long v[70]; };
extern "C" __global__ void k_small(long long a) { if (a == 12345 && threadIdx.x == 999) asm("trap;"); }
extern "C" __global__ void k_big(const P p) { if (p.v[3] == 12345 && threadIdx.x == 999) asm("trap;"); }
"""
mod = cupy.RawModule(code=SRC)
fs, fb = mod.get_function("k_small").kernel, mod.get_function("k_big").kernel
lk = cupy.cuda.driver.launchKernel
small = array.array("q", [1])
big = array.array("q", [1] * 70)
ps = array.array("Q", (small.buffer_info()[0],))
pb = array.array("Q", (big.buffer_info()[0],))
size = array.array("Q", [70 * 8])
extra = array.array("Q", (1, big.buffer_info()[0], 2, size.buffer_info()[0], 0))
nb = cupy.cuda.Stream(non_blocking=True)
torch.cuda.synchronize()
streams = {"torch current": torch.cuda.current_stream().cuda_stream, "non-blocking": nb.ptr}


def launch(f, params, ex, s):
    return lambda: lk(f.ptr, 1, 1, 1, 32, 1, 1, 0, s, params, ex)


for rnd in range(2):
    for sname, s in streams.items():
        cases = {
            "8-byte param": launch(fs, ps.buffer_info()[0], 0, s),
            "560-byte param": launch(fb, pb.buffer_info()[0], 0, s),
            "560-byte via extra": launch(fb, 0, extra.buffer_info()[0], s),
            "560 + array per call": lambda s=s: lk(fb.ptr, 1, 1, 1, 32, 1, 1, 0, s, array.array(
                "Q", (big.buffer_info()[0],)).buffer_info()[0], 0),
        }
        for label, f in cases.items():
            hot, synced = [], []
            for i in range(300):
                if i % 100 == 0:
                    torch.cuda.synchronize(); nb.synchronize()
                t0 = time.perf_counter(); f(); hot.append(time.perf_counter() - t0)
            for i in range(60):
                torch.cuda.synchronize(); nb.synchronize()
                t0 = time.perf_counter(); f(); synced.append(time.perf_counter() - t0)
            print(f"r{rnd} {sname:14s} {label:22s} hot {st.median(hot) * 1e6:6.2f}  "
                  f"after sync {st.median(synced) * 1e6:6.2f}", flush=True)
    t = torch.empty(1, device="cuda")
    hot = []
    for i in range(300):
        t0 = time.perf_counter(); t.add_(1); hot.append(time.perf_counter() - t0)
    print(f"r{rnd} torch t.add_(1) (a launch through torch) hot {st.median(hot) * 1e6:6.2f}",
          flush=True)
torch.cuda.synchronize()
