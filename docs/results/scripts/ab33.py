"""What the hardware gives for mid's access patterns, beside the kernels that use them.

mid's out is in the full layout: its channel-diagonal is 100352 rows of 784 bytes, one
every 25088 bytes (and gamma's, 131072 rows of 1 KB, one every 32 KB). cupy's cc_stream
reads and writes those rows at about 2.8 TB/s, its cc_gsum reads gamma's at about 3.5.
This times plain probe kernels on the same rows of the same tensors (x = a * x, 16-byte
vectors, 1, 4 or 8 vectors a thread, every load before the first store; or a read-only
sum), and on a contiguous buffer of the same bytes, so the gap between the kernels and
the pattern's own speed is measured, not guessed. Per-kernel times of both backends'
mid for reference."""
import statistics as st

import cupy as cp
import torch

import convcov
from _timing import kernels
from convcov import bench

PROBE = r"""
typedef long long i64;
// Row r = (q, p) with q = b * C + c (a plane: one (b, c)) and p < rpp is at
// b * bstride + c * plane + p * rstride floats from base; its vector e 4 e floats on.
template <int P, int MODE>  // MODE 0: x = a * x; 1: read only (a sum, stored if impossible)
__global__ void probe(float* base, i64 nrows, int rvec, int rpp, int C, i64 rstride,
                      i64 plane, i64 bstride, float a, float* sink) {
  const i64 nvec = nrows * rvec;
  const i64 first = ((i64)blockIdx.x * blockDim.x * P) + threadIdx.x;
  float4 v[P];
  i64 off[P];
  float s = 0.f;
#pragma unroll
  for (int k = 0; k < P; ++k) {
    const i64 f = first + (i64)k * blockDim.x;
    off[k] = -1;
    if (f < nvec) {
      const i64 r = f / rvec, e = f - r * rvec, q = r / rpp, p = r - q * rpp;
      off[k] = (q / C) * bstride + (q % C) * plane + p * rstride + 4 * e;
      v[k] = *(const float4*)(base + off[k]);
    }
  }
#pragma unroll
  for (int k = 0; k < P; ++k) {
    if (off[k] < 0) continue;
    if (MODE == 0) {
      float4 w = v[k];
      w.x *= a; w.y *= a; w.z *= a; w.w *= a;
      *(float4*)(base + off[k]) = w;
    } else {
      s += v[k].x + v[k].y + v[k].z + v[k].w;
    }
  }
  if (MODE == 1 && s == 12345.f) *sink = s;
}
"""
names = [f"probe<{p}, {m}>" for p in (1, 4, 8) for m in (0, 1)]
mod = cp.RawModule(code=PROBE, options=("-std=c++14",), name_expressions=names)

dev = bench._Cuda()
bw = dev.copy_bandwidth()
print(f"copy bandwidth {bw/1e9:.0f} GB/s", flush=True)
w = {w.name: w for w in bench.WORKLOADS}["mid"]
x = bench._inputs(dev, w)
out, gamma = x["out"], x["gamma"]
sink = torch.zeros(1, device="cuda")
B, Co, Ho = out.shape[0], out.shape[1], out.shape[2]
Ci, H = gamma.shape[1], gamma.shape[2]
THREADS = 256


def time_gpu(f, n=30):
    ts = []
    for _ in range(n):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # the host's launch hidden
        e0.record(); f(); e1.record()
        torch.cuda.synchronize()
        ts.append(e0.elapsed_time(e1) * 1e3)
    return st.median(ts)


def launcher(t, C, n, p, mode, contiguous):
    """One launch over t's channel-diagonal rows (n floats each, n a plane), or over the
    same number of bytes contiguous from t's start."""
    s = t.stride()
    if contiguous:
        rstride, plane, bstride = n, n * n, C * n * n
    else:
        rstride, plane, bstride = s[3], s[1] + s[4], s[0]
    nrows, rvec = B * C * n, n // 4
    grid = -(-nrows * rvec // (THREADS * p))
    k = mod.get_function(f"probe<{p}, {mode}>")
    args = (cp.uint64(t.data_ptr()), cp.int64(nrows), cp.int32(rvec), cp.int32(n),
            cp.int32(C), cp.int64(rstride), cp.int64(plane), cp.int64(bstride),
            cp.float32(1.0), cp.uint64(sink.data_ptr()))
    return lambda: k((grid,), (THREADS,), args)


# torch's current stream here is the legacy default stream, as is CuPy's: one order.
for tname, t, C, n in (("out diag", out, Co, Ho * Ho), ("gamma diag", gamma, Ci, H * H)):
    nbytes = B * C * n * n * 4
    for contiguous in (False, True):
        for mode in (0, 1):
            for p in (1, 4, 8):
                f = launcher(t, C, n, p, mode, contiguous)
                f(); torch.cuda.synchronize()
                us = time_gpu(f)
                moved = nbytes * (2 if mode == 0 else 1)
                print(f"{tname:10s} {'contiguous' if contiguous else 'rows':10s} "
                      f"{'x=a*x' if mode == 0 else 'read':5s} P={p}: {us:7.1f} us, "
                      f"{moved/us/1e6:5.2f} TB/s", flush=True)

for be in ("cupy", "numba_cuda"):
    f = lambda: convcov.accumulate(out, gamma, x["mu"], x["c"], w.k, backend=be)  # noqa: E731
    f(); torch.cuda.synchronize()
    print(f"mid {be:10s} kernels: {kernels(f, n=10)}", flush=True)
